"""QLoRA's frozen product `x @ dequantize(W_q)`, whose backward pass dequantizes `W_q` again.

Why: a QLoRA step computes each dequantized weight twice, in the forward pass and again for
the activation gradient `g @ W^T` in the backward pass. The two computations are identical (same
quantized weight, same operations), so XLA's common-subexpression elimination merges them and
keeps the forward's dequantized weights alive until the backward pass: every layer's at once,
whatever `training.remat` says (at the JAX level they are not residuals: they only depend on the
frozen, undifferentiated weights). On the chip, 1B QLoRA's step then needed 12.70 GiB of
temporaries against LoRA's 5.73 (docs/benchmarks.md, "TPU"); on CPU at Llama-3.2-1B widths each
layer added 322 MB of temporaries against LoRA's 113 MB.

Here the backward pass takes the quantized weight through an optimization barrier together with
the cotangent `g`: its dequantization is a different computation, which XLA can neither merge
with the forward's nor run before `g` exists; the forward's passes a barrier with its input `x` in
the same way, so it is not computed ahead of its layer either. Measured on the chip with the MLP's
products going through here: 4 layers' temporaries fell from 6.81 to 5.00 GiB (LoRA: 4.40). XLA:CPU
drops optimization barriers before merging, so CPU memory does not show the difference; the tests
check the program JAX lowers. Forward values are Qwix's exactly (Qwix's function runs), and so is the activation
gradient (the transpose of that same function). The base is frozen in QLoRA: the quantized
weight's cotangent is zero.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from qwix._src.core import dot_general as qwix_dot_general
from qwix._src.core import einsum as qwix_einsum
from qwix._src.core import numerics, qarray

#: Qwix's own nf4 decoding (a gather from its 16-value table), kept for comparison (bench/).
QWIX_NF4_TO_FP = numerics.nf4_to_fp


def dot_general(lhs: Any, rhs: Any, dimension_numbers: jax.lax.DotDimensionNumbers, **kwargs: Any) -> jax.Array:
    """Qwix's `dot_general`; where one operand is quantized (a frozen QLoRA weight: on either side, as
    an einsum's contraction order puts it), with the backward above."""
    quantized = [isinstance(operand, qarray.QArray) for operand in (lhs, rhs)]
    if quantized == [False, True]:
        return _frozen(lambda x, w: qwix_dot_general.dot_general(x, w, dimension_numbers, **kwargs), lhs)(lhs, rhs)
    if quantized == [True, False]:
        return _frozen(lambda x, w: qwix_dot_general.dot_general(w, x, dimension_numbers, **kwargs), rhs)(rhs, lhs)
    return qwix_dot_general.dot_general(lhs, rhs, dimension_numbers, **kwargs)


#: Qwix's einsum, whose binary contractions go through `dot_general` above.
einsum = functools.partial(qwix_einsum.einsum, _qwix_dot_general=dot_general)


def _frozen(product: Any, like: jax.Array) -> Any:
    """`product(x, w)` differentiable in `x` (shaped as `like`) only, its backward dequantizing `w` once `g` exists."""
    shape, dtype = like.shape, like.dtype

    @jax.custom_vjp
    def frozen(x: jax.Array, w: qarray.QArray) -> jax.Array:
        w, x = jax.lax.optimization_barrier((w, x))
        return product(x, w)

    def forward(x: jax.Array, w: qarray.QArray) -> tuple[jax.Array, qarray.QArray]:
        return frozen(x, w), w  # the residual is the quantized weight itself: no new memory

    def backward(w: qarray.QArray, g: jax.Array) -> tuple[jax.Array, Any]:
        w, g = jax.lax.optimization_barrier((w, g))
        _, transpose = jax.vjp(lambda x: product(x, w), jnp.zeros(shape, dtype))
        return transpose(g)[0], jax.tree.map(_zero_cotangent, w)

    frozen.defvjp(forward, backward)
    return frozen


def _zero_cotangent(leaf: jax.Array) -> Any:
    """A frozen leaf's cotangent: zeros, or float0 for the integer quantized values."""
    if jnp.issubdtype(leaf.dtype, jnp.inexact):
        return jnp.zeros(leaf.shape, leaf.dtype)
    return np.zeros(leaf.shape, jax.dtypes.float0)


@functools.cache
def _nf4_table() -> tuple[float, ...]:
    """Qwix's nf4 table as Python floats (its float32 values): read once, at the first decoding, not at import."""
    with jax.ensure_compile_time_eval():
        return tuple(float(v) for v in np.asarray(numerics.get_nf4_buckets(), np.float32))


@jax.jit
def nf4_to_fp(codes: jax.Array) -> jax.Array:
    """NF4 codes (uint4) -> their float32 values from Qwix's table, by a tree of 15 selects on the code's bits.

    Why: Qwix decodes with a gather from the 16-value table, one element at a time (`vmap` of an
    index). A QLoRA step decodes every frozen weight in each micro-batch's forward pass, again in
    its backward pass, and once more where `training.remat` recomputes the forward: for an 8B model,
    tens of billions of table lookups a step. Selects are elementwise, so XLA fuses them into the
    product's operand like the scale multiply that follows, where a TPU gather runs as an op of its
    own. The values are the table's float32 entries, bit for bit (tested), so the product is Qwix's.

    Jitted: called eagerly (QLoRA's quantization and Qwix's op-by-op dummy forward on the host),
    the 30-odd ops would each run over the whole weight: 8B's LoRA and quantization took 349 s on
    the chip's host against 140 s with the gather. Inside the train step the call is inlined.
    """
    bits = codes.astype(jnp.uint8)
    level = [jnp.float32(v) for v in _nf4_table()]
    for bit in range(4):  # pair entries 2k and 2k+1 by bit 0, then by bit 1, ...: 8 + 4 + 2 + 1 selects
        on = ((bits >> bit) & 1).astype(bool)
        level = [jnp.where(on, level[2 * k + 1], level[2 * k]) for k in range(len(level) // 2)]
    return level[0]  # float32, shaped as `codes`: the first selects broadcast the scalars


# Qwix looks the decoder up in its module at each call (`numerics.convert_from`): every QLoRA
# product, Qwix's own included, decodes through the selects above once this module is imported.
numerics.nf4_to_fp = nf4_to_fp
