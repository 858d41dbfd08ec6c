"""Gemma 3 4B-27B ship as a multimodal model (`Gemma3ForConditionalGeneration`): the trainer trains
its text decoder. Proven end to end on a tiny model of that layout against `transformers` + `peft`:
the decoder's logits, a trained adapter exported for PEFT (and merged), a PEFT adapter imported;
and the released checkpoints' sparse `text_config` is read as transformers reads it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hf_side import TOKENS, hf_logits, make_peft_adapter
from safetensors import safe_open
from training import train_adapter
from vllm_side import load_in_vllm

from lora_trainer.adapters.convert import convert
from lora_trainer.adapters.export import export_checkpoint
from lora_trainer.adapters.logits import jax_logits
from lora_trainer.adapters.merge import INDEX_FILE
from lora_trainer.adapters.peft_format import CONFIG_NAME
from lora_trainer.checkpoint import read_lora
from lora_trainer.models import get_family
from lora_trainer.models.families.gemma3 import TEXT_DEFAULTS
from lora_trainer.models.loading import build_abstract
from lora_trainer.tiny_models import make_tiny_hf_model

KIND = "gemma3-multimodal"
#: The decoder's projections, as PEFT should see them: inside `model.language_model`, never the vision tower.
DECODER_PROJECTIONS = r"model\.language_model\..*\.(down_proj|gate_proj|k_proj|o_proj|q_proj|up_proj|v_proj)"

#: google/gemma-3-4b-it's config.json as released (transformers 4.50): the decoder's config is sparse.
GEMMA3_4B_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_tiny_hf_model(KIND, tmp_path_factory.mktemp("gemma3-mm") / "base", seed=4)


@pytest.fixture(scope="module")
def trained(base, tmp_path_factory) -> str:
    """The checkpoint root of a rank-4 adapter trained on the multimodal base."""
    return train_adapter(base, tmp_path_factory.mktemp("gemma3-mm-train"))


def test_checkpoint_stores_the_decoder_under_its_legacy_names(base):
    with safe_open(str(base / "model.safetensors"), "np") as f:
        keys = set(f.keys())
    assert "language_model.model.layers.0.self_attn.q_proj.weight" in keys
    assert any(k.startswith("vision_tower.") for k in keys)


def test_decoder_logits_match_transformers(base):
    np.testing.assert_allclose(jax_logits(str(base), TOKENS), hf_logits(base), atol=1e-4, rtol=0)


def test_trained_adapter_loads_in_peft_on_the_multimodal_model(base, trained, tmp_path):
    _, meta = read_lora(trained)
    assert meta["family"] == "gemma3" and meta["multimodal"] is True
    export_checkpoint(trained, str(tmp_path / "adapter"))
    cfg = json.loads((tmp_path / "adapter" / CONFIG_NAME).read_text())
    assert cfg["target_modules"] == DECODER_PROJECTIONS
    expected = jax_logits(str(base), TOKENS, adapter=trained)
    assert np.abs(expected - hf_logits(base)).max() > 1e-2, "training must have moved the adapter away from zero"
    np.testing.assert_allclose(hf_logits(base, adapter_dir=tmp_path / "adapter"), expected, atol=1e-4, rtol=0)


def test_trained_adapter_loads_in_vllm(base, trained, tmp_path):
    """vLLM's Gemma3ForConditionalGeneration maps the adapter's `model.language_model.` keys onto its
    decoder and takes every tensor as written."""
    export_checkpoint(trained, str(tmp_path / "adapter"))
    got = load_in_vllm(tmp_path / "adapter", base)
    assert got["ok"] and (got["modules"], got["tensors"]) == (2 * 7, 2 * 2 * 7), got


def test_peft_wraps_no_vision_module(base, trained, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    export_checkpoint(trained, str(tmp_path / "adapter"))
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32), str(tmp_path / "adapter"))
    wrapped = {name.rsplit(".lora_A", 1)[0] for name, _ in model.named_modules() if name.endswith(".lora_A")}
    assert len(wrapped) == 2 * 7 and all(".language_model.layers." in name for name in wrapped)


def test_merged_export_is_the_whole_multimodal_model(base, trained, tmp_path):
    out = tmp_path / "merged"
    export_checkpoint(trained, str(out), merged=True)
    index = json.loads((out / INDEX_FILE).read_text())["weight_map"]
    assert any(k.startswith("vision_tower.") for k in index), "the vision tower must be carried over"
    assert json.loads((out / "config.json").read_text())["model_type"] == "gemma3"
    np.testing.assert_allclose(hf_logits(out), jax_logits(str(base), TOKENS, adapter=trained), atol=1e-4, rtol=0)


def test_peft_adapter_of_the_multimodal_model_imports(base, tmp_path):
    adapter = make_peft_adapter(base, tmp_path / "peft", targets=DECODER_PROJECTIONS, seed=7)
    convert("hf-peft", "orbax", str(adapter), str(tmp_path / "orbax"), base=str(base))
    tree, meta = read_lora(str(tmp_path / "orbax"))
    assert meta["multimodal"] is True and len(tree) == 2 * 7
    expected = hf_logits(base, adapter_dir=adapter)
    np.testing.assert_allclose(jax_logits(str(base), TOKENS, adapter=str(tmp_path / "orbax")), expected, atol=1e-4, rtol=0)
    convert("orbax", "hf-peft", str(tmp_path / "orbax"), str(tmp_path / "back"), base=str(base))
    np.testing.assert_allclose(hf_logits(base, adapter_dir=tmp_path / "back"), expected, atol=1e-5, rtol=0)

    # The same adapter as transformers 4.50-4.51 saved it, its keys under `language_model.model.`.
    from safetensors.numpy import load_file, save_file

    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / CONFIG_NAME).write_text((adapter / CONFIG_NAME).read_text())
    tensors = load_file(adapter / "adapter_model.safetensors")
    save_file({k.replace(".model.language_model.", ".language_model.model."): v for k, v in tensors.items()},
              legacy / "adapter_model.safetensors")
    convert("hf-peft", "orbax", str(legacy), str(tmp_path / "legacy-orbax"), base=str(base))
    legacy_tree, _ = read_lora(str(tmp_path / "legacy-orbax"))
    assert sorted(legacy_tree) == sorted(tree)
    assert all(np.array_equal(legacy_tree[m][n], tree[m][n]) for m in tree for n in tree[m])


def test_released_sparse_config_reads_as_transformers_reads_it():
    from lora_trainer.models.families.gemma3 import model as gemma3_model

    spec, text = get_family("gemma3").for_checkpoint(GEMMA3_4B_CONFIG)
    assert spec.multimodal and spec.hf_module_name("layers/33/mlp/up_proj") == "model.language_model.layers.33.mlp.up_proj"
    assert spec.weights[0].hf == "language_model.model.embed_tokens.weight"
    cfg = gemma3_model.tunix_config(text)
    assert (cfg.num_layers, cfg.embed_dim, cfg.hidden_dim, cfg.num_embed) == (34, 2560, 10240, 262_208)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window_size) == (8, 4, 256, 1024)
    assert gemma3_model.layer_types(text) == (["sliding_attention"] * 5 + ["full_attention"]) * 5 + ["sliding_attention"] * 4
    ropes = gemma3_model.rope_specs(text)
    assert (ropes["full_attention"].theta, ropes["full_attention"].factor) == (1_000_000.0, 8.0)
    assert (ropes["sliding_attention"].theta, ropes["sliding_attention"].factor) == (10_000.0, 1.0)
    shapes = build_abstract(spec, text, "bfloat16")  # the whole 4B decoder, shapes only
    assert shapes.layers[0].mlp.up_proj.kernel.get_value().shape == (2560, 10240)


def test_text_defaults_are_transformers_own():
    from transformers import Gemma3TextConfig

    hf = Gemma3TextConfig().to_dict()
    rope = {"rope_theta", "rope_local_base_freq", "rope_scaling", "sliding_window_pattern"}  # 4.x names, checked below
    for key, value in TEXT_DEFAULTS.items():
        if key not in rope:
            assert hf[key] == value, key
    params = hf["rope_parameters"]
    assert params["full_attention"] == {"rope_type": "default", "rope_theta": TEXT_DEFAULTS["rope_theta"]}
    assert params["sliding_attention"] == {"rope_type": "default", "rope_theta": TEXT_DEFAULTS["rope_local_base_freq"]}
    pattern = TEXT_DEFAULTS["sliding_window_pattern"]
    assert hf["layer_types"][pattern - 1] == "full_attention" and hf["layer_types"][: pattern - 1] == ["sliding_attention"] * (pattern - 1)


def test_decoder_stored_under_its_module_names_loads_too(base, tmp_path):
    """Checkpoints saved by transformers 4.52-4.x store the decoder as `model.language_model.*`."""
    import shutil

    from safetensors.numpy import load_file, save_file

    moved = tmp_path / "moved"
    shutil.copytree(base, moved)
    tensors = load_file(str(base / "model.safetensors"))
    renamed = {("model.language_model." + k[len("language_model.model.") :] if k.startswith("language_model.model.") else k): v for k, v in tensors.items()}
    assert renamed.keys() != tensors.keys()
    save_file(renamed, str(moved / "model.safetensors"), metadata={"format": "pt"})
    np.testing.assert_allclose(jax_logits(str(moved), TOKENS), jax_logits(str(base), TOKENS), atol=0, rtol=0)
