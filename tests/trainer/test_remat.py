"""`training.remat`: every policy computes the same loss and LoRA gradients, and each changes what
the compiled backward pass keeps (so none of them is silently ignored)."""

from __future__ import annotations

from collections import Counter

import jax
import numpy as np
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals
from trainer_fixtures import hlo_dots, loss_and_lora_grads, random_inputs

from lora_trainer.config import LoraSpec, QuantizationSpec, TrainingSpec
from lora_trainer.lora import apply_lora
from lora_trainer.loss import lm_loss
from lora_trainer.models import load_model, remat
from lora_trainer.tiny_models import make_tiny_hf_model
from lora_trainer.tunix_trainer import make_trainer


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory: pytest.TempPathFactory) -> nnx.Module:
    source = make_tiny_hf_model("llama3", tmp_path_factory.mktemp("remat") / "llama3", seed=0, num_hidden_layers=2)
    loaded = load_model(str(source), dtype="float32")
    return apply_lora(loaded.model, LoraSpec(rank=4, alpha=8.0), loaded.family, seed=0).model


def test_every_policy_gives_the_same_loss_and_gradients_and_changes_the_program(lora_model: nnx.Module) -> None:
    inputs = random_inputs()
    results, dots, temps = {}, {}, {}
    for policy in ("none", "dots", "full"):
        assert remat.apply(lora_model, policy) == 2  # both decoder layers
        value, grads = loss_and_lora_grads(lora_model, inputs)
        results[policy] = (float(value), jax.tree.map(np.asarray, nnx.to_pure_dict(grads)))
        compiled = loss_and_lora_grads.lower(lora_model, inputs).compile()
        dots[policy] = len(hlo_dots(compiled.as_text()))
        temps[policy] = compiled.memory_analysis().temp_size_in_bytes
    remat.apply(lora_model, "none")
    for policy in ("dots", "full"):
        assert results[policy][0] == pytest.approx(results["none"][0], rel=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), results[policy][1], results["none"][1])
    # `full` runs every layer's products again in the backward pass; `dots` keeps them (it recomputes
    # only elementwise work) but keeps less than `none`, which keeps everything.
    assert dots["full"] > dots["none"], dots
    assert dots["dots"] < dots["full"], dots
    assert temps["none"] > temps["dots"], temps


@pytest.mark.parametrize("quantization", [None, QuantizationSpec(weight_qtype="nf4", tile_size=16)], ids=["bf16", "nf4"])
def test_dots_keeps_a_16_bit_models_products_rather_than_run_them_again(tmp_path, quantization) -> None:  # noqa: ANN001
    """A bfloat16 model's products are custom_vjp functions (the base's, the quantized base's, the
    LoRA delta's), which a remat policy cannot see: `dots` must still keep every adapted projection's
    output and not run the forward's products again. Before the products were tagged, `dots` kept
    none of them and compiled to as many dots as `full` (a LoRA step at a full fine-tune's cost)."""
    source = make_tiny_hf_model("llama3", tmp_path / "llama3", seed=0, num_hidden_layers=2)
    loaded = load_model(str(source), dtype="bfloat16")
    model = apply_lora(loaded.model, LoraSpec(rank=4, alpha=8.0, quantization=quantization), loaded.family, seed=0).model
    inputs = random_inputs()

    def loss(lora: nnx.State) -> jax.Array:  # the model as split below, under the policy being checked
        return lm_loss(nnx.merge(graphdef, lora, rest, copy=True), **inputs)[0]

    kept, dots = {}, {}
    for policy in ("none", "dots", "full"):
        remat.apply(model, policy)
        graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
        kept[policy] = sum(f"named '{remat.PRODUCTS}'" in what for _, what in saved_residuals(loss, lora))
        hlo = loss_and_lora_grads.lower(model, inputs).compile().as_text()
        dots[policy] = Counter((tuple(out), tuple(lhs[1]), tuple(rhs[1])) for out, lhs, rhs in hlo_dots(hlo))
    remat.apply(model, "none")
    # q, k, v, o, gate and up of both layers (down's output only enters the residual sum, whose
    # backward needs no values); `none` keeps what it keeps outside any policy.
    assert kept["dots"] >= 2 * 6 and kept["dots"] > kept["none"], kept
    assert kept["full"] <= 1, kept  # the LM head's logits at most: they are outside the layers

    def rerun(policy: str) -> list[tuple]:
        """Dots `policy` runs beyond `none`'s (shapes only: XLA:CPU picks operand types by program),
        leaving out the rank-r products x @ A (inside the LoRA delta's custom_vjp; rank-sized) and
        attention's batched dots (`dots_with_no_batch_dims` leaves those to recompute too)."""
        extra = dots[policy] - dots["none"]
        return [d for d in extra.elements() if len(d[0]) == 2 and "4" not in d[0]]

    assert rerun("full"), "`full` must run the forward's weight products again"
    assert not rerun("dots"), rerun("dots")


@pytest.mark.slow
def test_the_train_step_trains_alike_under_every_policy(tmp_path) -> None:  # noqa: ANN001
    """The production step (Tunix's jitted train step over the remat'd layers) under each policy."""
    source = make_tiny_hf_model("llama3", tmp_path / "llama3", seed=0, num_hidden_layers=2)
    rng = np.random.default_rng(1)
    batch = {"input_tokens": rng.integers(3, 200, (2, 32)).astype(np.int32), "input_mask": np.ones((2, 32), np.int32),
             "segment_ids": np.ones((2, 32), np.int32), "positions": np.broadcast_to(np.arange(32), (2, 32)).astype(np.int32)}
    losses = {}
    for policy in ("none", "dots", "full"):
        loaded = load_model(str(source), dtype="float32")
        model = apply_lora(loaded.model, LoraSpec(rank=4, alpha=8.0), loaded.family, seed=0).model
        remat.apply(model, policy)
        trainer = make_trainer(model, TrainingSpec(steps=3, learning_rate=0.01, schedule="constant"))
        for _ in range(3):
            trainer.train([dict(batch)])
        losses[policy] = [float(a["loss"]) for a in trainer.train_aux]
    assert losses["none"][-1] < losses["none"][0]
    np.testing.assert_allclose(losses["dots"], losses["none"], rtol=1e-5)
    np.testing.assert_allclose(losses["full"], losses["none"], rtol=1e-5)


def test_auto_is_full_on_tpu_and_none_elsewhere() -> None:
    assert remat.resolve("auto", "tpu") == "full" and remat.resolve("auto", "cpu") == "none"
    assert remat.resolve("full", "cpu") == "full" and remat.resolve("none", "tpu") == "none"
