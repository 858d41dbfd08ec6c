"""An adapted projection as one product (`fused_delta`, the TPU form): the same sum as the frozen
product plus `lora_delta`, forward and backward, in each of its forms; and the provider uses it
for every unquantized 16-bit projection when told to, on every family, leaving the CPU's default alone."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from trainer_fixtures import flat_lora_grads, hlo_dots, random_inputs, random_lora

from lora_trainer import fused_delta
from lora_trainer.config import LoraSpec, QuantizationSpec
from lora_trainer.lora import apply_lora, set_lora_state
from lora_trainer.lora_provider import LoraProvider, lora_delta
from lora_trainer.loss import lm_loss
from lora_trainer.models import FAMILIES, load_model
from lora_trainer.tiny_models import make_tiny_hf_model

RANK = 4


def test_canonical_forms_are_the_projections_of_the_families() -> None:
    # Tunix's q/k/v ("BTD,DNH->BTNH") and o ("BTNH,NHD->BTD") with Qwix's LoRA specs for them.
    assert fused_delta.canonical_einsum("BTD,DNH->BTNH", "BTD,Dr,rNH->BTNH") == 1
    assert fused_delta.canonical_einsum("BTNH,NHD->BTD", "BTNH,NHr,rD->BTD") == 2
    # Not reshapes alone: contracted letters out of order, a batch letter, A or B in another order.
    assert fused_delta.canonical_einsum("BTHN,NHD->BTD", "BTHN,NHr,rD->BTD") is None
    assert fused_delta.canonical_einsum("BTD,BDN->BTN", "BTD,BDr,BrN->BTN") is None
    assert fused_delta.canonical_einsum("BTD,DNH->BTNH", "BTD,rD,rNH->BTNH") is None
    # dot_general: an MLP's x [b, t, d] . w [d, f]; batch dims, or w contracted on its last dim, are not.
    assert fused_delta.canonical_dot_general(3, 2, (((2,), (0,)), ((), ()))) == 1
    assert fused_delta.canonical_dot_general(3, 2, (((2,), (1,)), ((), ()))) is None
    assert fused_delta.canonical_dot_general(3, 3, (((2,), (1,)), ((0,), (0,)))) is None


def test_tensor_parallel_meshes_keep_two_products() -> None:
    assert fused_delta.allowed_on({}) and fused_delta.allowed_on({"data": 1, "fsdp": 8, "tp": 1})
    assert not fused_delta.allowed_on({"data": 1, "fsdp": 2, "tp": 4})


def _operands(k: int, o: int, dtype: jnp.dtype, seed: int = 0) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (2, 5, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(keys[1], (k, o), jnp.float32) / np.sqrt(k)).astype(dtype)
    a = jax.random.normal(keys[2], (k, RANK), jnp.float32) / np.sqrt(k)
    b = jax.random.normal(keys[3], (RANK, o), jnp.float32) * 0.5
    g = jax.random.normal(keys[4], (2, 5, o), jnp.float32).astype(dtype)
    return x, w, a, b, g


def _two_products(x: jax.Array, w: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """The provider's other form: the frozen product in float32 plus `lora_delta`, rounded once."""
    frozen = jax.lax.dot_general(x, w, (((2,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return (frozen + lora_delta("btk,kr,ro->bto", x, a, b, 2.0)).astype(x.dtype)


def _value_and_grads(f, x, w, a, b, g) -> tuple[jax.Array, ...]:  # noqa: ANN001
    out, vjp = jax.vjp(f, x, w, a, b)
    return (out, *vjp(g))


# (K, O): one product forward (K <= O), one backward (O <= K), or both (K == O).
SHAPES = [(8, 24), (24, 8), (16, 16)]


@pytest.mark.parametrize(("k", "o"), SHAPES)
def test_one_product_is_the_frozen_product_plus_the_delta(k: int, o: int) -> None:
    x, w, a, b, g = _operands(k, o, jnp.float32)
    fused = _value_and_grads(lambda *p: fused_delta.adapted_product(*p, 2.0), x, w, a, b, g)
    two = _value_and_grads(_two_products, x, w, a, b, g)
    for name, got, want in zip(("out", "dx", "dw", "da", "db"), fused, two):
        if name == "dw":  # the frozen weight gets no gradient
            assert not np.any(np.asarray(got)), got
            continue
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)
    assert float(jnp.max(jnp.abs(two[0] - x @ w))) > 0.1  # the delta takes part


@pytest.mark.parametrize(("k", "o"), SHAPES)
def test_sixteen_bit_operands_round_once_and_keep_float32_lora_gradients(k: int, o: int) -> None:
    x, w, a, b, g = _operands(k, o, jnp.bfloat16)
    out, dx, _, da, db = _value_and_grads(lambda *p: fused_delta.adapted_product(*p, 2.0), x, w, a, b, g)
    wide = [v.astype(jnp.float32) if v.dtype == jnp.bfloat16 else v for v in (x, w, a, b, g)]
    ref = _value_and_grads(lambda *p: fused_delta.adapted_product(*p, 2.0), *wide)
    assert (out.dtype, dx.dtype, da.dtype, db.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32, jnp.float32)
    for name, got, want in zip(("out", "dx", "da", "db"), (out, dx, da, db), (ref[0], ref[1], ref[3], ref[4])):
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))
        assert err < 0.02, (name, err)  # a few bfloat16 roundings of the operands


@pytest.mark.parametrize(("k", "o", "forward", "backward"), [(8, 24, True, False), (24, 8, False, True), (16, 16, True, True)])
def test_where_the_contraction_is_no_deeper_than_the_result_it_is_one_product(k: int, o: int, forward: bool, backward: bool) -> None:
    """The compiled forward and backward: a dot contracting K + r (or O + r) where the rule
    (`fused_delta._joined`) says one product, else the frozen product's K (or O) and the rank's r apart."""
    x, w, a, b, g = _operands(k, o, jnp.bfloat16)
    step = jax.jit(lambda *p: _value_and_grads(lambda *q: fused_delta.adapted_product(*q, 2.0), *p))
    dots = hlo_dots(step.lower(x, w, a, b, g).compile().as_text())
    dims = {d for _, lhs, rhs in dots for d in lhs[1] + rhs[1]}
    assert (str(k + RANK) in dims, str(o + RANK) in dims) == (forward, backward), dots


def _adapted(path: Path, fuses: bool | None, monkeypatch: pytest.MonkeyPatch, spec: LoraSpec) -> nnx.Module:
    monkeypatch.setattr(LoraProvider, "fuses_delta", fuses)
    base = load_model(str(path), dtype="bfloat16")
    model = apply_lora(base.model, spec, base.family, seed=0).model
    set_lora_state(model, random_lora(model))  # non-zero B, so that the delta takes part
    return model


def _traced(model: nnx.Module) -> tuple[str, float, dict[str, np.ndarray]]:
    """(the loss's jaxpr, loss, LoRA gradients) of the LoRA step on `random_inputs(10)`."""
    graph, state = nnx.split(model)
    jaxpr = str(jax.make_jaxpr(lambda s: lm_loss(nnx.merge(graph, s), **random_inputs(10))[0])(state))
    return (jaxpr, *flat_lora_grads(model))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_provider_makes_each_adapted_projection_one_product_when_told(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Told to (as on TPU), every adapted projection of a bf16 model is one `adapted_product`, with
    the loss and gradients of the two-product form within bfloat16 rounding; by default on this
    CPU none is (its golden logits are of the two-product form)."""
    path = make_tiny_hf_model(family, tmp_path, seed=5)
    spec = LoraSpec(rank=RANK, alpha=8.0)
    fused_jaxpr, fused_loss, fused_grads = _traced(_adapted(path, True, monkeypatch, spec))
    two_jaxpr, two_loss, two_grads = _traced(_adapted(path, False, monkeypatch, spec))
    default_jaxpr, _, _ = _traced(_adapted(path, None, monkeypatch, spec))
    projections = len(fused_grads) // 2  # an A and a B each
    # Gemma 3's q, k and v weights are [heads, d, head_dim], contracted in the middle: two products
    # there (one would need the weight transposed every step).
    two_left = 3 * 2 if family == "gemma3" else 0  # q, k, v of the tiny model's 2 layers
    assert fused_jaxpr.count("name=adapted_product") == projections - two_left > 0
    assert two_jaxpr.count("name=adapted_product") == default_jaxpr.count("name=adapted_product") == 0
    assert fused_loss == pytest.approx(two_loss, rel=1e-3)
    errs = {k: float(np.linalg.norm(fused_grads[k] - v) / np.linalg.norm(v)) for k, v in two_grads.items()}
    assert max(errs.values()) < 0.05, errs  # the input gradients are rounded once instead of twice


def test_quantized_and_dropout_projections_stay_two_products(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """QLoRA's frozen product dequantizes its weight, and LoRA dropout feeds the delta an input the
    frozen product does not see: neither is one product."""
    path = make_tiny_hf_model("llama3", tmp_path, seed=5)
    for spec in (LoraSpec(rank=RANK, alpha=8.0, quantization=QuantizationSpec(weight_qtype="int8")),
                 LoraSpec(rank=RANK, alpha=8.0, dropout=0.1)):
        jaxpr, loss, _ = _traced(_adapted(path, True, monkeypatch, spec))
        assert "name=adapted_product" not in jaxpr and np.isfinite(loss)
