"""Qwix (Q)LoRA on every family: where LoRA params land, what they compute, and bad input.

The strongest check is `test_lora_equals_merged_hf_weights`: random non-zero LoRA params
in JAX give the same logits as the HF model whose weights were merged with the PEFT
tensors from `LoraTarget.to_peft` (W += alpha/r * B @ A), which proves the module mapping,
the A/B shapes and the PEFT flatten order for each family.
"""

from __future__ import annotations

import re
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.interpreters import partial_eval

from lora_trainer import lora_names
from lora_trainer.config import LoraSpec, QuantizationSpec
from lora_trainer.errors import UserError
from lora_trainer.lora import apply_lora, lora_state, set_lora_state
from lora_trainer.lora_provider import no_lora_dropout
from lora_trainer.models import FAMILIES, LoadedModel, forward_logits, load_model
from lora_trainer.models.forward import positions_and_mask
from lora_trainer.tiny_models import make_tiny_hf_model

RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    return {
        family: load_model(str(make_tiny_hf_model(family, tmp_path_factory.mktemp(family), seed=3)))
        for family in FAMILIES
    }


def _tokens(seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 272, (2, 12)).astype(np.int32)


def _random_lora(tree: dict, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        path: {name: (0.1 * rng.standard_normal(np.shape(v))).astype(np.float32) for name, v in params.items()}
        for path, params in tree.items()
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_targets_every_projection_and_fresh_lora_is_identity(loaded: dict[str, LoadedModel], family: str) -> None:
    base = loaded[family]
    applied = apply_lora(base.model, LoraSpec(rank=RANK, alpha=ALPHA), base.family, seed=0)
    expected = sorted(base.family.module_paths(base.hf_config))
    assert applied.module_paths == expected and applied.target_regex == base.family.auto_target_regex
    state = lora_state(applied.model)
    assert sorted(state) == expected
    for path, params in state.items():
        target, _ = base.family.target_for_path(path)
        weight = target.weight_name
        a_shape, b_shape = target.lora_shapes(_weight_shape(applied.model, path, weight), RANK)
        assert {n: v.shape for n, v in params.items()} == {f"{weight}_lora_a": a_shape, f"{weight}_lora_b": b_shape}
        assert all(v.dtype == jnp.float32 for v in params.values())
    # The base model is not modified, and B = 0 makes the adapter a no-op.
    assert not lora_state(base.model)
    tokens = _tokens()
    np.testing.assert_allclose(
        np.asarray(forward_logits(applied.model, tokens)), np.asarray(forward_logits(base.model, tokens)), atol=1e-6
    )


def _merged_hf_logits(base: LoadedModel, tree: dict, tokens: np.ndarray) -> np.ndarray:
    """HF logits after merging the PEFT form of `tree` into the HF weights: W += alpha/r * B @ A."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base.local_dir, dtype=torch.float32).eval()
    weights = dict(model.named_parameters())
    with torch.no_grad():
        for path, params in tree.items():
            target, _ = base.family.target_for_path(path)
            name = target.weight_name
            peft_a, peft_b = target.to_peft(params[f"{name}_lora_a"], params[f"{name}_lora_b"])
            w = weights[base.family.hf_module_name(path) + ".weight"]
            assert peft_a.shape == (RANK, w.shape[1]) and peft_b.shape == (w.shape[0], RANK)
            w += torch.from_numpy(np.asarray(peft_b @ peft_a)) * (ALPHA / RANK)
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_equals_merged_hf_weights(loaded: dict[str, LoadedModel], family: str) -> None:
    base = loaded[family]
    applied = apply_lora(base.model, LoraSpec(rank=RANK, alpha=ALPHA), base.family, seed=0)
    tree = _random_lora(lora_state(applied.model), seed=7)
    set_lora_state(applied.model, tree)
    tokens = _tokens()
    ours = np.asarray(forward_logits(applied.model, tokens))
    assert np.abs(ours - np.asarray(forward_logits(base.model, tokens))).max() > 1e-2  # the adapter does something
    theirs = _merged_hf_logits(base, tree, tokens)
    assert np.abs(ours - theirs).max() < 1e-4
    # ... and the PEFT form converts back to the same NNX arrays.
    for path, params in tree.items():
        target, _ = base.family.target_for_path(path)
        name = target.weight_name
        a, b = params[f"{name}_lora_a"], params[f"{name}_lora_b"]
        back = target.from_peft(*target.to_peft(a, b), _weight_shape(applied.model, path, name))
        np.testing.assert_array_equal(back[0], a)
        np.testing.assert_array_equal(back[1], b)


@pytest.mark.parametrize("family", FAMILIES)
def test_structure_only_is_qwixs_model_with_zeros_on_the_base_arrays(loaded: dict[str, LoadedModel], family: str) -> None:
    """A resume's LoRA (`structure_only`, Qwix's forward traced, not run): the same params, zero,
    over the base's own arrays; with the eager model's values set, the logits are the same bits."""
    base = loaded[family]
    spec = LoraSpec(rank=RANK, alpha=ALPHA, dropout=0.1)
    eager = apply_lora(base.model, spec, base.family, seed=0)
    origin = partial_eval.DynamicJaxprTracer._origin_msg
    traced = apply_lora(base.model, spec, base.family, seed=0, structure_only=True)
    assert partial_eval.DynamicJaxprTracer._origin_msg is origin  # tracer errors name their origin again
    assert traced.module_paths == eager.module_paths
    want, got = lora_state(eager.model), lora_state(traced.model)
    assert {p: {n: (v.shape, v.dtype) for n, v in ps.items()} for p, ps in got.items()} == {
        p: {n: (v.shape, v.dtype) for n, v in ps.items()} for p, ps in want.items()}  # fmt: skip
    assert all(not np.asarray(v).any() for ps in got.values() for v in ps.values())
    ours = dict(nnx.to_flat_state(nnx.state(traced.model, nnx.Not(nnx.LoRAParam))))
    theirs = dict(nnx.to_flat_state(nnx.state(base.model)))
    assert set(theirs) <= set(ours)  # and the dropout stream's state
    assert all(ours[path].get_value() is var.get_value() for path, var in theirs.items())  # no copy of the base
    set_lora_state(traced.model, _random_lora(want, seed=5))
    set_lora_state(eager.model, _random_lora(want, seed=5))
    tokens = _tokens()
    with no_lora_dropout():
        np.testing.assert_array_equal(np.asarray(forward_logits(traced.model, tokens)),
                                      np.asarray(forward_logits(eager.model, tokens)))  # fmt: skip


def test_structure_only_still_quantizes_under_qlora(loaded: dict[str, LoadedModel]) -> None:
    """QLoRA's quantized weights come out of Qwix's forward, so `structure_only` runs it."""
    base = loaded["llama3"]
    spec = LoraSpec(rank=RANK, alpha=ALPHA, target_modules=r"layers/0/mlp/down_proj",
                    quantization=QuantizationSpec(weight_qtype="int8", tile_size=16))  # fmt: skip
    eager = apply_lora(base.model, spec, base.family, seed=0).model
    traced = apply_lora(base.model, spec, base.family, seed=0, structure_only=True).model
    ours, theirs = lora_state(traced)["layers/0/mlp/down_proj"], lora_state(eager)["layers/0/mlp/down_proj"]
    assert sorted(ours) == sorted(theirs) and all(np.array_equal(ours[n], theirs[n]) for n in ours)  # A: he-uniform, not zeros
    tokens = _tokens()
    np.testing.assert_array_equal(np.asarray(forward_logits(traced, tokens)), np.asarray(forward_logits(eager, tokens)))


def _weight_shape(model: nnx.Module, path: str, name: str) -> tuple[int, ...]:
    module = model
    for part in path.split("/"):
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    return tuple(getattr(module, name).get_value().shape)


def test_explicit_regex_overrides_auto(loaded: dict[str, LoadedModel]) -> None:
    base = loaded["llama3"]
    spec = LoraSpec(rank=2, alpha=4, target_modules=r"layers/0/attn/(q_proj|v_proj)")
    applied = apply_lora(base.model, spec, base.family, seed=0)
    assert applied.module_paths == ["layers/0/attn/q_proj", "layers/0/attn/v_proj"]
    assert sorted(lora_state(applied.model)) == applied.module_paths


def test_regex_matching_nothing_names_regex_and_lists_paths(loaded: dict[str, LoadedModel]) -> None:
    base = loaded["gemma3"]
    with pytest.raises(UserError) as e:
        apply_lora(base.model, LoraSpec(target_modules=r".*self_attn\.q_proj"), base.family, seed=0)
    message = str(e.value)
    assert r".*self_attn\.q_proj" in message and "layers/0/attn/q_einsum" in message
    assert "layers/0/attn/kv_einsum/k_proj" in message


def test_regex_reaching_non_projection_is_refused(loaded: dict[str, LoadedModel]) -> None:
    """`.*` would also put LoRA on lm_head, which has no PEFT mapping here: refuse and name it."""
    base = loaded["llama3"]  # untied lm_head
    with pytest.raises(UserError, match=re.escape("(lm_head)")):
        apply_lora(base.model, LoraSpec(target_modules=".*"), base.family, seed=0)


def test_tile_size_not_dividing_is_rejected_before_qwix(loaded: dict[str, LoadedModel]) -> None:
    base = loaded["qwen3"]
    spec = LoraSpec(quantization=QuantizationSpec(weight_qtype="nf4", tile_size=32))
    with pytest.raises(UserError) as e:
        apply_lora(base.model, spec, base.family, seed=0)
    assert "layers/0/attn/o_proj" in str(e.value) and "[1, 2, 4, 8, 16]" in str(e.value)
    # Only the targeted modules count: without o_proj, 32 divides every contracting dim (64, 128).
    ok = LoraSpec(target_modules=r"layers/\d+/mlp/.*", quantization=QuantizationSpec(weight_qtype="int8", tile_size=32))
    assert len(apply_lora(base.model, ok, base.family, seed=0).module_paths) == 6


@pytest.mark.parametrize(("family", "qtype"), [("llama3", "nf4"), ("llama3", "int4"), ("qwen3", "nf4"), ("qwen2", "int4")])
def test_qlora_forward_and_one_training_step(loaded: dict[str, LoadedModel], family: str, qtype: str) -> None:
    """Qwen's Einsums cast their weight before the einsum, which a quantized weight is not: every
    Qwen QLoRA run raised TypeError at its first step (models.families.common)."""
    base = loaded[family]
    # Einsum (q, o) and Linear (down) projections; fewer modules keep Qwix's eager quantization quick.
    spec = LoraSpec(
        rank=RANK,
        alpha=ALPHA,
        target_modules=r"layers/\d+/(attn/(q_proj|o_proj)|mlp/down_proj)",
        quantization=QuantizationSpec(weight_qtype=qtype, tile_size=16),
    )
    model = apply_lora(base.model, spec, base.family, seed=0).model
    tokens = jnp.asarray(_tokens())
    positions, mask = positions_and_mask(tokens, None)

    def loss_fn(m: nnx.Module) -> jax.Array:
        logits, _ = m(tokens[:, :-1], positions[:, :-1], None, mask[:, :-1, :-1])
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()

    loss_and_grads = nnx.jit(nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam)))
    loss0, grads = loss_and_grads(model)
    assert np.isfinite(float(loss0))
    grad_b = grads["layers"][0]["attn"]["q_proj"]["w_lora_b"].get_value()
    assert float(jnp.abs(grad_b).max()) > 0
    params = nnx.state(model, nnx.LoRAParam)
    nnx.update(model, jax.tree.map(lambda p, g: p - 0.5 * g, params, grads))
    assert float(loss_and_grads(model)[0]) < float(loss0)


def test_set_lora_state_is_strict_and_all_or_nothing(loaded: dict[str, LoadedModel]) -> None:
    base = loaded["qwen2"]
    model = apply_lora(base.model, LoraSpec(rank=RANK, alpha=ALPHA), base.family, seed=0).model
    before = lora_state(model)
    good = _random_lora(before, seed=1)
    set_lora_state(model, good)
    restored = lora_state(model)
    assert all(np.array_equal(restored[p][n], good[p][n]) for p in good for n in good[p])

    rank8 = apply_lora(base.model, LoraSpec(rank=8, alpha=ALPHA), base.family, seed=0).model
    with pytest.raises(UserError, match=r"layers/0/attn/k_proj/w_lora_a: shape \[64, 8\], expected \[64, 4\]"):
        set_lora_state(model, lora_state(rank8))
    missing = {p: v for p, v in good.items() if p != "layers/1/mlp/up_proj"}
    with pytest.raises(UserError, match="layers/1/mlp/up_proj: missing from the restored adapter"):
        set_lora_state(model, missing)
    extra = {**good, "layers/7/attn/q_proj": good["layers/0/attn/q_proj"]}
    with pytest.raises(UserError, match="layers/7/attn/q_proj: in the restored adapter but not a LoRA module"):
        set_lora_state(model, extra)
    # A partially wrong tree changes nothing, even for the modules that did fit.
    bad = _random_lora(before, seed=2)
    bad["layers/1/mlp/down_proj"] = {"kernel_lora_a": np.zeros((3, 3), np.float32), **{
        "kernel_lora_b": bad["layers/1/mlp/down_proj"]["kernel_lora_b"]}}  # fmt: skip
    with pytest.raises(UserError):
        set_lora_state(model, bad)
    after = lora_state(model)
    assert all(np.array_equal(after[p][n], good[p][n]) for p in good for n in good[p])


def test_lora_params_stay_float32_on_a_bfloat16_base(loaded: dict[str, LoadedModel]) -> None:
    base = load_model(str(loaded["qwen3"].local_dir), dtype="bfloat16")
    model = apply_lora(base.model, LoraSpec(rank=2, alpha=4, target_modules=r"layers/0/attn/q_proj"), base.family,
                       seed=0).model  # fmt: skip
    assert {v.dtype for p in lora_state(model).values() for v in p.values()} == {jnp.dtype(jnp.float32)}


def test_lora_dropout_model_runs_after_apply(loaded: dict[str, LoadedModel]) -> None:
    """Qwix forgets its rngs after the dummy forward; apply_lora gives the model its own dropout stream."""
    base = loaded["llama3"]
    spec = LoraSpec(rank=RANK, alpha=ALPHA, dropout=0.5, target_modules=r"layers/0/attn/q_proj")
    model = apply_lora(base.model, spec, base.family, seed=0).model
    set_lora_state(model, _random_lora(lora_state(model), seed=3))
    tokens = _tokens()
    first, second = (np.asarray(forward_logits(model, tokens)) for _ in range(2))
    assert np.isfinite(first).all() and np.abs(first - second).max() > 0  # a fresh dropout mask per call


def test_lora_param_names_pair_and_parse_back() -> None:
    """Qwix's names as the trainer, its checkpoints and the PEFT mapping read them (Qwix's own are checked above)."""
    assert lora_names.pair("kernel") == ("kernel_lora_a", "kernel_lora_b")
    assert [lora_names.weight_of(n) for n in lora_names.pair("w")] == ["w", "w"]
    assert lora_names.weight_of("w") is None and lora_names.weight_of("_lora_a") is None
    assert lora_names.is_up("w_lora_b") and not lora_names.is_up("w_lora_a") and not lora_names.is_up("_lora_b")
