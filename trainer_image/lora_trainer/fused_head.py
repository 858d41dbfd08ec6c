"""The LM head's product and the next-token loss as one computation over chunks of the sequence.

Why this exists (docs/benchmarks.md, "TPU"): a Llama 3 vocabulary has 128,256 entries, so the
logits of one micro-batch of 4 x 2048 tokens are 2.1 GB in bfloat16; the loss kept them for the
backward pass and wrote their gradient, another 2.1 GB, at the peak of the step. On a v5e chip
that is what kept a 1B micro-batch of 4 from fitting. Here the logits exist one chunk of the
sequence at a time (`CHUNK_BYTES` of float32 at most): each chunk's log-sum-exp, nll and the
hidden states' gradient are computed together, and only the [batch, seq, hidden] gradient is
kept. The FLOPs are the unfused ones (the head's product forward, the hidden gradient's
product backward); nothing is recomputed while the head's weight is frozen, as it is for LoRA.

A weight that is differentiated (a full fine-tune) gets its true gradient: the backward pass then
recomputes each chunk's logits, since the weight's gradient needs the cotangent of every token
before it can be summed.

How the model hands its head over: inside `deferred()`, a family's embedder (tied head) or
head einsum (untied) hands its operands (the final hidden states and the head's weight) to the
block's `Deferral` and returns empty logits (`models.families.common.use_deferred_head`); the
loss asks the `Deferral` for the nll. A head with LoRA parameters or a quantized weight is never
deferred: its product is Qwix's.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from lora_trainer import cross_entropy
from lora_trainer.accumulating_dot import contract

#: The most float32 logits one chunk may hold (bytes). A chunk is a [batch, seq / n, vocab] slice;
#: 512 MiB is 4 x 256 tokens of Llama 3's vocabulary: products still wide enough for the matrix unit.
CHUNK_BYTES = 512 * 2**20

_DEFERRED: contextvars.ContextVar[Deferral | None] = contextvars.ContextVar("lora_trainer_deferred_head", default=None)


@dataclasses.dataclass(frozen=True)
class HeadInput:
    """What the model's head would multiply: the final hidden states [batch, seq, hidden] and its
    weight, [vocab, hidden] when `vocab_major` (a tied embedding) else [hidden, vocab]."""

    hidden: jax.Array
    weight: jax.Array
    vocab_major: bool

    def logits(self) -> jax.Array:
        """The logits the model would have returned (tests; the loss never forms them whole)."""
        return _product(self.hidden, self.weight, self.vocab_major)


class Deferral:
    """What one forward pass inside `deferred()` handed over: the head's inputs, or None (a model whose
    head computed its logits: a head with LoRA parameters or a quantized weight, or no deferring seam)."""

    def __init__(self) -> None:
        self.head: HeadInput | None = None

    def token_nll(self, out: jax.Array, targets: jax.Array, *, chunk_bytes: int = CHUNK_BYTES) -> jax.Array:
        """Per-token next-token nll (float32, [batch, seq]) for the model's output `out`: its logits, or
        (when the head deferred) the empty placeholder it returned instead."""
        if self.head is None:
            return cross_entropy.token_nll(out, targets)
        if out.shape[-1] != 0:
            raise RuntimeError(f"the model's head deferred, but the model returned logits of shape {out.shape}")
        return token_nll(self.head, targets, chunk_bytes=chunk_bytes)


@contextlib.contextmanager
def deferred() -> Iterator[Deferral]:
    """While tracing a forward pass inside this block, a deferring head hands its inputs to the
    `Deferral` this yields and returns an empty [batch, seq, 0] placeholder for the logits (which
    Tunix's models may still cast, as qwen's cast theirs to float32)."""
    deferral = Deferral()
    token = _DEFERRED.set(deferral)
    try:
        yield deferral
    finally:
        _DEFERRED.reset(token)


def defer(module: nnx.Module, hidden: jax.Array, weight: Any, *, vocab_major: bool) -> jax.Array | None:
    """Called by a head module with its operands: inside `deferred()`, with a plain array weight
    (not Qwix's quantized value) and no LoRA parameters on the module, record them (in the
    module's compute `dtype` where it has one, as Tunix's qwen heads cast them) and return the
    placeholder logits; otherwise None (the module computes its logits)."""
    deferral = _DEFERRED.get()
    if deferral is None or not isinstance(weight, jax.Array) or nnx.state(module, nnx.LoRAParam):
        return None
    dtype = getattr(module, "dtype", None)
    if dtype is not None:
        hidden, weight = jnp.astype(hidden, dtype), jnp.astype(weight, dtype)
    deferral.head = HeadInput(hidden, weight, vocab_major)
    return jnp.zeros((*hidden.shape[:-1], 0), hidden.dtype)


def token_nll(head: HeadInput, targets: jax.Array, *, chunk_bytes: int = CHUNK_BYTES) -> jax.Array:
    """Per-token next-token nll (float32, [batch, seq]) of the logits `head` would produce, chunk by chunk."""
    b, t, _ = head.hidden.shape
    vocab = head.weight.shape[0 if head.vocab_major else 1]
    return _head_nll(head.vocab_major, _chunk_count(b, t, vocab, chunk_bytes), head.hidden, head.weight, targets)


def _chunk_count(batch: int, length: int, vocab: int, chunk_bytes: int) -> int:
    """The fewest chunks, dividing `length`, whose float32 logits fit in `chunk_bytes` (all of it: length)."""
    for n in range(1, length + 1):
        if length % n == 0 and batch * (length // n) * vocab * 4 <= chunk_bytes:
            return n
    return length


def _weight_subscripts(vocab_major: bool) -> str:
    return "vd" if vocab_major else "dv"


def _product(hidden: jax.Array, weight: jax.Array, vocab_major: bool) -> jax.Array:
    """hidden [B, T, D] times the head weight: logits [B, T, V], summed in float32 and rounded once."""
    return contract("btd", _weight_subscripts(vocab_major), "btv", hidden, weight).astype(hidden.dtype)


def _hidden_grad(dlogits: jax.Array, weight: jax.Array, vocab_major: bool) -> jax.Array:
    """dlogits [B, T, V] back through the head: [B, T, D] in float32."""
    return contract("btv", _weight_subscripts(vocab_major), "btd", dlogits, weight)


def _weight_grad(hidden: jax.Array, dlogits: jax.Array, vocab_major: bool) -> jax.Array:
    """The head weight's gradient from one chunk, in float32, in the weight's layout. The chunk's tokens
    are made one axis first: contracting batch and sequence apart, XLA:CPU refused the bfloat16 dot
    ("Unsupported element type for DotThunk: BF16 x BF16 = F32")."""
    h, g = hidden.reshape(-1, hidden.shape[-1]), dlogits.reshape(-1, dlogits.shape[-1])
    return contract("nd", "nv", _weight_subscripts(vocab_major), h, g)


def _split(x: jax.Array, n: int) -> jax.Array:
    """[batch, seq, ...] -> [n, batch, seq / n, ...]: chunks along the sequence, the batch axis
    (the one a data-parallel mesh splits) left whole in each."""
    b, t = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, n, t // n, *x.shape[2:]), 1, 0)


def _join(x: jax.Array) -> jax.Array:
    """The inverse of `_split`."""
    n, b, c = x.shape[:3]
    return jnp.moveaxis(x, 0, 1).reshape(b, n * c, *x.shape[3:])


def _scan(vocab_major: bool, n: int, hidden: jax.Array, weight: jax.Array, targets: jax.Array, with_grad: bool) -> tuple[jax.Array, jax.Array | None]:
    """nll [batch, seq] and, `with_grad`, d(sum nll)/d hidden [batch, seq, hidden] in float32."""

    def chunk(_: None, xs: tuple[jax.Array, jax.Array]) -> tuple[None, tuple[jax.Array, jax.Array | None]]:
        h, tgt = xs
        logits = _product(h, weight, vocab_major)
        nll, lse = cross_entropy.nll_and_lse(logits, tgt)
        dh = _hidden_grad(cross_entropy.logits_grad(logits, tgt, lse), weight, vocab_major) if with_grad else None
        return None, (nll, dh)

    _, (nll, dh) = jax.lax.scan(chunk, None, (_split(hidden, n), _split(targets, n)))
    return _join(nll), None if dh is None else _join(dh)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _head_nll(vocab_major: bool, n: int, hidden: jax.Array, weight: jax.Array, targets: jax.Array) -> jax.Array:
    return _scan(vocab_major, n, hidden, weight, targets, with_grad=False)[0]


def _fwd(vocab_major: bool, n: int, hidden: Any, weight: Any, targets: Any) -> tuple[jax.Array, tuple[Any, ...]]:
    """A frozen weight: the hidden gradient per unit cotangent, computed with the logits. A
    differentiated one: only what the backward needs to recompute them (see the module's doc)."""
    h, w, tgt = hidden.value, weight.value, targets.value
    if weight.perturbed:
        nll, _ = _scan(vocab_major, n, h, w, tgt, with_grad=False)
        return nll, (h, w, tgt, None)
    nll, dh = _scan(vocab_major, n, h, w, tgt, with_grad=True)
    return nll, (h, None, None, dh)


def _bwd(vocab_major: bool, n: int, res: tuple[Any, ...], g: Any) -> tuple[Any, Any, None]:
    h, w, tgt, dh = res
    if isinstance(g, jax.custom_derivatives.SymbolicZero):
        return None, None, None
    if dh is not None:
        return (dh * g[..., None]).astype(h.dtype), None, None

    def chunk(dw: jax.Array, xs: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        hc, tc, gc = xs
        logits = _product(hc, w, vocab_major)
        _, lse = cross_entropy.nll_and_lse(logits, tc)
        dlogits = cross_entropy.logits_grad(logits, tc, lse, gc)
        return dw + _weight_grad(hc, dlogits, vocab_major), _hidden_grad(dlogits, w, vocab_major).astype(h.dtype)

    dw, dhs = jax.lax.scan(chunk, jnp.zeros(w.shape, jnp.float32), (_split(h, n), _split(tgt, n), _split(g, n)))
    return _join(dhs), dw.astype(w.dtype), None


_head_nll.defvjp(_fwd, _bwd, symbolic_zeros=True)
