"""Causal grouped-query attention through the Pallas splash-attention kernel (TPU).

Why: the XLA path (`models.attention`) forms the [batch, heads, T, T] scores and probabilities
in HBM; at 2048 tokens that traffic, not the FLOPs, set the step time (on a v5e chip a
2048-token step cost 46% more per token than a 1024-token one although attention is ~7% of
the FLOPs). The splash kernel (JAX's `jax.experimental.pallas.ops.tpu.splash_attention`, the
kernel MaxText and Tunix use) keeps each block of scores in VMEM and skips the blocks the causal
mask removes; it takes grouped-query heads as they are (no repeat of k and v).

Packed examples and padding arrive as segment ids (`SegmentMask`), which the kernel applies
itself, so no [T, T] mask is ever built. Same function as the XLA path on every token that
counts: a token attends to the keys at or before it in its own segment. Rows of padding
(segment 0) attend to other padding here, where the XLA path spreads them uniformly; neither
reaches a real token or the loss.

Queries are scaled before the kernel (it has no scale argument), in their own dtype, as
MaxText does; the scores are float32 inside the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.interpreters import pxla

from lora_trainer.models.remat import RESIDUALS

#: The batch and head axes of the trainer's mesh (`distributed.make_mesh`): rows over data and fsdp, heads over tp.
_BATCH_AXES = ("data", "fsdp")
_HEAD_AXIS = "tp"


def _block(seq_len: int) -> int:
    """The largest block of 1024, 512, 256 or 128 that divides `seq_len` (`padded_length` makes it a multiple of 128).

    Larger blocks were faster on a v5e chip: 512 ran forward and backward 3x as fast as the XLA
    path at 2048 tokens, 256 1.5x, and 128 slower than XLA; 1024 with the fused backward kernel
    (below) took 6.50 ms a 1B layer against 8.75 ms at 512 unfused (docs/benchmarks.md, "TPU")."""
    return next(b for b in (1024, 512, 256, 128) if seq_len % b == 0)


@functools.lru_cache(maxsize=32)
def _kernel(heads: int, seq_len: int, window: int | None, interpret: bool) -> splash.SplashAttentionKernel:
    """The kernel for `heads` query heads over `seq_len` tokens (causal, or a causal window), built once per shape.

    The backward pass is one fused kernel for dq, dk and dv (`use_fused_bwd_kernel`): the
    separate dq kernel went over q, k, v and the output's gradient a second time. On the chip it
    took a 1B layer's attention from 8.75 to 6.82 ms at blocks of 512, and an 8B layer's from 4.46
    to 3.87 ms (`bench/tpu_throughput.py --splash-tilings`); keeping k and v sequence-minor, for
    64-wide heads, gained nothing."""
    shape = (seq_len, seq_len)
    one = splash.CausalMask(shape) if window is None else splash.LocalMask(shape, window_size=(window - 1, 0), offset=0)
    b = _block(seq_len)
    blocks = splash.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                               block_kv_dkv_compute=b, use_fused_bwd_kernel=True)
    with jax.ensure_compile_time_eval():  # the mask tables are constants, not values of the trace that first asks
        return splash.make_splash_mha(
            mask=splash.MultiHeadMask([one] * heads),
            block_sizes=blocks,
            head_shards=1,
            q_seq_shards=1,
            residual_checkpoint_name=RESIDUALS,
            interpret=interpret,
        )


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, window: int | None, interpret: bool) -> jax.Array:
    """The kernel over one device's rows and heads: q [b, n, t, d], k and v [b, kv, t, d], segment ids [b, t]."""
    kernel = _kernel(q.shape[1], q.shape[2], window, interpret)
    return jax.vmap(lambda q1, k1, v1, s1: kernel(q1, k1, v1, splash.SegmentIds(q=s1, kv=s1)))(q, k, v, segment_ids)


def causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, scale: float, *, window: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Attention output [b, t, n, d] for q [b, t, n, d], k and v [b, t, kv, d] and segment ids [b, t] (0: padding).

    `window`: each query sees only the `window` most recent keys (itself included), as
    Gemma's sliding layers. On a mesh of several devices the kernel runs per device
    (`shard_map`): rows split over the data and fsdp axes, heads over tp. `interpret` runs
    the kernel's Pallas program on the CPU (tests).
    """
    qh = jnp.swapaxes(q * jnp.asarray(scale, q.dtype), 1, 2)
    kh, vh = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    attend = functools.partial(_attend, window=window, interpret=interpret)
    mesh = pxla.thread_resources.env.physical_mesh
    if not mesh.empty and mesh.size > 1:
        rows = tuple(a for a in _BATCH_AXES if a in mesh.shape)
        heads = _HEAD_AXIS if _HEAD_AXIS in mesh.shape else None
        qkv = jax.sharding.PartitionSpec(rows, heads, None, None)
        attend = jax.shard_map(attend, mesh=mesh, in_specs=(qkv, qkv, qkv, jax.sharding.PartitionSpec(rows, None)),
                               out_specs=qkv, check_vma=False)
    return jnp.swapaxes(attend(qh, kh, vh, segment_ids), 1, 2)
