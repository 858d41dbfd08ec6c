"""`late_weights`: a model built around placeholders and read into after LoRA and the layer stack
holds what a model loaded whole holds, placed the same; and a run trains the weights it read."""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from trainer_fixtures import parse, train_config

from lora_trainer import distributed, tunix_trainer
from lora_trainer.background import prompt_handoffs
from lora_trainer.config import LoraSpec, MeshSpec
from lora_trainer.lora import apply_lora
from lora_trainer.models import LoadedModel, late_weights, layer_stack, load_model
from lora_trainer.models.mapping import WeightRule
from lora_trainer.tiny_models import make_tiny_hf_model
from lora_trainer.train import run_training

FROZEN = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))


def _frozen(model: nnx.Module) -> dict[str, jax.Array]:
    return {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, FROZEN))}


def _with_lora(source: Path, scan: bool, *, placeholders: bool, mesh: jax.sharding.Mesh) -> LoadedModel:
    """The base with LoRA's structure (as a resume builds it), stacked if `scan`."""
    loaded = load_model(str(source), dtype="bfloat16", mesh=mesh, placeholders=placeholders)
    loaded.model = apply_lora(loaded.model, LoraSpec(rank=4, alpha=8.0), loaded.family, seed=0, structure_only=True).model
    layer_stack.apply(loaded.model, scan)
    return loaded


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_read_into_places_what_a_whole_load_places(tmp_path, scan):
    source = make_tiny_hf_model("llama3", tmp_path / "llama3", seed=3, num_hidden_layers=3)
    mesh = distributed.make_mesh(MeshSpec())
    whole = _with_lora(source, scan, placeholders=False, mesh=mesh)
    late = _with_lora(source, scan, placeholders=True, mesh=mesh)
    assert late.placeholders and all(not np.any(np.asarray(a)) for a in _frozen(late.model).values())
    variables = {p: v for p, v in nnx.to_flat_state(nnx.state(late.model, FROZEN))}

    late_weights.read_into(late.model, late)

    assert not late.placeholders
    expected, got = _frozen(whole.model), _frozen(late.model)
    assert got.keys() == expected.keys() and any(k.startswith("layer_stack/") for k in got) == scan
    for path, value in got.items():
        want = expected[path]
        assert (value.shape, value.dtype, value.sharding) == (want.shape, want.dtype, want.sharding), path
        np.testing.assert_array_equal(np.asarray(value), np.asarray(want), err_msg=path)
    # updated in place: a train step built on the variables before the read sees the values
    assert all(v is variables[p] for p, v in nnx.to_flat_state(nnx.state(late.model, FROZEN)))


def test_each_placeholder_is_freed_before_its_stack_is_built(tmp_path, monkeypatch):
    """The late read takes no more memory than the eager load's stacking: a stack's placeholder is
    gone when its layers are stacked (else the chip holds it, the layers and the new stack at once)."""
    source = make_tiny_hf_model("llama3", tmp_path / "llama3", seed=3, num_hidden_layers=3)
    late = _with_lora(source, True, placeholders=True, mesh=distributed.make_mesh(MeshSpec()))
    stacks = [weakref.ref(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(late.model, FROZEN)) if p[0] == "layer_stack"]
    live_at_each_stacking: list[int] = []
    stack_arrays = layer_stack.stack_arrays

    def stacking(*arrays: jax.Array, **placement: jax.sharding.Sharding) -> jax.Array:
        gc.collect()
        live_at_each_stacking.append(sum(r() is not None for r in stacks))
        return stack_arrays(*arrays, **placement)

    monkeypatch.setattr(layer_stack, "stack_arrays", stacking)
    late_weights.read_into(late.model, late)
    assert live_at_each_stacking == list(range(len(stacks) - 1, -1, -1))


def _rule(nnx_path: str) -> tuple[str, str, WeightRule]:
    return (nnx_path.replace("/", "."), nnx_path, WeightRule(hf=nnx_path.replace("/", "."), nnx=nnx_path, hf_axes="d", nnx_axes="d"))


