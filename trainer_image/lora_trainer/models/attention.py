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
they meet `v`. 16-bit operands accumulate in float32 (`accumulating_dot.contract`).
The family modules call its causal form, `causal_gqa_attention`, from their attention's
training path (no KV cache).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from lora_trainer.accumulating_dot import contract
from lora_trainer.errors import UserError

#: Tunix's mask value (every Tunix family defines the same constant).
K_MASK = -2.3819763e38

# Subscripts: b batch, t query position, s key position, k kv head, g query head in its group,
# d head dim. Queries, outputs and their gradients are [b, t, k, g, d]; keys and values
# [b, s, k, d]; scores and probabilities [b, k, t, g, s]. `contract` runs each product as one
# dot_general, 16-bit operands accumulating in float32 in XLA:CPU's native form.
Q, KV, P = "btkgd", "bskd", "bktgs"


def _grouped(x: jax.Array, kv_heads: int) -> jax.Array:
    """[b, t, n, d] -> [b, t, k, g, d]: query heads split into their kv groups (GQA)."""
    b, t, n, d = x.shape
    return x.reshape(b, t, kv_heads, n // kv_heads, d)


def _probabilities(q5: jax.Array, k: jax.Array, mask: jax.Array | None, scale: float) -> jax.Array:
    """softmax(q . k * scale, masked) in float32, as [b, k, t, g, s]."""
    scores = contract(Q, KV, P, q5, k) * scale
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
    p = _probabilities(_grouped(q, k.shape[2]), k, mask, scale).astype(q.dtype)
    return contract(P, KV, Q, p, v).astype(q.dtype).reshape(q.shape), p


def _fwd(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, scale: float) -> tuple[jax.Array, tuple]:
    out, p = _forward(q, k, v, mask, scale)
    return out, (q, k, v, mask, p, out)


def _bwd(scale: float, res: tuple, g: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, None]:
    """dV = P^T dO; dS = P * (dO V^T - rowsum(dO * O)) * scale (zero where masked); dQ = dS K; dK = dS^T Q."""
    q, k, v, mask, p, out = res
    kv = k.shape[2]
    q5, g5 = _grouped(q, kv), _grouped(g.astype(q.dtype), kv)
    dv = contract(P, Q, KV, p, g5)
    dp = contract(Q, KV, P, g5, v)
    row = jnp.sum(g5.astype(jnp.float32) * _grouped(out, kv).astype(jnp.float32), axis=-1)  # [b, t, k, g]
    ds = p.astype(jnp.float32) * (dp - jnp.transpose(row, (0, 2, 1, 3))[..., None]) * scale
    if mask is not None:
        ds = jnp.where(mask[:, None, :, None, :], ds, 0.0)
    ds = ds.astype(q.dtype)
    dq = contract(P, KV, Q, ds, k).reshape(q.shape)
    dk = contract(P, Q, KV, ds, q5)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


gqa_attention.defvjp(_fwd, _bwd)


#: The splash kernel takes sequences of a multiple of this many tokens (its smallest block).
SPLASH_SEQ_MULTIPLE = 128


def choose_kernel(setting: str, backend: str) -> str:
    """`training.attention` resolved for a run on `backend`: `splash` or `xla`.

    `auto` is splash on TPU, xla elsewhere; asking for splash off a TPU is a UserError (its
    Pallas program runs only there, or interpreted, far too slowly to train).
    """
    if setting == "splash" and backend != "tpu":
        raise UserError(f"training.attention is splash, which needs a TPU, but this run is on {backend}; use auto or xla")
    if setting == "auto":
        return "splash" if backend == "tpu" else "xla"
    return setting


def padded_length(longest: int, max_seq_len: int, kernel: str) -> int:
    """The length every batch is padded to (one compilation): the longest sequence rounded up to 8,
    capped at `max_seq_len`; for the splash kernel then rounded up to its multiple of 128."""
    length = min(max_seq_len, -(-longest // 8) * 8)
    return -(-length // SPLASH_SEQ_MULTIPLE) * SPLASH_SEQ_MULTIPLE if kernel == "splash" else length


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SegmentMask:
    """A causal mask within packed segments, given as the segment ids [B, T] (0: padding) rather
    than as a [B, T, T] array: the form the splash kernel takes (`models.splash`), chosen by the
    model inputs (`loss.model_inputs`) when the run attends with it.

    The mask it stands for is `loss.model_inputs`' dense one: query i attends key j when j <= i,
    both lie in the same segment, and that segment is not padding. `interpret` runs the kernel's
    Pallas program on the CPU (tests of the TPU path).
    """

    segment_ids: jax.Array
    interpret: bool = dataclasses.field(default=False, metadata={"static": True})


def causal_gqa_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | SegmentMask | None, scale: float, *, window: int | None = None
) -> jax.Array:
    """`gqa_attention(q, k, v, mask & causal, scale)` for a decoder: query i attends keys j <= i (where `mask` allows).

    `window` limits each query to the `window` most recent keys (itself included): Gemma's
    sliding layers. A `SegmentMask` runs the splash kernel instead (`models.splash`): the same
    function on every token that is not padding.

    Why: causality masks the upper-right quarter of the [T, T] scores, which `gqa_attention`
    still forms, exponentiates and differentiates. With queries and keys of one length the
    queries are split in two halves: the first attends only the first half of the keys, the
    second all of them, so that quarter is never formed (on the benchmark shapes a layer's
    attention forward and backward take 23 instead of 39 ms; docs/benchmarks.md, "Trainer: findings").

    Every decoder family's mask is causal already (Tunix's and ours), so `mask & causal` is
    their mask. The values are exactly those of one `gqa_attention` call, including a fully
    masked row (padding), which attends uniformly to every key as in Tunix: such a row of the
    first half gets the mean of all values rather than of the first half's.
    """
    if isinstance(mask, SegmentMask):
        from lora_trainer.models import splash  # Pallas' TPU kernels: imported only by runs that use them

        return splash.causal_attention(q, k, v, mask.segment_ids, scale, window=window, interpret=mask.interpret)
    t, s = q.shape[1], k.shape[1]
    causal = jnp.tril(jnp.ones((t, s), jnp.bool_))[None]
    if window is not None:
        causal = causal & jnp.triu(jnp.ones((t, s), jnp.bool_), 1 - window)[None]
    mask = causal if mask is None else mask & causal
    if t != s or t < 2:
        return gqa_attention(q, k, v, mask, scale)
    h = t // 2
    top = gqa_attention(q[:, :h], k[:, :h], v[:, :h], mask[:, :h, :h], scale)
    bottom = gqa_attention(q[:, h:], k, v, mask[:, h:], scale)
    return jnp.concatenate([_attend_all_if_empty(top, v, mask[:, :h, :h]), bottom], axis=1)


def _attend_all_if_empty(out: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """`out` [b, t, n, d] with each row whose `mask` [b, t, s'] is all False replaced by the mean of all of `v`.

    The mean goes to those rows as a batched outer product (a dot), so its gradient, the sum of
    their output gradients, is a dot too (as a sum XLA:CPU splits it into slow windowed reductions).
    """
    b, t, n, d = out.shape
    empty = jnp.broadcast_to(~jnp.any(mask, axis=-1), (b, t)).astype(jnp.float32)
    groups = n // v.shape[2]
    mean_v = jnp.repeat(jnp.mean(v.astype(jnp.float32), axis=1), groups, axis=1).reshape(b, 1, n * d)  # [b, 1, n*d]
    spread = jax.lax.dot_general(empty[:, :, None], mean_v, (((2,), (1,)), ((0,), (0,))))  # [b, t, n*d]
    kept = out.astype(jnp.float32) * (1.0 - empty)[:, :, None, None]
    return (kept + spread.reshape(b, t, n, d)).astype(out.dtype)
