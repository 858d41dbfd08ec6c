"""The project's LoRA provider computes exactly what `qwix.LoraProvider` computes, forward and backward.

`lora_provider.LoraProvider` only reorders the low-rank path's backward (for speed), so its
loss and every LoRA gradient must equal Qwix's own on each family (einsum and dot_general
projections, GQA, Gemma 3's split K/V) and under QLoRA, up to float32 reassociation.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx

from lora_trainer import lora as lora_mod
from lora_trainer.config import LoraSpec, QuantizationSpec
from lora_trainer.lora import apply_lora, lora_state, set_lora_state
from lora_trainer.lora_provider import _subscripts, dot_general_spec, lora_delta
from lora_trainer.models import FAMILIES, LoadedModel, load_model
from lora_trainer.tiny_models import make_tiny_hf_model
from lora_trainer.train import lm_loss, model_inputs


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    return {f: load_model(str(make_tiny_hf_model(f, tmp_path_factory.mktemp(f), seed=5))) for f in FAMILIES}


def _inputs() -> dict[str, jax.Array]:
    tokens = np.random.default_rng(2).integers(3, 272, (2, 10)).astype(np.int32)
    ones = np.ones_like(tokens)
    pos = np.tile(np.arange(10, dtype=np.int32), (2, 1))
    return model_inputs({"input_tokens": jnp.asarray(tokens), "input_mask": jnp.asarray(ones), "segment_ids": jnp.asarray(ones), "positions": jnp.asarray(pos)})


def _loss_and_grads(model: nnx.Module) -> tuple[float, dict[str, np.ndarray]]:
    (loss, _), grads = nnx.value_and_grad(lm_loss, argnums=nnx.DiffState(0, nnx.LoRAParam), has_aux=True)(model, **_inputs())
    return float(loss), {"/".join(map(str, k)): np.asarray(v.value) for k, v in nnx.to_flat_state(grads)}


def _both(base: LoadedModel, spec: LoraSpec, monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, dict[str, np.ndarray]]]:
    """(loss, grads) with the project's provider and with Qwix's, same random non-zero LoRA params."""
    ours = apply_lora(base.model, spec, base.family, seed=0).model
    with monkeypatch.context() as m:
        m.setattr(lora_mod, "LoraProvider", qwix.LoraProvider)
        theirs = apply_lora(base.model, spec, base.family, seed=0).model
    rng = np.random.default_rng(7)
    params = {p: {n: (0.1 * rng.standard_normal(np.shape(v))).astype(np.float32) for n, v in d.items()} for p, d in lora_state(ours).items()}
    set_lora_state(ours, params)
    set_lora_state(theirs, params)
    return [_loss_and_grads(ours), _loss_and_grads(theirs)]


def _assert_same(a: tuple[float, dict[str, np.ndarray]], b: tuple[float, dict[str, np.ndarray]]) -> None:
    assert a[0] == pytest.approx(b[0], rel=1e-6)
    assert sorted(a[1]) == sorted(b[1]) and a[1]
    for k in a[1]:
        scale = float(np.abs(b[1][k]).max()) or 1.0
        np.testing.assert_allclose(a[1][k], b[1][k], atol=1e-5 * scale, rtol=0, err_msg=k)


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_and_lora_grads_equal_qwix(loaded: dict[str, LoadedModel], family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ours, theirs = _both(loaded[family], LoraSpec(rank=4, alpha=8.0), monkeypatch)
    _assert_same(ours, theirs)
    assert all(np.abs(g).max() > 0 for g in ours[1].values())


def test_qlora_grads_equal_qwix(loaded: dict[str, LoadedModel], monkeypatch: pytest.MonkeyPatch) -> None:
    spec = LoraSpec(rank=4, alpha=8.0, quantization=QuantizationSpec(weight_qtype="int8"))
    ours, theirs = _both(loaded["llama3"], spec, monkeypatch)
    _assert_same(ours, theirs)


@pytest.mark.parametrize(
    ("spec", "shapes"),
    [
        ("BTD,Dr,rNH->BTNH", [(2, 3, 8), (8, 4), (4, 2, 5)]),  # q_proj-like
        ("BTNH,NHr,rD->BTD", [(2, 3, 2, 5), (2, 5, 4), (4, 8)]),  # o_proj-like
        (dot_general_spec(3, (2,), (), 1), [(2, 3, 8), (8, 4), (4, 6)]),  # nnx.Linear
        (dot_general_spec(3, (2,), (0,), 1), [(2, 3, 8), (2, 8, 4), (2, 4, 6)]),  # a batch dim
    ],
)
def test_lora_delta_matches_autodiff_of_plain_einsum(spec: str, shapes: list[tuple[int, ...]]) -> None:
    keys = jax.random.split(jax.random.key(0), 4)
    x, a, b = (jax.random.normal(k, s) for k, s in zip(keys, shapes))
    g = jax.random.normal(keys[3], jnp.einsum(spec, x, a, b).shape)

    def plain(x: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.einsum(spec, x, a, b) * 0.5

    def ours(x: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
        return lora_delta(spec, x, a, b, 0.5)

    out1, vjp1 = jax.vjp(plain, x, a, b)
    out2, vjp2 = jax.vjp(ours, x, a, b)
    np.testing.assert_allclose(out2, out1, rtol=1e-5, atol=1e-6)
    for got, want in zip(vjp2(g), vjp1(g)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_unusual_specs_fall_back() -> None:
    assert _subscripts("BTD,Dr,rNH->BTNH") is not None
    assert _subscripts("BTD,DNH->BTNH") is None  # not three operands
    assert _subscripts("BTD,Dr,rNH->BTNHQ") is None  # an output letter from nowhere


def _lora_models(family: str, tmp: Any, dtype: str) -> tuple[nnx.Module, nnx.Module]:
    """The tiny model with the same random non-zero LoRA params, as a `dtype` base and a float32 base."""
    path = make_tiny_hf_model(family, tmp, seed=5)
    bases = [load_model(str(path), dtype=d) for d in (dtype, "float32")]
    low, wide = (apply_lora(b.model, LoraSpec(rank=4, alpha=8.0), b.family, seed=0).model for b in bases)
    rng = np.random.default_rng(7)
    params = {p: {n: (0.1 * rng.standard_normal(np.shape(v))).astype(np.float32) for n, v in d.items()} for p, d in lora_state(wide).items()}
    set_lora_state(low, params)
    set_lora_state(wide, params)
    return low, wide


@pytest.mark.parametrize("family", ["llama3", "gemma3"])
def test_bfloat16_base_stays_bfloat16_and_matches_float32(family: str, tmp_path: Any) -> None:
    """A bf16 base computes in bf16 all the way to the logits (Qwix's `bf16 + f32 delta` made every
    activation after the first adapted projection float32), and its loss and LoRA gradients are the
    float32 model's within bfloat16 rounding."""
    low, wide = _lora_models(family, tmp_path, "bfloat16")
    inputs = _inputs()
    logits, _ = low(inputs["input_tokens"], inputs["positions"], None, inputs["attention_mask"])
    assert logits.dtype == jnp.bfloat16
    (loss_lo, grads_lo), (loss_hi, grads_hi) = _loss_and_grads(low), _loss_and_grads(wide)
    assert loss_lo == pytest.approx(loss_hi, rel=1e-2)
    errs = {}
    for k in grads_hi:
        assert grads_lo[k].dtype == np.float32  # LoRA params (and so their gradients) stay float32
        errs[k] = float(np.linalg.norm(grads_lo[k] - grads_hi[k]) / np.linalg.norm(grads_hi[k]))
    # bfloat16 keeps 8 significant bits (0.4% per rounding): a few % after a whole backward pass.
    assert max(errs.values()) < 0.08 and float(np.median(list(errs.values()))) < 0.04, errs


def test_bfloat16_step_feeds_16bit_operands_to_every_activation_sized_dot(tmp_path: Any) -> None:
    """The compiled LoRA step of a bf16 base: only the rank-sized LoRA weight-gradient dots see float32.

    XLA's CPU backend runs `bf16 x bf16 -> f32` dots natively and upcasts anything else to float32
    (half the speed), so this is the property that makes a bf16 step fast (docs/benchmarks.md).
    """
    low, _ = _lora_models("llama3", tmp_path, "bfloat16")
    step = nnx.jit(lambda m, i: nnx.value_and_grad(lm_loss, argnums=nnx.DiffState(0, nnx.LoRAParam), has_aux=True)(m, **i))
    hlo = step.lower(low, _inputs()).compile().as_text()
    types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo))
    dots = re.findall(r"= \w+\[([\d,]*)\]\S* dot\(%([\w.\-]+), %([\w.\-]+)\)", hlo)
    assert dots
    for out, a, b in dots:
        if (types[a], types[b]) != ("bf16", "bf16"):
            assert "4" in out.split(","), f"a float32 dot that is not rank-sized: {out} from {types[a]}, {types[b]}"
