"""The project's LoRA provider computes exactly what `qwix.LoraProvider` computes, forward and backward.

`lora_provider.LoraProvider` only reorders the low-rank path's backward (for speed), so its
loss and every LoRA gradient must equal Qwix's own on each family (einsum and dot_general
projections, GQA, Gemma 3's split K/V) and under QLoRA, up to float32 reassociation.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx
from trainer_fixtures import dot_operand_types, flat_lora_grads, hlo_dots, random_inputs, random_lora

from lora_trainer import lora as lora_mod
from lora_trainer.config import LoraSpec, QuantizationSpec
from lora_trainer.lora import apply_lora, lora_state, set_lora_state
from lora_trainer.lora_provider import LoraProvider, _subscripts, dot_general_spec, lora_delta
from lora_trainer.loss import lm_loss
from lora_trainer.models import FAMILIES, LoadedModel, load_model
from lora_trainer.tiny_models import make_tiny_hf_model


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    return {f: load_model(str(make_tiny_hf_model(f, tmp_path_factory.mktemp(f), seed=5))) for f in FAMILIES}


def _both(base: LoadedModel, spec: LoraSpec, monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, dict[str, np.ndarray]]]:
    """(loss, grads) with the project's provider and with Qwix's, same random non-zero LoRA params."""
    ours = apply_lora(base.model, spec, base.family, seed=0).model
    with monkeypatch.context() as m:
        m.setattr(lora_mod, "LoraProvider", qwix.LoraProvider)
        theirs = apply_lora(base.model, spec, base.family, seed=0).model
    params = random_lora(ours)
    set_lora_state(ours, params)
    set_lora_state(theirs, params)
    return [flat_lora_grads(ours), flat_lora_grads(theirs)]


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


@pytest.mark.parametrize("quantization", [QuantizationSpec(weight_qtype="int8"), QuantizationSpec(weight_qtype="nf4", tile_size=16)],
                         ids=["int8", "nf4"])
def test_qlora_grads_equal_qwix(loaded: dict[str, LoadedModel], monkeypatch: pytest.MonkeyPatch, quantization: QuantizationSpec) -> None:
    """Including the frozen product's own backward (`quantized_product`), on Einsum and Linear projections."""
    spec = LoraSpec(rank=4, alpha=8.0, quantization=quantization)
    ours, theirs = _both(loaded["llama3"], spec, monkeypatch)
    _assert_same(ours, theirs)


BATCHED_SPEC = dot_general_spec(3, (2,), (0,), 1)
DELTA_SPECS = [
    ("BTD,Dr,rNH->BTNH", [(2, 3, 8), (8, 4), (4, 2, 5)]),  # q_proj-like
    ("BTNH,NHr,rD->BTD", [(2, 3, 2, 5), (2, 5, 4), (4, 8)]),  # o_proj-like
    (dot_general_spec(3, (2,), (), 1), [(2, 3, 8), (8, 4), (4, 6)]),  # nnx.Linear
    (BATCHED_SPEC, [(2, 3, 8), (2, 8, 4), (2, 4, 6)]),  # a batch dim
]


@pytest.mark.parametrize(("spec", "shapes"), DELTA_SPECS)
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


