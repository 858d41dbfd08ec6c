"""Per-token cross-entropy from the model's logits, with a hand-written backward.

Why this exists (docs/benchmarks.md, "Trainer: findings"): differentiated generically,
`logsumexp(float32(logits)) - float32(logits)[target]` materialises [tokens, vocab] float32
tensors five times over (the upcast, `exp(x - max)`, the softmax times the cotangent, a
zero-filled scatter for the target's gradient and its sum with the softmax's): on the benchmark
model about 0.7 GB of memory traffic per step, the largest non-matmul cost of the step.
`token_nll` computes the same values from the logits in their own dtype and keeps only them
and the per-token log-sum-exp: the forward reads the logits twice (max; sum of exponentials)
and writes nothing of their size, the backward is one elementwise pass that writes the
gradient in the logits' dtype, the target's one-hot being a comparison with an iota.

Values are computed in float32 exactly as the generic formula does; the gradient
`softmax - onehot` is the same function, rounded to the logits' dtype (where the generic
version rounds it too, before the LM head's backward product).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


@jax.custom_vjp
def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """`-log softmax(logits)[target]` in float32, [...], for logits [..., vocab] (any float dtype) and int targets [...].

    Targets must lie in [0, vocab): callers mask the positions they do not count (weight 0)
    rather than passing an out-of-range id.
    """
    return nll_and_lse(logits, targets)[0]


def nll_and_lse(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token nll and log-sum-exp (both float32) of `logits` [..., vocab]; the forward of `token_nll`."""
    peak = jnp.max(logits, axis=-1, keepdims=True).astype(jnp.float32)  # the max of the logits' own dtype: exact
    lse = (peak + jnp.log(jnp.sum(jnp.exp(logits.astype(jnp.float32) - peak), axis=-1, keepdims=True)))[..., 0]
    return lse - _target(logits, targets), lse


def _fwd(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    nll, lse = nll_and_lse(logits, targets)
    return nll, (logits, targets, lse)


def _bwd(res: tuple[jax.Array, jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array, None]:
    """d nll / d logits = softmax(logits) - onehot(target), times the cotangent; none for the int targets."""
    logits, targets, lse = res
    return logits_grad(logits, targets, lse, g), None


def logits_grad(logits: jax.Array, targets: jax.Array, lse: jax.Array, g: jax.Array | None = None) -> jax.Array:
    """`(softmax(logits) - onehot(target)) * g` in the logits' dtype (g: per-token cotangent; None: 1).

    One elementwise pass: the target's one-hot is a comparison with an iota, never a scatter.
    """
    x = _as_bits(logits, _bf16_bits_to_f32, lambda v: v.astype(jnp.float32))
    onehot = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1) == targets[..., None]
    grad = jnp.exp(x - lse[..., None]) - onehot
    return (grad if g is None else grad * g[..., None]).astype(logits.dtype)


token_nll.defvjp(_fwd, _bwd)


def _target(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """`logits[..., target]` as float32."""

    def take(v: jax.Array) -> jax.Array:
        return jnp.take_along_axis(v, targets[..., None], axis=-1)[..., 0]

    return _as_bits(logits, lambda bits: _bf16_bits_to_f32(take(bits)), lambda v: take(v).astype(jnp.float32))


def _as_bits(logits: Any, on_bits: Callable[[jax.Array], jax.Array], otherwise: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """`on_bits(raw 16-bit patterns of logits)` for bfloat16 logits, else `otherwise(logits)`.

    Why bit patterns: the sum of exponentials upcasts the logits inside its fused loop only as
    long as nothing else reads them as floats. A plain gather beside it, or the backward's own
    upcast (which XLA merges with the forward's), makes XLA:CPU write the float32 upcast of the
    whole logits once and read it back: 0.13 GB per step on the benchmark model
    (`tests/trainer/test_loss.py` checks the compiled function). Taken from the bits, the values
    are exactly the same.
    """
    if logits.dtype != jnp.bfloat16:
        return otherwise(logits)
    return on_bits(jax.lax.bitcast_convert_type(logits, jnp.uint16))


def _bf16_bits_to_f32(bits: jax.Array) -> jax.Array:
    """bfloat16 bit patterns as float32 values (exact: bfloat16 is float32's upper half)."""
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint32) << 16, jnp.float32)
