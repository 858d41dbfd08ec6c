"""Orbax -> HF, every family: an adapter trained by `run_training` and exported gives, loaded by
`peft` on the HF base, the logits the JAX model gives with the Orbax checkpoint; the merged
export loaded by `transformers` alone gives them too."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hf_side import FAMILIES, TOKENS, hf_logits
from safetensors.numpy import load_file
from training import STEPS, train_adapter
from vllm_side import load_in_vllm

from lora_trainer import cli, exit_codes
from lora_trainer.adapters.export import export_checkpoint
from lora_trainer.adapters.logits import jax_logits
from lora_trainer.adapters.merge import INDEX_FILE
from lora_trainer.adapters.peft_format import CONFIG_NAME, WEIGHTS_NAME
from lora_trainer.checkpoint import latest_committed_step
from lora_trainer.errors import UserError

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module", params=FAMILIES)
def exported(request, tiny_base, tmp_path_factory):
    """(family, base, checkpoint root, exported adapter dir, merged model dir, JAX logits with the checkpoint)."""
    family = request.param
    base = tiny_base(family)
    tmp = tmp_path_factory.mktemp(f"export-{family}")
    root = train_adapter(base, tmp)
    assert latest_committed_step(root) == STEPS
    export_checkpoint(root, str(tmp / "hf-adapter"))
    assert cli.main(["export", "--checkpoint", root, "--out", str(tmp / "merged"), "--merged"]) == exit_codes.OK
    return family, base, root, tmp / "hf-adapter", tmp / "merged", jax_logits(str(base), TOKENS, adapter=root)


def test_exported_adapter_in_peft_matches_jax(exported):
    family, base, _root, adapter, _merged, jax_with_adapter = exported
    expected = hf_logits(base, adapter_dir=adapter)
    assert np.abs(expected - hf_logits(base)).max() > 1e-2, "training must have moved the adapter away from zero"
    np.testing.assert_allclose(jax_with_adapter, expected, atol=1e-4, rtol=0, err_msg=family)


def test_exported_adapter_loads_in_vllm(exported):
    """vLLM's own loader (PEFTHelper, validate_legal, LoRAModel.from_local_checkpoint) takes every
    tensor as written, for the vLLM model class of the family's architecture."""
    family, base, _root, adapter, _merged, _ = exported
    got = load_in_vllm(adapter, base)
    assert got["ok"], (family, got)
    layers = json.loads((base / "config.json").read_text())["num_hidden_layers"]
    assert (got["modules"], got["tensors"], got["rank"], got["scaling"]) == (7 * layers, 2 * 7 * layers, 4, 2.0), got


def test_vllm_check_rejects_a_misnamed_module(tiny_base, tmp_path):
    """The check above can fail: a key vLLM's Llama has no module for is refused by vLLM itself."""
    from hf_side import make_peft_adapter
    from safetensors.numpy import save_file

    base = tiny_base("llama3")
    adapter = make_peft_adapter(base, tmp_path / "adapter")
    tensors = load_file(str(adapter / WEIGHTS_NAME))
    save_file({k.replace("q_proj", "qq_proj"): v for k, v in tensors.items()}, str(adapter / WEIGHTS_NAME))
    got = load_in_vllm(adapter, base)
    assert not got["ok"] and "qq_proj" in got["error"], got


def test_merged_model_alone_matches(exported):
    family, base, _root, adapter, merged, jax_with_adapter = exported
    assert (merged / INDEX_FILE).is_file() and (merged / "tokenizer.json").is_file()
    got = hf_logits(merged)
    np.testing.assert_allclose(got, hf_logits(base, adapter_dir=adapter), atol=1e-4, rtol=0, err_msg=family)
    np.testing.assert_allclose(got, jax_with_adapter, atol=1e-4, rtol=0, err_msg=family)


def test_config_comes_from_the_checkpoint(exported):
    family, base, _root, adapter, _merged, _ = exported
    cfg = json.loads((adapter / CONFIG_NAME).read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM"
    assert (cfg["r"], cfg["lora_alpha"], cfg["lora_dropout"]) == (4, 8, 0.0)
    assert (cfg["bias"], cfg["fan_in_fan_out"], cfg["use_rslora"]) == ("none", False, False)
    assert cfg["base_model_name_or_path"] == str(base)
    assert sorted(cfg["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def test_an_earlier_step_exports_on_request(exported, tmp_path):
    _family, _base, root, adapter, _merged, _ = exported
    export_checkpoint(root, str(tmp_path / "step1"), step=1)
    first, last = load_file(str(tmp_path / "step1" / WEIGHTS_NAME)), load_file(str(adapter / WEIGHTS_NAME))
    assert sorted(first) == sorted(last)
    assert any(not np.array_equal(first[k], last[k]) for k in first)
    with pytest.raises(UserError, match="step 99 is not a committed checkpoint"):
        export_checkpoint(root, str(tmp_path / "step99"), step=99)
    assert not (tmp_path / "step99").exists()
