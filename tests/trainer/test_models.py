"""Model families against HF transformers (CPU torch), weight loading and its errors.

Every family's tiny model has the family's real quirks (GQA, theta, Llama 3.1 rope
scaling, Qwen3 qk-norm, Qwen2 biases, Gemma 3 layer pattern and sliding window) and random
weights everywhere, so a layout or rope mistake shows up as a large logit difference.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from lora_trainer.errors import UserError
from lora_trainer.models import FAMILIES, detect_family, forward_logits, get_family, load_model
from lora_trainer.models.loading import build_abstract, fill_params
from lora_trainer.models.rope import RopeSpec, hf_rope
from lora_trainer.models.safetensors_io import SafetensorsCheckpoint
from lora_trainer.tiny_models import make_tiny_hf_model

TOL = 1e-4
SEQ = 24  # longer than Gemma's tiny sliding window (4) and Llama's tiny original context (32 / 4)

#: name -> (family, config overrides): each family as shipped, plus variants that exercise
#: config.json settings Tunix ignores or hard-codes.
VARIANTS = {
    "llama3.1": ("llama3", {}),
    "llama3.2-tied": (
        "llama3",
        {
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "qwen3": ("qwen3", {}),
    # Qwen3 8B-like: untied; heads * head_dim (128) != hidden (64) as in Qwen3 0.6B; another theta.
    "qwen3-theta5e6-untied": ("qwen3", {"rope_theta": 5_000_000.0, "tie_word_embeddings": False, "head_dim": 32}),
    "qwen2": ("qwen2", {}),
    "gemma3": ("gemma3", {}),
    # Gemma 3 1B: one KV head (Tunix's non-GQA einsum path).
    "gemma3-mqa": ("gemma3", {"num_key_value_heads": 1}),
    # Gemma 3 27B-like: query_pre_attn_scalar = hidden / heads != head_dim; MHA (Tunix fuses Q/K/V).
    "gemma3-mha-27b-scaling": ("gemma3", {"num_key_value_heads": 4, "head_dim": 32, "query_pre_attn_scalar": 16}),
}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: make_tiny_hf_model(family, tmp_path_factory.mktemp(name), seed=i, **overrides)
        for i, (name, (family, overrides)) in enumerate(VARIANTS.items())
    }


def _tokens(batch: int = 2, seq: int = SEQ, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 272, (batch, seq)).astype(np.int32)


def hf_logits(directory: Path, tokens: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
    """transformers' logits; with a mask, positions count real tokens only (as in generation)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    kwargs = {}
    if attention_mask is not None:
        kwargs["attention_mask"] = torch.tensor(attention_mask)
        kwargs["position_ids"] = torch.tensor(np.maximum(np.cumsum(attention_mask, axis=-1) - 1, 0))
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long), **kwargs).logits.numpy()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers(tiny_dirs: dict[str, Path], name: str) -> None:
    directory = tiny_dirs[name]
    loaded = load_model(str(directory))
    assert loaded.family.name == VARIANTS[name][0]
    tokens = _tokens(batch=3)
    mask = np.ones_like(tokens)
    mask[1, 17:] = 0  # right padding
    mask[2, :5] = 0  # left padding
    ours = np.asarray(forward_logits(loaded.model, tokens, attention_mask=mask))
    theirs = hf_logits(directory, tokens, mask)
    assert ours.shape == (3, SEQ, 272) and ours.dtype == np.float32
    valid = mask.astype(bool)
    assert np.abs(ours[valid] - theirs[valid]).max() < TOL
    assert np.abs(theirs).max() > 1.0  # the comparison is not between two near-zero tensors


