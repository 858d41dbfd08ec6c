"""An adapted projection as one product: the frozen weight and its LoRA delta in one dot (TPU).

Why: XLA's TPU backend puts at most one product in a fusion. An adapted projection
`x @ W + (x @ A * s) @ B` was two: the frozen product was written to memory in float32, then read
again by a second fusion that formed the rank-16 product, added it and rounded to bfloat16. On a
v5e chip that second pass took 0.58 ms for each of a 1B layer's gate and up projections (the
product itself 1.46 ms). Here the rank-r intermediate is appended to the contraction instead,
`[x, x @ A * s] @ [W; B]`: one dot, accumulated in float32 and rounded once, the same sum as
before up to the order of its terms; the backward pass does the same for the input gradient,
`[g, g @ B^T * s] @ [W, A]^T`. XLA fuses both concatenations into the product's operands. The
price is one more 128-deep slice of the contraction (the rank padded to the matrix unit). On the
chip the 1B micro-batch (16 layers, 4 x 2048, `none`) went from 434.6 to 409.5 ms, 51.8% to
55.0% MFU (docs/benchmarks.md, "An adapted projection as one product").

Same math as `lora_provider.lora_delta` plus the frozen product, on operands in canonical form:
x [..., K] with the contracted dims flattened last, W [K, O], A [K, r], B [r, O]. Every product
accumulates in float32; A and B (float32 masters) are rounded to the activations' dtype where they
meet activation-sized operands, as `lora_delta` does; their gradients stay float32. The frozen
weight gets no gradient. `lora_provider.LoraProvider` uses it on TPU for unquantized 16-bit
projections without dropout whose einsum or dot_general is in that form after reshapes alone.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from lora_trainer.accumulating_dot import native_dot

def _dot(lhs: jax.Array, rhs: jax.Array, lhs_axis: int, rhs_axis: int) -> jax.Array:
    """lhs . rhs over one axis each, accumulated in float32 (`accumulating_dot.native_dot`)."""
    return native_dot(lhs, rhs, (((lhs_axis % lhs.ndim,), (rhs_axis % rhs.ndim,)), ((), ())))


def _low_rank(x: jax.Array, a: jax.Array, scale: float) -> jax.Array:
    """h = x @ A * s [..., r] in x's dtype: the rank-r intermediate, as `lora_delta` rounds it."""
    return (_dot(x, a.astype(x.dtype), -1, 0) * scale).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def adapted_product(x: jax.Array, w: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """`x @ w + (x @ a * scale) @ b` in x's dtype: x [..., K], w [K, O], a [K, r], b [r, O]."""
    return _forward(x, w, a, b, scale)[0]


def _joined(lhs: jax.Array, low: jax.Array, w: jax.Array, factor: jax.Array, w_axis: int) -> jax.Array:
    """lhs . w + low . factor over lhs's last axis and `w_axis` of w, rounded to lhs's dtype once.

    One product (the rank-r operands appended to the contraction) where the contraction is no
    deeper than the result is wide, else two summed in float32. Measured on a v5e chip (1B
    widths, micro-batch 4 x 2048; docs/benchmarks.md): appending 16 to a 2048-deep contraction
    beat the second pass (gate and up forward, q and o both ways, down backward); appending it to
    an 8192-deep one lost (gate and up backward 7% slower, down forward even). Keeping q, k and v
    as two products (their outputs are heads of 64) lost 7 ms a micro-batch."""
    depth, width = w.shape[w_axis], w.shape[1 - w_axis]
    w, factor = w.astype(lhs.dtype), factor.astype(lhs.dtype)
    if depth <= width:
        stacked = jnp.concatenate([w, factor], axis=w_axis)
        return _dot(jnp.concatenate([lhs, low], axis=-1), stacked, -1, w_axis).astype(lhs.dtype)
    return (_dot(lhs, w, -1, w_axis) + _dot(low, factor, -1, w_axis)).astype(lhs.dtype)


def _forward(x: jax.Array, w: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> tuple[jax.Array, jax.Array]:
    h = _low_rank(x, a, scale)
    return _joined(x, h, w, b, 0), h


def _adapted_fwd(x: jax.Array, w: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> tuple[jax.Array, tuple]:
    out, h = _forward(x, w, a, b, scale)
    return out, (x, w, a, b, h)


def _adapted_bwd(scale: float, res: tuple, g: jax.Array) -> tuple[jax.Array, None, jax.Array, jax.Array]:
    """dx = g W^T + (g B^T s) A^T (`_joined`); dA = x^T (g B^T s); dB = h^T g (float32). No gradient for W."""
    x, w, a, b, h = res
    g = g.astype(x.dtype)
    gh = (_dot(g, b.astype(x.dtype), -1, 1) * scale).astype(x.dtype)  # [..., r]
    dx = _joined(g, gh, w, a, 1)
    tokens = tuple(range(x.ndim - 1))
    da = native_dot(x, gh, ((tokens, tokens), ((), ())))
    db = native_dot(h, g, ((tokens, tokens), ((), ())))
    return dx, None, da.astype(a.dtype), db.astype(b.dtype)


adapted_product.defvjp(_adapted_fwd, _adapted_bwd)


def allowed_on(mesh_shape: Mapping[str, int]) -> bool:
    """Whether the run's mesh (axis name -> size) allows one product: not with tensor parallelism.

    Why: over `tp` the heads and the MLP's hidden units are split, and the rank-r operands are whole;
    appending them to a split axis (q's output gradient, o's input) would make XLA gather the split
    activations on every chip. Measured on one chip only, so the form stays where it was measured."""
    return mesh_shape.get("tp", 1) <= 1


def canonical_einsum(spec: str, lora_spec: str) -> int | None:
    """For a frozen einsum `spec` ("x,w->out") and its LoRA spec ("x,a,b->out"): the number of
    contracted dims when both are in the form `adapted_product` takes after reshapes alone; else None.

    That form: no batch letters, x's contracted letters last and w's first in the same order, the
    output x's free letters then w's remaining ones, A = contracted + rank and B = rank + remaining.
    """
    inputs, out = spec.replace(" ", "").split("->")
    parts = inputs.split(",")
    lora_inputs, lora_out = lora_spec.replace(" ", "").split("->")
    lora_parts = lora_inputs.split(",")
    if len(parts) != 2 or len(lora_parts) != 3 or lora_out != out or lora_parts[0] != parts[0]:
        return None
    xs, ws = parts
    contracted = "".join(c for c in xs if c in ws and c not in out)
    remain = ws[len(contracted):]
    free = xs[: len(xs) - len(contracted)]
    _, a_sub, b_sub = lora_parts
    rank = a_sub[-1:]
    ok = (
        bool(contracted)
        and xs.endswith(contracted)
        and ws.startswith(contracted)
        and not any(c in free for c in ws)
        and out == free + remain
        and a_sub == contracted + rank
        and b_sub == rank + remain
        and rank not in xs + ws
    )
    return len(contracted) if ok else None


def canonical_dot_general(lhs_ndim: int, rhs_ndim: int, dimension_numbers: jax.lax.DotDimensionNumbers) -> int | None:
    """The number of contracted dims when a frozen dot_general is in `adapted_product`'s form after
    reshapes alone (no batch dims, lhs's contracted dims last and rhs's first, in order); else None."""
    (lhs_ca, rhs_ca), (lhs_ba, rhs_ba) = dimension_numbers
    n = len(lhs_ca)
    ok = (
        not lhs_ba
        and not rhs_ba
        and n > 0
        and tuple(lhs_ca) == tuple(range(lhs_ndim - n, lhs_ndim))
        and tuple(rhs_ca) == tuple(range(n))
        and rhs_ndim > n
    )
    return n if ok else None


def product(x: jax.Array, w: jax.Array, a: jax.Array, b: jax.Array, scale: float, contracted: int) -> jax.Array:
    """`adapted_product` for x [*free, *C] and w [*C, *R] (`contracted` = len(C); A and B shaped as
    Qwix gives them): flattened to [..., K] and [K, O], and the result [*free, *R]."""
    free, remain = x.shape[: x.ndim - contracted], w.shape[contracted:]
    k, o = math.prod(w.shape[:contracted]), math.prod(remain)
    rank = a.size // k
    out = adapted_product(x.reshape(*free, k), w.reshape(k, o), a.reshape(k, rank), b.reshape(rank, o), scale)
    return out.reshape(*free, *remain)
