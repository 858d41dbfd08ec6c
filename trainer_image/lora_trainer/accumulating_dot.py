"""Matmuls on bfloat16 (or float16) operands that accumulate in float32, forward and backward.

Why this exists (docs/benchmarks.md, "Trainer: findings"): XLA's CPU backend runs a
`bf16 x bf16 -> bf16` dot by converting both operands to float32 and running a float32 dot
(~180 GFLOP/s on the benchmark machine), while `bf16 x bf16 -> f32` runs natively on
bfloat16 hardware (AVX512_BF16 via YNNPACK, ~360 GFLOP/s). JAX's own transpose rules feed the
float32 cotangent of such a dot back into mixed-precision dots, so the backward would fall
back to the slow path; `accumulating_dot_general` states its backward with bfloat16 operands.

The numbers do not change: a product of two bfloat16 values is exact in float32, and every
backend (TPU and GPU included) accumulates bfloat16 dots in float32 anyway; the result is
rounded once, by the caller. Float32 operands never take this path.

`contract` (one einsum as one `dot_general` with a fixed operand order) is shared with the
LoRA provider's hand-written backward.
"""

from __future__ import annotations

import functools
import math
import string
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from lora_trainer.models.remat import PRODUCTS

DotDims = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]


def is_low_precision(*operands: Any) -> bool:
    """True when every operand is a JAX/NumPy array of one 16-bit float dtype (bfloat16 or float16)."""
    dtypes = {getattr(x, "dtype", None) for x in operands}
    if len(dtypes) != 1:
        return False
    (dtype,) = dtypes
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 2