def _plain_tunix_model(name: str, directory: Path):
    """The same weights in the model Tunix would build on its own (its rope / layer pattern)."""
    family = get_family(VARIANTS[name][0])
    hf_config = json.loads((directory / "config.json").read_text())
    if family.name == "llama3":
        from tunix.models.llama3 import model as m

        from lora_trainer.models.families.llama3.model import tunix_config

        plain = lambda cfg, dtype, rngs: m.Llama3(tunix_config(cfg), rngs=rngs)  # noqa: E731
    elif family.name == "qwen3":
        from tunix.models.qwen3 import model as m

        from lora_trainer.models.families.qwen3.model import tunix_config

        plain = lambda cfg, dtype, rngs: m.Qwen3(tunix_config(cfg), rngs=rngs)  # noqa: E731
    else:
        from lora_trainer.models.families.gemma3 import model as gemma3

        def plain(cfg, dtype, rngs):  # Tunix's own cycled 5:1 pattern, K/V split kept for the weight table
            model = gemma3.build(cfg, dtype, rngs)
            for layer in model.layers:
                layer.attn.attn_type = gemma3.LOCAL
                layer.attn.rope_base_frequency = gemma3.rope_specs(cfg)["sliding_attention"].theta
                layer.attn.rope_scale_factor = 1.0
            return model

    spec = dataclasses.replace(family, build=plain)
    abstract = build_abstract(spec, hf_config, "float32")
    return fill_params(abstract, spec, hf_config, SafetensorsCheckpoint(directory), dtype="float32")


@pytest.mark.parametrize("name", ["llama3.1", "qwen3-theta5e6-untied", "gemma3"])
def test_plain_tunix_would_diverge(tiny_dirs: dict[str, Path], name: str) -> None:
    """The traps are real on these shapes: without our fixes the logits are far from HF's."""
    directory = tiny_dirs[name]
    tokens = _tokens()
    plain = np.asarray(forward_logits(_plain_tunix_model(name, directory), tokens))
    assert np.abs(plain - hf_logits(directory, tokens)).max() > 1e-2


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
        {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        {"rope_type": "default", "rope_theta": 10000.0},
    ],
)  # fmt: skip
def test_inv_freq_matches_transformers(params: dict) -> None:
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, head_dim=128, max_position_embeddings=131072,
                         rope_parameters=dict(params))  # fmt: skip
    if params["rope_type"] == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        theirs, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config, torch.device("cpu"))
    else:
        theirs, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, torch.device("cpu"))
    ours = hf_rope({"rope_parameters": params}).inv_freq(128)
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6)


