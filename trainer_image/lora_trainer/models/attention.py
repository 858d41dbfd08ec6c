"""Grouped-query softmax attention for the training forward pass, with a hand-written backward.

Why this exists (docs/benchmarks.md, "Trainer: findings"): Tunix's attention is written for
inference (`einsum`, `where`, `softmax`, `einsum`) and JAX differentiates it generically. On
the benchmark model its backward kept several float32 copies of the [batch, heads, T, S]
scores (the masked scores, the softmax, their cotangents, each in a transposed layout) and
reduced `p * dp` over them again: ~2/3 of the attention's time, about a quarter of the whole
LoRA step. `gqa_attention` computes the same function with the standard flash-attention
backward: it keeps only the probabilities (in the activations' dtype), and the softmax
gradient uses `rowsum(dO * O)` over [T, head_dim] instead of `rowsum(P * dP)` over [T, S].

Semantics are Tunix's: scores `q . k * scale` in float32, masked with the same large finite
negative number (a fully masked row attends uniformly, as in Tunix, and passes no gradient to
the masked scores), softmax in float32, probabilities rounded to the activations' dtype before
they meet `v`. 16-bit operands accumulate in float32 (`accumulating_dot.native_dot`).
The family modules call it from their attention's training path (no KV cache).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from lora_trainer import accumulating_dot

#: Tunix's mask value (every Tunix family defines the same constant).
K_MASK = -2.3819763e38

# Index letters: b batch, t query position, s key position, k kv head, g query head in its group, d head dim.
_BATCH = ((0, 2), (0, 2))  # b and k, in q5 [b,t,k,g,d] and k/v [b,s,k,d]


def _dot(lhs: jax.Array, rhs: jax.Array, dims: Any) -> jax.Array:
    """A float32 product: 16-bit operands accumulate in float32 in XLA:CPU's native form."""
    if accumulating_dot.is_low_precision(lhs, rhs):
        return accumulating_dot.native_dot(lhs, rhs, dims)
    return jax.lax.dot_general(lhs, rhs, dims, preferred_element_type=jnp.float32)


def _grouped(x: jax.Array, kv_heads: int) -> jax.Array:
    """[b, t, n, d] -> [b, t, k, g, d]: query heads split into their kv groups (GQA)."""
    b, t, n, d = x.shape
    return x.reshape(b, t, kv_heads, n // kv_heads, d)


def _probabilities(q5: jax.Array, k: jax.Array, mask: jax.Array | None, scale: float) -> jax.Array:
    """softmax(q . k * scale, masked) in float32, as [b, k, t, g, s]."""
    scores = _dot(q5, k, (((4,), (3,)), _BATCH)) * scale  # [b, k, t, g, s]
    if mask is not None:
        scores = jnp.where(mask[:, None, :, None, :], scores, K_MASK)
    return jax.nn.softmax(scores, axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def gqa_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, scale: float) -> jax.Array:
    """Attention output [b, t, n, d] for q [b, t, n, d], k and v [b, s, kv, d], mask [b, t, s] (True attends).

    n must be a multiple of kv (query heads grouped per kv head, as Tunix and HF order them).
    """
    return _forward(q, k, v, mask, scale)[0]


def _forward(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, scale: float) -> tuple[jax.Array, jax.Array]:
    q5 = _grouped(q, k.shape[2])
    p = _probabilities(q5, k, mask, scale).astype(q.dtype)
    out = _dot(p, v, (((4,), (1,)), ((0, 1), (0, 2))))  # [b, k, t, g, d]
    out = jnp.transpose(out, (0, 2, 1, 3, 4)).astype(q.dtype)  # [b, t, k, g, d]
    return out.reshape(q.shape), p


def _fwd(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, scale: float) -> tuple[jax.Array, tuple]:
    out, p = _forward(q, k, v, mask, scale)
    return out, (q, k, v, mask, p, out)


def _bwd(scale: float, res: tuple, g: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, None]:
    """dV = P^T dO; dS = P * (dO V^T - rowsum(dO * O)) * scale (zero where masked); dQ = dS K; dK = dS^T Q."""
    q, k, v, mask, p, out = res
    kv = k.shape[2]
    q5, g5 = _grouped(q, kv), _grouped(g.astype(q.dtype), kv)
    dv = _dot(p, g5, (((2, 3), (1, 3)), ((0, 1), (0, 2))))  # [b, k, s, d]
    dp = _dot(g5, v, (((4,), (3,)), _BATCH))  # [b, k, t, g, s]
    row = jnp.sum(g5.astype(jnp.float32) * _grouped(out, kv).astype(jnp.float32), axis=-1)  # [b, t, k, g]
    ds = p.astype(jnp.float32) * (dp - jnp.transpose(row, (0, 2, 1, 3))[..., None]) * scale
    if mask is not None:
        ds = jnp.where(mask[:, None, :, None, :], ds, 0.0)
    ds = ds.astype(q.dtype)
    dq = _dot(ds, k, (((4,), (1,)), ((0, 1), (0, 2))))  # [b, k, t, g, d]
    dk = _dot(ds, q5, (((2, 3), (1, 3)), ((0, 1), (0, 2))))  # [b, k, s, d]
    dq = jnp.transpose(dq, (0, 2, 1, 3, 4)).reshape(q.shape)
    return (
        dq.astype(q.dtype),
        jnp.transpose(dk, (0, 2, 1, 3)).astype(k.dtype),
        jnp.transpose(dv, (0, 2, 1, 3)).astype(v.dtype),
        None,
    )


gqa_attention.defvjp(_fwd, _bwd)
