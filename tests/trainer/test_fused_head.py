"""`fused_head`: the LM head and the loss computed chunk by chunk give the unfused values and
gradients, every family's head defers inside `deferred()` (and only there), and the point of it:
the whole logits are never kept."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from trainer_fixtures import loss_and_lora_grads, random_inputs

from lora_trainer import cross_entropy, fused_head
from lora_trainer.config import LoraSpec
from lora_trainer.fused_head import HeadInput
from lora_trainer.lora import apply_lora
from lora_trainer.loss import lm_loss
from lora_trainer.models import load_model
from lora_trainer.models.registry import FAMILIES
from lora_trainer.tiny_models import make_tiny_hf_model


def _head(dtype: jnp.dtype, vocab_major: bool, b: int = 2, t: int = 8, d: int = 16, v: int = 50) -> tuple[HeadInput, jax.Array, jax.Array]:
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((v, d) if vocab_major else (d, v)) * 0.3
    head = HeadInput(jnp.asarray(rng.standard_normal((b, t, d)), dtype), jnp.asarray(weight, dtype), vocab_major)
    return head, jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32), jnp.asarray(rng.random((b, t)), jnp.float32)


@pytest.mark.parametrize("vocab_major", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_the_chunked_loss_has_the_unfused_values_and_gradients(dtype: jnp.dtype, vocab_major: bool) -> None:
    head, targets, weight = _head(dtype, vocab_major)
    chunk_bytes = 2 * 2 * 50 * 4  # two positions of both rows: four chunks
    assert fused_head._chunk_count(2, 8, 50, chunk_bytes) == 4

    def unfused(h: jax.Array, w: jax.Array) -> jax.Array:
        return (cross_entropy.token_nll(HeadInput(h, w, vocab_major).logits(), targets) * weight).sum()

    def fused(h: jax.Array, w: jax.Array) -> jax.Array:
        return (fused_head.token_nll(HeadInput(h, w, vocab_major), targets, chunk_bytes=chunk_bytes) * weight).sum()

    want, (want_h, want_w) = jax.jit(jax.value_and_grad(unfused, (0, 1)))(head.hidden, head.weight)

    def close(got: jax.Array, want: jax.Array) -> None:
        """Equal, to one bfloat16 step at the largest value for a bfloat16 head: the unfused path rounds
        each token's logit gradient after scaling it by the token's weight, the fused one before."""
        want = np.asarray(want, np.float32)
        atol = 1e-6 if dtype == jnp.float32 else 2.0**-7 * np.abs(want).max()
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0, atol=atol)

    # a frozen weight (LoRA): the hidden gradient comes from the forward pass
    got, got_h = jax.jit(jax.value_and_grad(lambda h: fused(h, head.weight)))(head.hidden)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    assert got_h.dtype == dtype
    close(got_h, want_h)
    # a differentiated weight (a full fine-tune): both gradients, the logits recomputed
    got, (both_h, both_w) = jax.jit(jax.value_and_grad(fused, (0, 1)))(head.hidden, head.weight)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    assert both_w.dtype == dtype and both_w.shape == head.weight.shape
    close(both_h, want_h)
    close(both_w, want_w)
    # no gradient at all (eval)
    np.testing.assert_allclose(float(jax.jit(fused)(head.hidden, head.weight)), float(want), rtol=1e-6)


def test_the_chunks_divide_the_sequence_and_fit_the_budget() -> None:
    assert fused_head._chunk_count(4, 2048, 128256, fused_head.CHUNK_BYTES) == 8  # 4 x 256 tokens
    assert fused_head._chunk_count(1, 2048, 128256, fused_head.CHUNK_BYTES) == 2
    assert fused_head._chunk_count(2, 6, 10, 2 * 2 * 10 * 4) == 3
    assert fused_head._chunk_count(2, 7, 10, 2 * 2 * 10 * 4) == 7  # a prime length: one position at a time
    assert fused_head._chunk_count(2, 8, 10, 1) == 8


def test_the_whole_logits_are_never_kept() -> None:
    """The point of it: with a vocabulary-sized head (here 2 x 512 x 8000 logits, 16 MB in bfloat16)
    the unfused program's temporaries hold them three times over (logits, the gradient, a float32
    step between); the fused program's hold one chunk's (4 MiB of float32 logits)."""
    head, targets, _ = _head(jnp.bfloat16, True, b=2, t=512, d=32, v=8000)

    def temps(loss) -> int:  # noqa: ANN001
        return jax.jit(jax.grad(loss)).lower(head.hidden).compile().memory_analysis().temp_size_in_bytes

    unfused = temps(lambda h: cross_entropy.token_nll(HeadInput(h, head.weight, True).logits(), targets).sum())
    fused = temps(lambda h: fused_head.token_nll(HeadInput(h, head.weight, True), targets, chunk_bytes=4 * 2**20).sum())
    logits = 2 * 512 * 8000 * 2
    assert unfused >= 2 * logits, (unfused, fused)
    assert fused < logits / 2, (unfused, fused)


HEADS = [(f, tied) for f in FAMILIES for tied in (True, False) if not (f == "gemma3" and not tied)]  # Gemma 3 is always tied


def _ids(head: tuple[str, bool]) -> str:
    return f"{head[0]}-{'tied' if head[1] else 'untied'}"


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[tuple[str, bool]], nnx.Module]:
    """(family, tied) -> a one-layer float32 LoRA model, built once per module."""

    @functools.cache
    def build(head: tuple[str, bool]) -> nnx.Module:
        family, tied = head
        shape = {} if family == "gemma3" else {"tie_word_embeddings": tied, "num_hidden_layers": 1}  # Gemma 3: its tiny config as is
        source = make_tiny_hf_model(family, tmp_path_factory.mktemp("head") / family, seed=0, **shape)
        loaded = load_model(str(source), dtype="float32")
        return apply_lora(loaded.model, LoraSpec(rank=4, alpha=8.0), loaded.family, seed=0).model

    return build


@pytest.mark.parametrize("head", HEADS, ids=_ids)
def test_every_familys_head_defers_only_inside_the_block(lora_models: Callable[[tuple[str, bool]], nnx.Module], head: tuple[str, bool]) -> None:
    lora_model = lora_models(head)
    inputs = random_inputs()
    args = (inputs["input_tokens"], inputs["positions"], None, inputs["attention_mask"])
    logits, _ = lora_model(*args)
    with fused_head.deferred() as deferral:
        placeholder, _ = lora_model(*args)
    assert logits.shape == (2, 32, deferral.head.weight.size // deferral.head.hidden.shape[-1])
    assert placeholder.shape == (2, 32, 0)
    np.testing.assert_allclose(np.asarray(deferral.head.logits(), np.float32), np.asarray(logits), rtol=1e-5, atol=1e-5)


# a tied and an untied head, and qwen's float32 cast of the placeholder; the other families hand
# their heads over by the same seam (checked above)
@pytest.mark.parametrize("head", [("llama3", True), ("llama3", False), ("qwen3", True)], ids=_ids)
def test_the_lora_loss_and_gradients_are_the_unfused_ones(lora_models: Callable[[tuple[str, bool]], nnx.Module], head: tuple[str, bool]) -> None:
    lora_model = lora_models(head)
    inputs = random_inputs()
    loss, grads = loss_and_lora_grads(lora_model, inputs)
    unfused = nnx.value_and_grad(lambda m: lm_loss(lambda *a: _logits_of(m, *a), **inputs)[0], argnums=nnx.DiffState(0, nnx.LoRAParam))
    want, want_grads = nnx.jit(unfused)(lora_model)
    assert float(loss) == pytest.approx(float(want), rel=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7),
                 jax.tree.map(np.asarray, nnx.to_pure_dict(grads)), jax.tree.map(np.asarray, nnx.to_pure_dict(want_grads)))


def _logits_of(model: nnx.Module, *args: object) -> tuple[jax.Array, None]:
    """The model as a function returning whole logits (the unfused reference): its head's inputs
    are taken by a block of its own, so the loss's block sees logits."""
    with fused_head.deferred() as deferral:
        out, _ = model(*args)
    return out if deferral.head is None else deferral.head.logits(), None


def test_a_head_with_lora_parameters_or_a_quantized_weight_is_not_deferred() -> None:
    class Head(nnx.Module):
        def __init__(self, adapted: bool) -> None:
            self.w = nnx.Param(jnp.ones((8, 4)))
            if adapted:
                self.w_lora_a = nnx.LoRAParam(jnp.zeros((8, 2)))

    plain, adapted, hidden = Head(False), Head(True), jnp.ones((2, 3, 8))
    assert fused_head.defer(plain, hidden, plain.w.value, vocab_major=False) is None  # outside the block
    with fused_head.deferred() as deferral:
        assert fused_head.defer(adapted, hidden, adapted.w.value, vocab_major=False) is None
        assert fused_head.defer(plain, hidden, object(), vocab_major=False) is None  # Qwix's quantized weight is not an array
        assert deferral.head is None
        assert fused_head.defer(plain, hidden, plain.w.value, vocab_major=False).shape == (2, 3, 0)
    assert deferral.head.hidden is hidden and deferral.head.weight is plain.w.value
    with pytest.raises(RuntimeError, match="returned logits"):
        deferral.token_nll(jnp.zeros((2, 3, 4)), jnp.zeros((2, 3), jnp.int32))
