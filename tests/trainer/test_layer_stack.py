"""`training.scanLayers`: a scanned model computes what the unrolled one does, compiles one layer's
program whatever its depth, keeps one copy of the frozen weights and the LoRA paths, and refuses
layers that are not one program, naming why."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from trainer_fixtures import hlo_dots, loss_and_lora_grads, parse, random_inputs, train_config

from lora_trainer import checkpoint
from lora_trainer.config import LoraSpec, QuantizationSpec
from lora_trainer.errors import Preempted, UserError
from lora_trainer.lora import apply_lora, lora_state
from lora_trainer.loss import lm_loss
from lora_trainer.models import layer_stack, load_model, remat
from lora_trainer.tiny_models import make_tiny_hf_model
from lora_trainer.train import run_training


def _model(source: Path, dtype: str = "float32", **lora: object) -> nnx.Module:
    """The tiny model with LoRA whose B matrices are random too, so every adapter term counts."""
    loaded = load_model(str(source), dtype=dtype)
    model = apply_lora(loaded.model, LoraSpec(rank=4, alpha=8.0, **lora), loaded.family, seed=0).model
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        v.set_value(jnp.asarray(np.random.default_rng(len(str(path))).normal(0, 0.05, v.get_value().shape), v.get_value().dtype))
    return model


def _flat(tree: nnx.State) -> dict[str, np.ndarray]:
    return {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(tree)}


@pytest.mark.parametrize(("family", "policy"), [("llama3", "none"), ("llama3", "dots"), ("qwen2", "none"), ("qwen3", "dots")])
def test_a_scanned_model_has_the_unrolled_loss_and_gradients(tmp_path, family, policy) -> None:  # noqa: ANN001
    source = make_tiny_hf_model(family, tmp_path / family, seed=0, num_hidden_layers=3)
    unrolled, scanned = _model(source), _model(source)
    for model in (unrolled, scanned):
        remat.apply(model, policy)
    weights = sum(v.get_value().size for _, v in nnx.to_flat_state(nnx.state(scanned, nnx.Not(nnx.LoRAParam))))
    assert layer_stack.apply(scanned, True) == "scanned"

    # One copy of the frozen weights, now in the stack; the layers keep only their LoRA parameters,
    # under the paths a checkpoint names them by.
    assert sum(v.get_value().size for _, v in nnx.to_flat_state(nnx.state(scanned, nnx.Not(nnx.LoRAParam)))) == weights
    assert all(isinstance(v, nnx.LoRAParam) for layer in scanned.layers for _, v in nnx.to_flat_state(nnx.state(layer)))
    assert lora_state(scanned).keys() == lora_state(unrolled).keys()
    assert all(leaf.shape[0] == 3 for leaf in jax.tree.leaves(nnx.state(scanned.layer_stack)))

    inputs = random_inputs()
    want_loss, want_grads = loss_and_lora_grads(unrolled, inputs)
    got_loss, got_grads = loss_and_lora_grads(scanned, inputs)
    assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-6)
    want, got = _flat(want_grads), _flat(got_grads)
    assert got.keys() == want.keys() and len(want) == 3 * 7 * 2
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-7, err_msg=name)
    with pytest.raises(NotImplementedError, match="no KV-cache"):  # decoding needs the layers' own weights
        scanned(inputs["input_tokens"], inputs["positions"], {}, inputs["attention_mask"])


def test_a_scanned_qlora_model_matches_within_bfloat16(tmp_path) -> None:  # noqa: ANN001
    """nf4 weights (Qwix's frozen WithAux values) stack like arrays; bf16 sums in another order only."""
    source = make_tiny_hf_model("llama3", tmp_path / "llama3", seed=0, num_hidden_layers=2)
    quantization = QuantizationSpec(weight_qtype="nf4", tile_size=16)
    unrolled, scanned = (_model(source, "bfloat16", quantization=quantization) for _ in range(2))
    assert layer_stack.apply(scanned, True) == "scanned"
    inputs = random_inputs()
    want_loss, want_grads = loss_and_lora_grads(unrolled, inputs)
    got_loss, got_grads = loss_and_lora_grads(scanned, inputs)
    assert float(got_loss) == pytest.approx(float(want_loss), rel=2e-3)
    want, got = _flat(want_grads), _flat(got_grads)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0.05, atol=0.02 * np.abs(want[name]).max(), err_msg=name)