def test_rope_tables_are_computed_once_per_position() -> None:
    """sin/cos are computed per position, not once per head inside the rotation's loop (XLA:CPU
    fuses them there unless they are materialised: ~2x the rope's time on the benchmark model),
    and the rotation still equals transformers' `q * cos + rotate_half(q) * sin`, also when it is
    computed in attention's grouped layout."""
    import re

    import jax
    import jax.numpy as jnp

    from lora_trainer.models.rope import rotate

    b, t, n, h = 2, 16, 4, 8
    inv_freq = RopeSpec(10000.0).inv_freq(h)
    x = jax.random.normal(jax.random.PRNGKey(0), (b, t, n, h))
    positions = jnp.tile(jnp.arange(t)[None], (b, 1)) + jnp.arange(b)[:, None]
    hlo = jax.jit(lambda x, p: rotate(x, p, inv_freq)).lower(x, positions).compile().as_text()
    # Every sine and cosine instruction, wherever XLA put it (a fusion or the entry computation).
    trig = re.findall(r"= \w+\[([\d,]*)\]\S* (?:sine|cosine)\(", hlo)
    assert trig, "no sine/cosine in the compiled rotation"
    for dims in trig:
        assert np.prod([int(d) for d in dims.split(",")]) <= b * t * h, f"sin/cos recomputed per head: [{dims}]"
    angles = np.asarray(positions, np.float64)[..., None] * inv_freq
    cos, sin = (np.concatenate([f(angles)] * 2, -1)[:, :, None, :] for f in (np.cos, np.sin))
    xn = np.asarray(x, np.float64)
    want = xn * cos + np.concatenate([-xn[..., h // 2 :], xn[..., : h // 2]], -1) * sin
    np.testing.assert_allclose(np.asarray(rotate(x, positions, inv_freq)), want, atol=1e-5)
    # Grouped per kv head (attention's layout on CPU, with its own backward): the same values and
    # gradients, up to float32 rounding (XLA fuses the products differently).
    cot = jax.random.normal(jax.random.PRNGKey(1), x.shape)
    for kv_heads in (1, 2, 4):
        grouped = jax.jit(lambda x, p, kv=kv_heads: rotate(x, p, inv_freq, kv))
        np.testing.assert_allclose(np.asarray(grouped(x, positions)), np.asarray(rotate(x, positions, inv_freq)), atol=1e-6)
        grad = jax.grad(lambda x, f: jnp.vdot(f(x), cot))
        np.testing.assert_allclose(
            np.asarray(grad(x, lambda x: grouped(x, positions))),
            np.asarray(grad(x, lambda x: rotate(x, positions, inv_freq))),
            atol=1e-6,
        )


def test_legacy_rope_fields_are_read() -> None:
    """transformers 4.x configs (rope_theta + rope_scaling with `type`) give the same spec."""
    legacy = {"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}  # fmt: skip
    assert hf_rope(legacy) == RopeSpec(500000.0, "llama3", 8.0, 1.0, 4.0, 8192)
    with pytest.raises(UserError, match="yarn"):
        hf_rope({"rope_theta": 1e6, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_gemma3_layer_pattern_from_config(tiny_dirs: dict[str, Path]) -> None:
    from lora_trainer.models.families.gemma3 import model as gemma3

    model = load_model(str(tiny_dirs["gemma3"])).model
    attns = [layer.attn for layer in model.layers]
    assert [a.attn_type for a in attns] == [gemma3.LOCAL, gemma3.GLOBAL]
    assert [(a.rope_base_frequency, a.rope_scale_factor) for a in attns] == [(10000.0, 1.0), (1000000.0, 8.0)]
    assert gemma3.layer_types({"num_hidden_layers": 7, "sliding_window_pattern": 6}) == ["sliding_attention"] * 5 + [
        "full_attention",
        "sliding_attention",
    ]


@pytest.mark.parametrize(
    ("config", "family"),
    [
        ({"model_type": "llama"}, "llama3"),
        ({"model_type": "qwen3"}, "qwen3"),
        ({"model_type": "qwen2"}, "qwen2"),
        ({"model_type": "gemma3_text"}, "gemma3"),
        ({"architectures": ["LlamaForCausalLM"]}, "llama3"),
    ],
)
def test_detect_family(config: dict, family: str) -> None:
    assert detect_family(config) == family


def test_unknown_family_names_model_type_and_supported() -> None:
    with pytest.raises(UserError) as e:
        detect_family({"model_type": "mistral", "architectures": ["MistralForCausalLM"]})
    assert "mistral" in str(e.value) and all(f in str(e.value) for f in FAMILIES)


def test_module_paths_and_hf_names_round_trip() -> None:
    for name in FAMILIES:
        family = get_family(name)
        paths = family.module_paths({"num_hidden_layers": 2})
        assert len(paths) == 14 and all(family.nnx_module_path(family.hf_module_name(p)) == p for p in paths)
    assert get_family("llama3").hf_module_name("layers/1/attn/o_proj") == "model.layers.1.self_attn.o_proj"
    assert get_family("gemma3").hf_module_name("layers/0/attn/kv_einsum/v_proj") == "model.layers.0.self_attn.v_proj"


def test_sharded_checkpoint_loads_like_single_file(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    sharded = make_tiny_hf_model("llama3", tmp_path / "sharded", seed=0, sharded=True)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    tokens = _tokens()
    a = forward_logits(load_model(str(sharded)).model, tokens)
    b = forward_logits(load_model(str(tiny_dirs["llama3.1"])).model, tokens)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_load(tiny_dirs: dict[str, Path]) -> None:
    import jax.numpy as jnp

    loaded = load_model(str(tiny_dirs["qwen3"]), dtype="bfloat16")
    assert loaded.model.layers[0].attn.q_proj.w.get_value().dtype == jnp.bfloat16
    tokens = _tokens()
    bf16 = np.asarray(forward_logits(loaded.model, tokens))
    fp32 = np.asarray(forward_logits(load_model(str(tiny_dirs["qwen3"])).model, tokens))
    assert np.abs(bf16 - fp32).max() < 0.5


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_without(directory: Path, key: str) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    del tensors[key]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def test_bad_checkpoints_name_the_file_or_key(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    good = tiny_dirs["llama3.1"]
    with pytest.raises(UserError, match="is not a directory"):
        load_model(str(tmp_path / "nowhere"))

    no_config = _copy(good, tmp_path / "no-config")
    (no_config / "config.json").unlink()
    with pytest.raises(UserError, match="config.json is missing"):
        load_model(str(no_config))

    no_weights = _copy(good, tmp_path / "no-weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(UserError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_model(str(no_weights))

    truncated = _copy(good, tmp_path / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match=r"model.safetensors is truncated: tensor '.*'"):
        load_model(str(truncated))

    garbage = _copy(good, tmp_path / "garbage")
    (garbage / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(UserError, match="corrupt safetensors header"):
        load_model(str(garbage))

    missing = _copy(good, tmp_path / "missing-tensor")
    _rewrite_without(missing, "model.layers.1.mlp.up_proj.weight")
    with pytest.raises(UserError, match=r"'model.layers.1.mlp.up_proj.weight' is missing"):
        load_model(str(missing))

    mismatch = _copy(good, tmp_path / "mismatch")
    cfg = json.loads((mismatch / "config.json").read_text())
    (mismatch / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    with pytest.raises(UserError, match=r"'model.layers.0.mlp.gate_proj.weight' .* shape \[128, 64\] .* \[96, 64\]"):
        load_model(str(mismatch))

    with pytest.raises(UserError, match="model.family is 'qwen3' but .* describes a llama3 model"):
        load_model(str(good), family="qwen3")
    # A derivative's config.json with a model_type of its own: detection fails, a given family is trusted.
    derivative = _copy(good, tmp_path / "derivative")
    (derivative / "config.json").write_text(json.dumps({**{k: v for k, v in cfg.items() if k != "architectures"},
                                                        "model_type": "my_llama"}))
    with pytest.raises(UserError, match="model_type 'my_llama'.*not a supported family"):
        load_model(str(derivative))
    assert load_model(str(derivative), family="llama3").family.name == "llama3"

    incomplete = _copy(good, tmp_path / "incomplete")
    (incomplete / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "intermediate_size"}))
    with pytest.raises(UserError, match="config.json has no 'intermediate_size'"):
        load_model(str(incomplete))

    unsupported = _copy(good, tmp_path / "unsupported")
    (unsupported / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu"}))
    with pytest.raises(UserError, match="hidden_act='gelu' is not supported for family llama3"):
        load_model(str(unsupported))

    # Well-formed JSON of the wrong shape, and text that is not UTF-8.
    wrong_type = _copy(good, tmp_path / "wrong-type")
    (wrong_type / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": "two"}))
    with pytest.raises(UserError, match="config.json does not describe a llama3 model"):
        load_model(str(wrong_type))
    latin1 = _copy(good, tmp_path / "latin1")
    (latin1 / "config.json").write_bytes(b'{"model_type": "caf\xe9"}')
    with pytest.raises(UserError, match="config.json is not valid JSON"):
        load_model(str(latin1))
    for name, header in (("list", b"[1, 2]"), ("no-offsets", b'{"w": {"dtype": "F32", "shape": [1]}}')):
        bad = _copy(good, tmp_path / f"header-{name}")
        (bad / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
        with pytest.raises(UserError, match="corrupt safetensors header"):
            load_model(str(bad))
    for name, index in (("list", "[1]"), ("map-list", '{"weight_map": ["model.safetensors"]}')):
        sharded = _copy(good, tmp_path / f"index-{name}")
        (sharded / "model.safetensors.index.json").write_text(index)
        with pytest.raises(UserError, match="is not a valid safetensors index"):
            load_model(str(sharded))


def test_loads_from_a_hub_uri(tiny_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`hf://ORG/NAME` goes through huggingface_hub (offline here: its cache holds the repo)."""
    from hf_cache import publish_to_hub_cache

    monkeypatch.setenv("LORA_TRAINER_MODEL_CACHE", str(tmp_path / "models"))
    uri = publish_to_hub_cache(tiny_dirs["qwen2"], "acme/tiny-qwen2")
    loaded = load_model(uri)
    assert loaded.family.name == "qwen2"
    tokens = _tokens()
    np.testing.assert_array_equal(
        np.asarray(forward_logits(loaded.model, tokens)),
        np.asarray(forward_logits(load_model(str(tiny_dirs["qwen2"])).model, tokens)),
    )


def test_loads_from_gcs(gcs_bucket: str, tiny_dirs: dict[str, Path]) -> None:
    from lora_trainer import storage

    uri = f"gs://{gcs_bucket}/test_models/tiny-qwen2"
    storage.upload_dir(tiny_dirs["qwen2"], uri)
    loaded = load_model(uri)
    assert (loaded.local_dir / "tokenizer.json").is_file()
    tokens = _tokens()
    np.testing.assert_array_equal(
        np.asarray(forward_logits(loaded.model, tokens)),
        np.asarray(forward_logits(load_model(str(tiny_dirs["qwen2"])).model, tokens)),
    )
    with pytest.raises(UserError):
        load_model(f"gs://{gcs_bucket}/test_models/absent")


_MESH_SCRIPT = textwrap.dedent(
    """
    import sys, numpy as np, jax
    jax.config.update("jax_num_cpu_devices", 2)
    from lora_trainer.models import forward_logits, load_model
    mesh = jax.make_mesh((2, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sharded = load_model(sys.argv[1], mesh=mesh).model
    w = sharded.layers[0].attn.q_proj.w.get_value()
    assert w.sharding.spec[0] == "fsdp" and len(w.addressable_shards) == 2, w.sharding
    assert w.addressable_shards[0].data.shape == (32, 4, 16), w.addressable_shards[0].data.shape
    tokens = np.random.default_rng(0).integers(3, 272, (2, 16)).astype(np.int32)
    with jax.set_mesh(mesh):
        a = np.asarray(forward_logits(sharded, tokens))
    b = np.asarray(forward_logits(load_model(sys.argv[1]).model, tokens))
    assert np.abs(a - b).max() < 1e-5, np.abs(a - b).max()
    from lora_trainer.config import LoraSpec
    from lora_trainer.lora import apply_lora
    from lora_trainer.models import get_family
    lora = apply_lora(sharded, LoraSpec(rank=4, alpha=8), get_family("llama3"), seed=0).model
    a_q = lora.layers[0].attn.q_proj.w_lora_a.get_value()
    assert a_q.sharding.spec[0] == "fsdp" and len(a_q.addressable_shards) == 2, a_q.sharding
    from lora_trainer.lora import lora_state
    zeros = lora_state(apply_lora(sharded, LoraSpec(rank=4, alpha=8), get_family("llama3"), seed=0, structure_only=True).model)
    for path, params in lora_state(lora).items():  # a resume's LoRA lies where a fresh run's does
        for name, value in params.items():
            assert zeros[path][name].sharding == value.sharding, (path, name, zeros[path][name].sharding, value.sharding)
    with jax.set_mesh(mesh):
        c = np.asarray(forward_logits(lora, tokens))
    assert np.abs(c - b).max() < 1e-5, np.abs(c - b).max()
    print("ok")
    """
)


@pytest.mark.slow
def test_load_onto_a_two_device_mesh(tiny_dirs: dict[str, Path]) -> None:
    """Weights and LoRA params land as NamedShardings over the mesh (own process: the CPU device count is
    fixed when JAX starts)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", _MESH_SCRIPT, str(tiny_dirs["llama3.1"])],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_sources_and_tokens_are_checked(tiny_dirs: dict[str, Path]) -> None:
    loaded = load_model(f"file://{tiny_dirs['qwen2']}")
    with pytest.raises(UserError, match=r"token ids must be in \[0, 271\]"):
        forward_logits(loaded.model, np.array([[1, 272]], dtype=np.int32))
    with pytest.raises(UserError, match="non-empty"):
        forward_logits(loaded.model, np.array([1, 2], dtype=np.int32))
