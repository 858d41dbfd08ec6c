"""`gqa_attention` is Tunix's attention core with a hand-written backward: same values, same gradients.
`causal_gqa_attention` (what the decoder families call) is it under a causal mask, in two query blocks.

The reference below is Tunix's own formula (llama3/qwen2/qwen3 `Attention.block` without a
cache) differentiated by JAX. The family models' logits against `transformers` (Gemma 3's
sliding-window layers included) are checked in test_models.py, whose models run their
attention through `gqa_attention`, as the last test here pins.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from trainer_fixtures import dot_operand_types, hlo_dots

from lora_trainer.models.attention import K_MASK, causal_gqa_attention, gqa_attention

# (batch, length, query heads, kv heads, head_dim): grouped (GQA), multi-head, multi-query
SHAPES = [(2, 7, 4, 2, 8), (2, 5, 3, 3, 4), (1, 6, 4, 1, 8)]


def tunix_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, scale: float) -> jax.Array:
    """Tunix 0.1.7's attention core, as written in its llama3 / qwen3 `Attention.block`."""
    b, t, qh, d = q.shape
    kh = k.shape[2]
    q = q.reshape((b, t, kh, qh // kh, d))
    attn = jnp.einsum("BTHGD,BSHD->BHGTS", q, k, preferred_element_type=jnp.float32) * scale
    if mask is not None:
        attn = jnp.where(mask[:, None, None, :, :], attn, K_MASK)
    attn = jax.nn.softmax(attn.astype(jnp.float32), axis=-1).astype(k.dtype)
    out = jnp.einsum("BHGTS,BSHD->BTHGD", attn, v, preferred_element_type=jnp.float32).astype(q.dtype)
    return out.reshape((b, t, qh, d))


def _inputs(shape: tuple[int, ...], dtype: jnp.dtype, padded: bool) -> tuple[jax.Array, ...]:
    b, t, n, kv, d = shape
    keys = jax.random.split(jax.random.key(sum(shape)), 4)
    q = jax.random.normal(keys[0], (b, t, n, d)).astype(dtype)
    k = jax.random.normal(keys[1], (b, t, kv, d)).astype(dtype)
    v = jax.random.normal(keys[2], (b, t, kv, d)).astype(dtype)
    g = jax.random.normal(keys[3], (b, t, n, d))
    valid = np.ones((b, t), bool)
    if padded:
        valid[0, :2] = False  # left padding: query 0 of row 0 sees no valid key at all
    mask = jnp.asarray(np.tril(np.ones((t, t), bool))[None] & valid[:, None, :])
    return q, k, v, g, mask


def _value_and_grads(fn, q, k, v, g, mask):  # noqa: ANN001, ANN202
    def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.sum(fn(q, k, v, mask, q.shape[-1] ** -0.5).astype(jnp.float32) * g)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)


def _assert_same(fn, reference, q, k, v, g, mask) -> None:  # noqa: ANN001
    """`fn`'s output, loss and gradients equal `reference`'s in float32 (scale 0.3 for the output)."""
    np.testing.assert_allclose(fn(q, k, v, mask, 0.3), reference(q, k, v, mask, 0.3), rtol=1e-5, atol=1e-6)
    got, want = _value_and_grads(fn, q, k, v, g, mask), _value_and_grads(reference, q, k, v, g, mask)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for a, b in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("padded", [False, True])
def test_float32_values_and_gradients_are_tunixs(shape: tuple[int, ...], padded: bool) -> None:
    _assert_same(gqa_attention, tunix_attention, *_inputs(shape, jnp.float32, padded))


def test_without_a_mask_every_key_is_attended() -> None:
    q, k, v, g, _ = _inputs(SHAPES[0], jnp.float32, False)
    _assert_same(gqa_attention, tunix_attention, q, k, v, g, None)


@pytest.mark.parametrize("shape", SHAPES + [(2, 8, 4, 2, 8)])
@pytest.mark.parametrize("masking", ["causal", "left-padded", "not causal", "none"])
def test_causal_attention_is_tunixs_under_a_causal_mask(shape: tuple[int, ...], masking: str) -> None:
    """Values and gradients of one Tunix attention under `mask & causal`, for odd and even lengths;
    left padding leaves rows in the first query block that attend to no key (they must still attend
    uniformly to every key, as in Tunix); a mask that lets queries see later keys is made causal."""
    q, k, v, g, mask = _inputs(shape, jnp.float32, masking == "left-padded")
    t = shape[1]
    if masking == "not causal":
        mask = jnp.asarray(np.random.default_rng(0).random((shape[0], t, t)) < 0.6)
    causal_mask = jnp.asarray(np.tril(np.ones((t, t), bool)))[None]
    mask = None if masking == "none" else mask
    want_mask = causal_mask if mask is None else mask & causal_mask

    def reference(q, k, v, _mask, scale):  # noqa: ANN001, ANN202
        return tunix_attention(q, k, v, want_mask, scale)

    _assert_same(causal_gqa_attention, reference, q, k, v, g, mask)


def test_causal_attention_skips_the_masked_quarter() -> None:
    """Why it exists: the compiled forward and backward do ~3/4 of the full attention's work."""
    q, k, v, g, mask = _inputs((2, 64, 4, 2, 16), jnp.float32, False)

    def flops(fn) -> float:  # noqa: ANN001
        def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            return jnp.sum(fn(q, k, v, mask, 0.25) * g)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().cost_analysis()["flops"]

    assert flops(causal_gqa_attention) < 0.8 * flops(gqa_attention)


def test_bfloat16_gradients_are_the_float32_ones_within_rounding() -> None:
    """The 16-bit path keeps float32 scores and softmax, as Tunix does; only operands are rounded."""
    q, k, v, g, mask = _inputs((2, 16, 4, 2, 16), jnp.float32, True)
    exact = _value_and_grads(tunix_attention, q, k, v, g, mask)
    low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    got = _value_and_grads(gqa_attention, *low, g, mask)
    for a, b in zip(got[1], exact[1], strict=True):
        assert a.dtype == jnp.bfloat16
        scale = float(jnp.abs(b).max())
        np.testing.assert_allclose(np.float32(a), np.float32(b), atol=2e-2 * scale)


def test_compiled_bfloat16_step_feeds_bfloat16_to_every_dot() -> None:
    """Why it is fast on CPU: scores, output and the four backward products all run on 16-bit operands."""
    q, k, v, g, mask = _inputs((2, 16, 4, 2, 16), jnp.bfloat16, False)

    def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.sum(gqa_attention(q, k, v, mask, 0.25).astype(jnp.float32) * g)

    types = dot_operand_types(jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text())
    assert len(types) == 6 and all(t == ("bf16", "bf16") for t in types), types

    def causal_loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.sum(causal_gqa_attention(q, k, v, mask, 0.25).astype(jnp.float32) * g)

    dots = hlo_dots(jax.jit(jax.grad(causal_loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text())
    # Two query blocks' products, plus the float32 gradient of the mean value that fully masked rows
    # of the first block take ([batch, heads * head_dim, 1]: not an attention product).
    types = [(lhs[0], rhs[0]) for out, lhs, rhs in dots if out != ["2", "64", "1"]]
    assert len(types) == 12 and all(t == ("bf16", "bf16") for t in types), dots


@pytest.mark.parametrize("family", ["llama3", "qwen3", "qwen2", "gemma3"])
def test_every_family_runs_its_attention_through_it(family: str, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    import importlib

    from lora_trainer.models import load_model
    from lora_trainer.models.forward import positions_and_mask
    from lora_trainer.tiny_models import make_tiny_hf_model

    model_code = importlib.import_module(f"lora_trainer.models.families.{family}.model")
    expected = model_code.Attention
    model = load_model(str(make_tiny_hf_model(family, tmp_path / family, seed=0)), dtype="float32").model
    assert all(type(layer.attn) is expected for layer in model.layers)
    # And the forward pass (no KV cache, as in training) reaches it once per layer: the class alone
    # would not show a fallback to Tunix's own attention, which gives the same numbers.
    calls = []

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(args[0].shape)
        return causal_gqa_attention(*args, **kwargs)

    monkeypatch.setattr(model_code, "causal_gqa_attention", counting)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 200, (2, 12)), jnp.int32)
    positions, mask = positions_and_mask(tokens, None)
    model(tokens, positions, None, mask)  # eager: a cached jit trace would not call the Python function
    assert len(calls) == len(model.layers), calls