def test_targets_find_each_tensors_variable_in_place_or_in_its_layers_stack():
    held = {"embedder/input_embedding", "layer_stack/frozen/attn/q_proj/w"}
    entries = [_rule("embedder/input_embedding"), _rule("layers/1/attn/q_proj/w"), _rule("layers/0/attn/q_proj/w")]
    found = late_weights.targets(held, entries)
    assert [(i, k) for i, k, _ in found["embedder/input_embedding"]] == [(None, "embedder.input_embedding")]
    assert sorted(i for i, _, _ in found["layer_stack/frozen/attn/q_proj/w"]) == [0, 1]


@pytest.mark.parametrize(
    ("held", "entries", "message"),
    [
        ({"a/w"}, ["b/w"], "holds no variable for b/w"),
        ({"a/w", "c/w"}, ["a/w"], r"no checkpoint tensor fills the base weights \['c/w'\]"),
        ({"layer_stack/frozen/q/w"}, ["layers/0/q/w", "layers/2/q/w"], "one tensor, or one per layer"),
    ],
    ids=["a-tensor-held-nowhere", "a-weight-no-tensor-fills", "a-stack-missing-a-layer"],
)
def test_targets_refuse_a_model_the_table_does_not_fill_exactly(held, entries, message):
    with pytest.raises(AssertionError, match=message):
        late_weights.targets(held, [_rule(p) for p in entries])


def test_stacked_at_names_the_stack_and_the_layer():
    assert layer_stack.stacked_at("layers/12/mlp/down_proj/kernel") == ("layer_stack/frozen/mlp/down_proj/kernel", 12)
    assert layer_stack.stacked_at("embedder/input_embedding") is None
    assert layer_stack.stacked_at("layers/norm") is None


def test_a_run_reads_the_weights_once_the_step_is_compiling_and_trains_on_them(tmp_path, monkeypatch):
    events: list[str] = []
    read: list[nnx.Module] = []
    compile_ahead, read_into = tunix_trainer.LoraPeftTrainer.compile_ahead, late_weights.read_into

    def compiling(trainer: tunix_trainer.LoraPeftTrainer, micro_batch: dict[str, jax.Array], records: object) -> None:
        events.append("compile ahead")
        compile_ahead(trainer, micro_batch, records)

    def reading(model: nnx.Module, loaded: LoadedModel) -> None:
        events.append(f"read the weights, handing over every {sys.getswitchinterval() * 1e3:.1f} ms")
        read_into(model, loaded)
        read.append(model)

    monkeypatch.setattr(tunix_trainer.LoraPeftTrainer, "compile_ahead", compiling)
    monkeypatch.setattr(late_weights, "read_into", reading)
    cfg = train_config(tmp_path, str(tmp_path / "out"), steps=2, checkpointEvery=2, scanLayers=True)
    interval = sys.getswitchinterval()
    run_training(parse(cfg))

    assert events == ["compile ahead", "read the weights, handing over every 0.2 ms"]
    assert sys.getswitchinterval() == interval
    (model,) = read
    whole = load_model(cfg["model"]["source"], dtype=cfg["model"]["dtype"], mesh=distributed.make_mesh(MeshSpec()))
    whole.model = apply_lora(whole.model, LoraSpec(rank=4, alpha=8.0), whole.family, seed=0, structure_only=True).model
    layer_stack.apply(whole.model, True)
    expected = _frozen(whole.model)
    for path, value in _frozen(model).items():  # the frozen base after training: what was read, never changed
        np.testing.assert_array_equal(np.asarray(value), np.asarray(expected[path]), err_msg=path)


def test_prompt_handoffs_shorten_the_switch_interval_inside_only():
    before = sys.getswitchinterval()
    with pytest.raises(RuntimeError), prompt_handoffs(1e-4):
        assert sys.getswitchinterval() == pytest.approx(1e-4)
        raise RuntimeError
    assert sys.getswitchinterval() == before
