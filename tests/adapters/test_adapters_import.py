"""HF PEFT -> Orbax, every family: an adapter made by `peft` gives the same logits on the JAX side,
and converting back gives the same bytes."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hf_side import FAMILIES, TOKENS, hf_logits, make_peft_adapter
from safetensors.numpy import load_file

from lora_trainer import cli, exit_codes
from lora_trainer.adapters.convert import convert
from lora_trainer.adapters.logits import jax_logits
from lora_trainer.adapters.peft_format import CONFIG_NAME, WEIGHTS_NAME
from lora_trainer.checkpoint import LAYER, read_lora, read_metadata

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=FAMILIES)
def imported(request, tiny_base, tmp_path_factory):
    """(family, base dir, PEFT adapter dir made by peft, Orbax checkpoint converted from it)."""
    family = request.param
    base = tiny_base(family)
    tmp = tmp_path_factory.mktemp(f"import-{family}")
    # Qwen2.5 adapters are often rsLoRA: prove the alpha / sqrt(r) scale is folded exactly.
    adapter = make_peft_adapter(base, tmp / "peft", rank=4, alpha=8.0, use_rslora=family == "qwen2", seed=1)
    orbax = tmp / "orbax"
    convert("hf-peft", "orbax", str(adapter), str(orbax), base=str(base))
    return family, base, adapter, orbax


def test_imported_adapter_gives_hf_peft_logits(imported):
    family, base, adapter, orbax = imported
    expected = hf_logits(base, adapter_dir=adapter)
    assert np.abs(expected - hf_logits(base)).max() > 1e-1, "the adapter must change the model for the test to mean anything"
    got = jax_logits(str(base), TOKENS, adapter=str(orbax))
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0, err_msg=family)


def test_checkpoint_records_what_the_adapter_is(imported):
    family, base, adapter, orbax = imported
    tree, meta = read_lora(str(orbax))
    raw = json.loads((adapter / CONFIG_NAME).read_text())
    assert meta["family"] == family and meta["baseModel"] == str(base) and meta["rank"] == 4
    expected_scale = 8.0 / (math.sqrt(4) if raw["use_rslora"] else 4)
    assert meta["alpha"] / meta["rank"] == pytest.approx(expected_scale, rel=1e-12)
    assert meta["modulePaths"] == sorted(tree) and len(tree) == 2 * 7  # 2 layers x 7 projections
    # Stored as one stacked array per projection and parameter (both layers share shapes).
    stacked = read_metadata(str(orbax))["loraLayout"]["stacked"]
    assert len(stacked) == 7 and all(layers == [0, 1] for layers in stacked.values())
    assert {t.replace(LAYER, str(i)) for t in stacked for i in (0, 1)} == set(tree)


def test_round_trip_is_bitwise(imported, tmp_path):
    family, base, adapter, orbax = imported
    back = tmp_path / "back"
    convert("orbax", "hf-peft", str(orbax), str(back), base=str(base))
    original, again = load_file(str(adapter / WEIGHTS_NAME)), load_file(str(back / WEIGHTS_NAME))
    assert sorted(original) == sorted(again)
    for key, arr in original.items():
        assert again[key].dtype == arr.dtype and np.array_equal(again[key], arr), key
    a, b = json.loads((adapter / CONFIG_NAME).read_text()), json.loads((back / CONFIG_NAME).read_text())
    assert (b["peft_type"], b["task_type"], b["r"], b["bias"], b["use_rslora"]) == ("LORA", "CAUSAL_LM", a["r"], "none", False)
    assert sorted(b["target_modules"]) == sorted(a["target_modules"])
    scale_a = a["lora_alpha"] / (math.sqrt(a["r"]) if a["use_rslora"] else a["r"])
    assert b["lora_alpha"] / b["r"] == pytest.approx(scale_a, rel=1e-12)
    assert b["base_model_name_or_path"] == str(base)



def test_logits_tool_reads_a_peft_adapter_directly(tiny_base, tmp_path):
    """Format detection is family-independent, so one family keeps the suite short."""
    base = tiny_base("llama3")
    adapter = make_peft_adapter(base, tmp_path / "peft", seed=2)
    convert("hf-peft", "orbax", str(adapter), str(tmp_path / "orbax"), base=str(base))
    direct = jax_logits(str(base), TOKENS, adapter=str(adapter))
    np.testing.assert_array_equal(direct, jax_logits(str(base), TOKENS, adapter=str(tmp_path / "orbax")))
    np.testing.assert_allclose(direct, hf_logits(base, adapter_dir=adapter), atol=1e-4, rtol=0)


def test_logits_tool_refuses_bad_tokens_and_a_directory_as_out(tiny_base, tmp_path, capsys):
    base = str(tiny_base("llama3"))
    assert cli.main(["logits", "--base", base, "--tokens", "a,b", "--out", str(tmp_path / "l.npy")]) == exit_codes.USER_ERROR
    assert "comma-separated integers" in capsys.readouterr().err
    (tmp_path / "out").mkdir()
    assert cli.main(["logits", "--base", base, "--tokens", "1,2", "--out", str(tmp_path / "out")]) == exit_codes.USER_ERROR
    assert "is a directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary file left beside it


def test_an_adapter_on_some_layers_exports_a_config_naming_only_its_modules(tiny_base, tmp_path):
    """Short names in `target_modules` would make PEFT wrap every layer (and train the extra ones)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from vllm_side import load_in_vllm

    base = tiny_base("llama3")
    adapter = make_peft_adapter(base, tmp_path / "peft", targets=r"model\.layers\.1\.(self_attn\.q_proj|mlp\.down_proj)", seed=4)
    convert("hf-peft", "orbax", str(adapter), str(tmp_path / "orbax"), base=str(base))
    assert read_metadata(str(tmp_path / "orbax"))["numLayers"] == 2
    convert("orbax", "hf-peft", str(tmp_path / "orbax"), str(tmp_path / "back"), base=str(base))
    targets = json.loads((tmp_path / "back" / CONFIG_NAME).read_text())["target_modules"]
    assert targets == r"(model\.layers\.1\.mlp\.down_proj|model\.layers\.1\.self_attn\.q_proj)"
    wrapped = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(tmp_path / "back"))
    assert sorted(n.removesuffix(".lora_A") for n, _ in wrapped.named_modules() if n.endswith(".lora_A")) == [
        "base_model.model.model.layers.1.mlp.down_proj", "base_model.model.model.layers.1.self_attn.q_proj",
    ]  # fmt: skip
    np.testing.assert_allclose(hf_logits(base, adapter_dir=tmp_path / "back"), hf_logits(base, adapter_dir=adapter), atol=1e-5, rtol=0)
    got = load_in_vllm(tmp_path / "back", base)
    assert got["ok"] and (got["modules"], got["tensors"]) == (2, 4), got
