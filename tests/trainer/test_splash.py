"""The TPU attention path (the Pallas splash kernel, `models.splash`), run here by Pallas' interpreter
on the CPU: the same values and gradients as the XLA path on every token that counts, alone and
inside a whole LoRA training step of the families that use it (Gemma 3's sliding window included).

What the CPU cannot show, the kernel's speed and its bfloat16 results on the chip, is checked
on a TPU by `bench/tpu_throughput.py --check` (docs/benchmarks.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lora_trainer.config import LoraSpec, TrainingSpec
from lora_trainer.errors import UserError
from lora_trainer.lora import apply_lora, lora_state
from lora_trainer.models import load_model
from lora_trainer.models.attention import SegmentMask, causal_gqa_attention, choose_kernel, padded_length
from lora_trainer.tiny_models import make_tiny_hf_model
from lora_trainer.tunix_trainer import make_trainer

# (batch, length, query heads, kv heads, head_dim): grouped (GQA), multi-head, multi-query
SHAPES = [(2, 256, 4, 2, 16), (1, 128, 3, 3, 8), (2, 128, 4, 1, 16)]


def _segments(b: int, t: int) -> np.ndarray:
    """Row 0: two packed examples; other rows: one example, then padding (segment 0)."""
    seg = np.ones((b, t), np.int32)
    seg[0, t // 3 :] = 2
    seg[1:, 3 * t // 4 :] = 0
    return seg


def _dense(seg: jax.Array) -> jax.Array:
    """`loss.model_inputs`' dense mask for these segment ids."""
    t = seg.shape[1]
    return jnp.tril(jnp.ones((t, t), bool))[None] & (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("shape", SHAPES)
def test_splash_is_the_xla_attention_on_every_real_token(shape: tuple[int, ...], window: int | None) -> None:
    b, t, n, kv, d = shape
    keys = jax.random.split(jax.random.key(t + n), 4)
    q = jax.random.normal(keys[0], (b, t, n, d))
    k = jax.random.normal(keys[1], (b, t, kv, d))
    v = jax.random.normal(keys[2], (b, t, kv, d))
    seg = jnp.asarray(_segments(b, t))
    real = (seg > 0)[:, :, None, None]
    g = jax.random.normal(keys[3], q.shape) * real  # padding rows carry no loss, as in training

    def loss(q: jax.Array, k: jax.Array, v: jax.Array, mask: object) -> jax.Array:
        return jnp.sum(causal_gqa_attention(q, k, v, mask, 0.3, window=window) * g)

    grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    xla_loss, xla_grads = grads(q, k, v, _dense(seg))
    splash_loss, splash_grads = grads(q, k, v, SegmentMask(seg, interpret=True))
    np.testing.assert_allclose(splash_loss, xla_loss, rtol=1e-5)
    for got, want in zip(splash_grads, xla_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    out = jax.jit(lambda q, k, v, m: causal_gqa_attention(q, k, v, m, 0.3, window=window))
    np.testing.assert_allclose(out(q, k, v, SegmentMask(seg, interpret=True)) * real, out(q, k, v, _dense(seg)) * real,
                               rtol=1e-5, atol=1e-5)


def test_a_window_changes_the_result() -> None:
    """The window test above would pass if both paths ignored it: they do not."""
    b, t, n, kv, d = SHAPES[0]
    q, k, v = (jax.random.normal(jax.random.key(i), (b, t, h, d)) for i, h in ((0, n), (1, kv), (2, kv)))
    seg = jnp.ones((b, t), jnp.int32)
    for mask in (_dense(seg), SegmentMask(seg, interpret=True)):
        full, local = (causal_gqa_attention(q, k, v, mask, 0.3, window=w) for w in (None, 40))
        assert not np.allclose(full[:, 40:], local[:, 40:], atol=1e-3)
        np.testing.assert_allclose(full[:, :40], local[:, :40], rtol=1e-5, atol=1e-6)  # the first 40 see the same keys


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", "gemma3"])  # gemma3: sliding-window layers
def test_a_lora_training_step_with_splash_is_the_xla_step(family: str, tmp_path) -> None:  # noqa: ANN001
    overrides = {"num_hidden_layers": 2, "sliding_window": 48} if family == "gemma3" else {"num_hidden_layers": 2}
    source = make_tiny_hf_model(family, tmp_path / family, seed=0, **overrides)
    rng = np.random.default_rng(0)
    batch = {"input_tokens": rng.integers(3, 200, (2, 128)).astype(np.int32), "input_mask": np.ones((2, 128), np.int32)}
    seg = _segments(2, 128)
    batch["segment_ids"] = seg
    starts = np.maximum.accumulate(np.where(np.diff(seg, prepend=-1, axis=1) != 0, np.arange(128), 0), axis=1)
    batch["positions"] = (np.arange(128) - starts).astype(np.int32)  # counted from each example's first token
    runs = {}
    for splash in (False, True):
        loaded = load_model(str(source), dtype="float32")
        model = apply_lora(loaded.model, LoraSpec(rank=4, alpha=8.0), loaded.family, seed=0).model
        trainer = make_trainer(model, TrainingSpec(steps=3, learning_rate=0.01, schedule="constant"), splash=splash, interpret=True)
        for _ in range(3):
            trainer.train([dict(batch)])
        runs[splash] = ([float(a["loss"]) for a in trainer.train_aux], jax.tree.map(np.asarray, lora_state(trainer.model)))
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-5)
    assert runs[False][0][-1] < runs[False][0][0]  # the adapter trained: its updates are compared below
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5), runs[True][1], runs[False][1])


def test_kernel_choice_and_padding() -> None:
    assert choose_kernel("auto", "tpu") == "splash" and choose_kernel("auto", "cpu") == "xla"
    assert choose_kernel("xla", "tpu") == "xla" and choose_kernel("splash", "tpu") == "splash"
    with pytest.raises(UserError, match="training.attention is splash, which needs a TPU"):
        choose_kernel("splash", "cpu")
    assert padded_length(50, 1024, "xla") == 56 and padded_length(50, 1024, "splash") == 128
    assert padded_length(2000, 1000, "xla") == 1000 and padded_length(2000, 1000, "splash") == 1024
    assert padded_length(2048, 4096, "splash") == 2048