@pytest.mark.parametrize(("spec", "shapes"), DELTA_SPECS)
def test_bfloat16_lora_delta_backward_runs_on_bfloat16_dots(spec: str, shapes: list[tuple[int, ...]]) -> None:
    """With 16-bit activations every product, weight gradients included, is a 16-bit dot (as autocast forms
    them), within rounding of float32. dA left to XLA's own operand order would be a bf16 dot that XLA:CPU
    cannot run at all ("Unsupported element type for DotThunk"): the step would fail."""
    keys = jax.random.split(jax.random.key(1), 4)
    shapes = [tuple(2 * n for n in s) for s in shapes]  # even sizes: XLA:CPU upcasts a bf16 dot contracting an odd one
    x, a, b = (jax.random.normal(k, s) for k, s in zip(keys, shapes))
    g = jax.random.normal(keys[3], jnp.einsum(spec, x, a, b).shape)

    def loss(x: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.sum(lora_delta(spec, x, a, b, 0.5) * g)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    low = grads(x.astype(jnp.bfloat16), a, b)
    types = dot_operand_types(grads.lower(x.astype(jnp.bfloat16), a, b).compile().as_text())
    # A batch dim (no family's projection has one) leaves the weight gradients to XLA:CPU's float32 path.
    assert types.count(("bf16", "bf16")) == (3 if spec == BATCHED_SPEC else 5), types
    for got, want in zip(low, jax.grad(loss, argnums=(0, 1, 2))(x, a, b), strict=True):
        np.testing.assert_allclose(np.float32(got), want, atol=3e-2 * float(np.abs(want).max()))


def test_unusual_specs_are_recognised() -> None:
    assert _subscripts("BTD,Dr,rNH->BTNH") is not None
    assert _subscripts("BTD,DNH->BTNH") is None  # not three operands
    assert _subscripts("BTD,Dr,rNH->BTNHQ") is None  # an output letter from nowhere


class _EinsumWithOptions(nnx.Module):
    """A projection whose einsum passes options (here `precision`): `lora_delta` does not take them,
    so the provider falls back to a plain einsum for the low-rank path."""

    def __init__(self) -> None:
        self.w = nnx.Param(jax.random.normal(jax.random.key(0), (8, 2, 4)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("BTD,DNH->BTNH", x, self.w.value, precision=jax.lax.Precision.HIGHEST)


def test_an_einsum_with_options_falls_back_to_qwix_s_math() -> None:
    x = jax.random.normal(jax.random.key(1), (2, 3, 8))
    models = []
    for provider in (LoraProvider, qwix.LoraProvider):
        model = qwix.apply_lora_to_model(_EinsumWithOptions(), provider(module_path=".*", rank=2, alpha=3.0), x)
        models.append(model)
    params = random_lora(models[0])
    assert params and all(set(p) == {"w_lora_a", "w_lora_b"} for p in params.values()), params
    results = []
    for model in models:
        set_lora_state(model, params)
        loss = lambda m: jnp.sum(jnp.sin(m(x)))  # noqa: E731
        value, grads = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
        results.append((float(value), {"/".join(map(str, k)): np.asarray(v.value) for k, v in nnx.to_flat_state(grads)}))
    _assert_same(*results)
    frozen = float(jnp.sum(jnp.sin(jnp.einsum("BTD,DNH->BTNH", x, _EinsumWithOptions().w.value))))
    assert abs(results[0][0] - frozen) > 1e-3  # the adapter takes part


RANK_BF16 = 3  # a rank no tiny-model dimension has, so rank-sized dots are recognisable in the HLO


def _lora_models(family: str, tmp: Any, dtype: str) -> tuple[nnx.Module, nnx.Module]:
    """The tiny model with the same random non-zero LoRA params, as a `dtype` base and a float32 base."""
    path = make_tiny_hf_model(family, tmp, seed=5)
    bases = [load_model(str(path), dtype=d) for d in (dtype, "float32")]
    low, wide = (apply_lora(b.model, LoraSpec(rank=RANK_BF16, alpha=6.0), b.family, seed=0).model for b in bases)
    params = random_lora(wide)
    set_lora_state(low, params)
    set_lora_state(wide, params)
    return low, wide


def _float32_dots(model: nnx.Module) -> list[tuple[list[str], ...]]:
    """(output, lhs, rhs) dims of the compiled LoRA step's dots whose operands are not both bf16."""
    step = nnx.jit(lambda m, i: nnx.value_and_grad(lm_loss, argnums=nnx.DiffState(0, nnx.LoRAParam), has_aux=True)(m, **i))
    dots = hlo_dots(step.lower(model, random_inputs(10)).compile().as_text())
    assert dots
    return [(out, lhs[1], rhs[1]) for out, lhs, rhs in dots if (lhs[0], rhs[0]) != ("bf16", "bf16")]


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_base_computes_in_bfloat16_and_matches_float32(family: str, tmp_path: Any) -> None:
    """A bf16 base computes in bf16 end to end: in the compiled LoRA step only rank-sized LoRA
    dots see float32 (Qwix's `bf16 + f32 delta` made every activation after the first
    adapted projection float32, and XLA's CPU backend runs only `bf16 x bf16 -> f32` dots natively,
    upcasting anything else: half the speed; docs/benchmarks.md). Its loss and LoRA gradients are the
    float32 model's within bfloat16 rounding."""
    low, wide = _lora_models(family, tmp_path, "bfloat16")
    r = str(RANK_BF16)
    # Allowed in float32: products contracting over the rank (rank-sized operands; XLA upcasts a
    # bf16 dot with an odd contraction), rope's sin/cos table through its identity product
    # ([tokens, head_dim] x [head_dim, head_dim]; models/rope.py), and the matrix-vector product
    # that sums the output gradients of fully masked attention rows ([b, t, n*d] x [b, t, 1];
    # models/attention.py). The LoRA weight gradients are bf16 products too.
    def allowed(out: list[str], lhs: list[str], rhs: list[str]) -> bool:
        rank_sized = r in lhs and r in rhs
        return rank_sized or (out == lhs and rhs == [lhs[-1]] * 2) or (out[-1] == rhs[-1] == "1")

    wide_dots = [d for d in _float32_dots(low) if not allowed(*d)]
    assert not wide_dots, f"float32 dots on activation-sized operands: {wide_dots}"
    (loss_lo, grads_lo), (loss_hi, grads_hi) = flat_lora_grads(low), flat_lora_grads(wide)
    assert loss_lo == pytest.approx(loss_hi, rel=1e-2)
    errs = {}
    for k in grads_hi:
        assert grads_lo[k].dtype == np.float32  # LoRA params (and so their gradients) stay float32
        errs[k] = float(np.linalg.norm(grads_lo[k] - grads_hi[k]) / np.linalg.norm(grads_hi[k]))
    # bfloat16 keeps 8 significant bits (0.4% per rounding): a few % after a whole backward pass.
    assert max(errs.values()) < 0.08 and float(np.median(list(errs.values()))) < 0.04, errs


def test_bfloat16_qlora_step_runs(tmp_path: Any) -> None:
    """QLoRA on a bf16 base keeps Qwix's quantized product (not the 16-bit fast path) and still trains."""
    path = make_tiny_hf_model("llama3", tmp_path, seed=5)
    base = load_model(str(path), dtype="bfloat16")
    spec = LoraSpec(rank=4, alpha=8.0, quantization=QuantizationSpec(weight_qtype="int8"))
    model = apply_lora(base.model, spec, base.family, seed=0).model
    set_lora_state(model, {p: {n: np.full(np.shape(v), 0.05, np.float32) for n, v in d.items()} for p, d in lora_state(model).items()})
    loss, grads = flat_lora_grads(model)
    assert np.isfinite(loss) and all(np.isfinite(g).all() and np.abs(g).max() > 0 for g in grads.values())