def contract(lhs_sub: str, rhs_sub: str, out_sub: str, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    """`einsum(f"{lhs_sub},{rhs_sub}->{out_sub}")` as one dot_general with `lhs` as its first operand.

    `jnp.einsum` may pick the operand order itself; XLA then decides which operand to copy
    into a transposed layout from that order, so it is fixed here. Letters in both operands
    and the output are batch dims, in both only are contracted; the result (dot_general's
    batch, lhs-free, rhs-free order) is transposed to `out_sub`. Operands of one 16-bit float
    dtype accumulate in float32 and the result stays float32; otherwise they are promoted as
    `jnp.einsum` promotes them (a bfloat16 activation with float32 LoRA params: float32).
    """
    batch = [c for c in lhs_sub if c in rhs_sub and c in out_sub]
    contracted = [c for c in lhs_sub if c in rhs_sub and c not in out_sub]
    dims = (
        (tuple(lhs_sub.index(c) for c in contracted), tuple(rhs_sub.index(c) for c in contracted)),
        (tuple(lhs_sub.index(c) for c in batch), tuple(rhs_sub.index(c) for c in batch)),
    )
    got = "".join(batch) + "".join(c for c in lhs_sub if c not in rhs_sub) + "".join(c for c in rhs_sub if c not in lhs_sub)
    if is_low_precision(lhs, rhs):
        out = native_dot(lhs, rhs, dims)
    else:
        dtype = jnp.result_type(lhs, rhs)
        out = jax.lax.dot_general(lhs.astype(dtype), rhs.astype(dtype), dims)
    return out if got == out_sub else jnp.transpose(out, [got.index(c) for c in out_sub])


def native_dot(lhs: jax.Array, rhs: jax.Array, dims: DotDims) -> jax.Array:
    """`dot_general(lhs, rhs, dims)` of two 16-bit operands as float32, in a form XLA:CPU runs natively.

    XLA's CPU backend runs a 16-bit dot with one batch dimension natively, but upcasts both
    operands to float32 when the dot has two or more (attention's `BTHGD,BSHD->BHGTS`: batch and
    kv head), at half the speed. On CPU several batch dims are therefore merged into one (and the
    free and contracted dims of each operand into one each), as the transposed copies XLA makes
    for such a dot anyway; the result is reshaped back to dot_general's output order. Other
    backends get the dot as written (their sharded batch dims stay separate).
    """
    (lc, rc), (lb, rb) = dims
    if len(lb) < 2 or jax.default_backend() != "cpu":
        return jax.lax.dot_general(lhs, rhs, dims, preferred_element_type=jnp.float32)
    lf = [i for i in range(lhs.ndim) if i not in lc and i not in lb]
    rf = [i for i in range(rhs.ndim) if i not in rc and i not in rb]
    batch = [lhs.shape[i] for i in lb]
    lhs_free, rhs_free = [lhs.shape[i] for i in lf], [rhs.shape[i] for i in rf]
    n, k = math.prod(batch), math.prod(lhs.shape[i] for i in lc)
    lhs3 = jnp.transpose(lhs, (*lb, *lf, *lc)).reshape(n, math.prod(lhs_free), k)
    if rc and rf and min(rf) < max(rc):  # rhs keeps its own order of free and contracted dims: both forms are native
        rhs3 = jnp.transpose(rhs, (*rb, *rf, *rc)).reshape(n, math.prod(rhs_free), k)
        merged = (((2,), (2,)), ((0,), (0,)))
    else:
        rhs3 = jnp.transpose(rhs, (*rb, *rc, *rf)).reshape(n, k, math.prod(rhs_free))
        merged = (((2,), (1,)), ((0,), (0,)))
    out = jax.lax.dot_general(lhs3, rhs3, merged, preferred_element_type=jnp.float32)
    return out.reshape(*batch, *lhs_free, *rhs_free)


@functools.lru_cache(maxsize=None)
def subscripts(lhs_ndim: int, rhs_ndim: int, dims: DotDims) -> tuple[str, str, str]:
    """Einsum subscripts (lhs, rhs, out) of `dot_general(lhs, rhs, dims)`; out in dot_general's order."""
    (lhs_c, rhs_c), (lhs_b, rhs_b) = dims
    letters = iter(string.ascii_letters)
    lhs = [next(letters) for _ in range(lhs_ndim)]
    rhs = [""] * rhs_ndim
    for i, j in zip(lhs_c + lhs_b, rhs_c + rhs_b, strict=True):
        rhs[j] = lhs[i]
    rhs = [c or next(letters) for c in rhs]
    out = [lhs[i] for i in lhs_b]
    out += [c for i, c in enumerate(lhs) if i not in lhs_c and i not in lhs_b]
    out += [c for j, c in enumerate(rhs) if j not in rhs_c and j not in rhs_b]
    return "".join(lhs), "".join(rhs), "".join(out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def accumulating_dot_general(lhs: jax.Array, rhs: jax.Array, dims: DotDims) -> jax.Array:
    """`dot_general(lhs, rhs, dims)` of two 16-bit float operands, as float32 (round it once, after any add)."""
    return native_dot(lhs, rhs, dims)


def _fwd(lhs: jax.Array, rhs: jax.Array, dims: DotDims) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return accumulating_dot_general(lhs, rhs, dims), (lhs, rhs)


def _bwd(dims: DotDims, res: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Both gradients as 16-bit dots accumulating in float32: the cotangent is rounded to the operands' dtype first."""
    lhs, rhs = res
    ls, rs, os = subscripts(lhs.ndim, rhs.ndim, dims)
    g = g.astype(lhs.dtype)
    d_lhs = contract(os, rs, ls, g, rhs)
    d_rhs = contract(ls, os, rs, lhs, g)  # unused (and dropped by XLA) for a frozen weight
    return d_lhs.astype(lhs.dtype), d_rhs.astype(rhs.dtype)


accumulating_dot_general.defvjp(_fwd, _bwd)


def _canonical(dims: Any) -> DotDims:
    """Dimension numbers as nested tuples of ints (hashable: they are a static argument)."""
    (lc, rc), (lb, rb) = dims
    return ((tuple(map(int, lc)), tuple(map(int, rc))), (tuple(map(int, lb)), tuple(map(int, rb))))


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    out_sharding: Any = None,
) -> jax.Array:
    """Drop-in `jax.lax.dot_general`: 16-bit operands accumulate in float32.

    The result has the operands' dtype, or float32 when that is the `preferred_element_type`
    (unrounded, for a caller that adds to it first). Also `jnp.einsum`'s `_dot_general` hook
    (einsum passes its output dtype as `preferred_element_type`). Anything else (float32 or
    integer operands, another output dtype, an explicit precision or sharding) is passed to
    `jax.lax.dot_general` unchanged.
    """
    out = lhs.dtype if preferred_element_type is None else jnp.dtype(preferred_element_type)
    plain = precision is not None or out_sharding is not None or out not in (lhs.dtype, jnp.float32)
    if plain or not is_low_precision(lhs, rhs):
        return jax.lax.dot_general(
            lhs, rhs, dimension_numbers, precision=precision, preferred_element_type=preferred_element_type, out_sharding=out_sharding
        )
    dims = _canonical(dimension_numbers)
    product = accumulating_dot_general(lhs, rhs, dims).astype(out)
    (_, _), (lhs_batch, _) = dims
    if out == lhs.dtype and not lhs_batch:  # a rounded weight product: what `dots` keeps of a plain dot
        return checkpoint_name(product, PRODUCTS)
    return product