def test_the_scanned_program_holds_one_layer_whatever_the_depth(tmp_path) -> None:  # noqa: ANN001
    """What makes compile time independent of depth: the compiled step's products do not grow with
    the layers when scanned, and grow with them unrolled."""
    dots: dict[tuple[int, bool], int] = {}
    for layers in (2, 4):
        source = make_tiny_hf_model("llama3", tmp_path / f"l{layers}", seed=0, num_hidden_layers=layers)
        for scan in (False, True):
            model = _model(source)
            if scan:
                layer_stack.apply(model, True)
            dots[layers, scan] = len(hlo_dots(loss_and_lora_grads.lower(model, random_inputs()).compile().as_text()))
    assert dots[4, True] == dots[2, True], dots
    assert dots[4, False] > dots[2, False] > dots[2, True], dots


def test_layers_that_are_not_one_program_are_refused_naming_why(tmp_path) -> None:  # noqa: ANN001
    source = make_tiny_hf_model("llama3", tmp_path / "llama3", seed=0, num_hidden_layers=2)
    cases = {
        "decoder layer 1 differs": _model(source, target_modules="layers/0/.*"),
        "lora.dropout: 0": _model(source, dropout=0.1),
        "Gemma3 has no scanned forward pass": _model(make_tiny_hf_model("gemma3", tmp_path / "gemma3", seed=0)),
    }
    for reason, model in cases.items():
        assert layer_stack.apply(model, False) == "unrolled"
        with pytest.raises(UserError, match=r"training.scanLayers is true, but .*" + reason):
            layer_stack.apply(model, True)
        assert getattr(model, "layer_stack", None) is None
        lm_loss(model, **random_inputs())  # still runs unrolled: nothing was moved


def test_a_scanned_run_trains_the_adapter_an_unrolled_run_does(tmp_path) -> None:  # noqa: ANN001
    """The whole trainer (Tunix's step, checkpoints, the adapter's paths) over a 2-layer model."""
    source = make_tiny_hf_model("llama3", tmp_path / "model", seed=0, num_hidden_layers=2)
    adapters = {}
    for scan in (False, True):
        cfg = train_config(tmp_path, str(tmp_path / str(scan)), steps=3, checkpointEvery=3, scanLayers=scan)
        cfg["model"]["source"] = str(source)
        result = run_training(parse(cfg))
        adapters[scan] = checkpoint.read_lora(result.checkpoint_root)[0]
    assert adapters[True].keys() == adapters[False].keys() and len(adapters[True]) == 14
    for path, params in adapters[False].items():
        for name, want in params.items():
            np.testing.assert_allclose(adapters[True][path][name], want, rtol=1e-4, atol=1e-6, err_msg=f"{path}/{name}")


def test_a_scanned_run_preempted_and_resumed_ends_where_an_uninterrupted_one_does(tmp_path) -> None:  # noqa: ANN001
    """The resume stacks LoRA built from Qwix's traced forward (zeros), then restores the per-layer checkpoint into it."""
    adapters = []
    for name, stop_at in (("preempted", 2), ("uninterrupted", None)):
        cfg = parse(train_config(tmp_path, str(tmp_path / name), steps=6, checkpointEvery=3, scanLayers=True))

        def preempt(record: dict, stop_at: int | None = stop_at) -> None:
            if record["step"] == stop_at:
                os.kill(os.getpid(), signal.SIGTERM)

        if stop_at is not None:
            with pytest.raises(Preempted):
                run_training(cfg, on_progress=preempt)
            stopped = checkpoint.latest_committed_step(str(tmp_path / name / "checkpoints"))
            assert stopped is not None and 2 <= stopped < 6
        result = run_training(cfg)
        assert result.final_step == 6
        adapters.append(checkpoint.read_lora(result.checkpoint_root)[0])
    resumed, straight = adapters
    assert resumed.keys() == straight.keys()
    for path, params in straight.items():
        for name, want in params.items():
            np.testing.assert_array_equal(resumed[path][name], want, err_msg=f"{path}/{name}")
