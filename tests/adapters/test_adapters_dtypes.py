"""Adapters saved from a bf16 model keep their dtype and bits through Orbax and back."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from hf_side import make_peft_adapter
from safetensors.numpy import load_file, save_file

from lora_trainer.adapters.convert import convert
from lora_trainer.adapters.peft_format import WEIGHTS_NAME


def test_bfloat16_adapter_round_trips_bitwise(tiny_base, tmp_path):
    base = tiny_base("llama3")
    adapter = make_peft_adapter(base, tmp_path / "peft", targets=["k_proj", "up_proj"])
    weights = adapter / WEIGHTS_NAME
    save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in load_file(str(weights)).items()}, str(weights), metadata={"format": "pt"})
    convert("hf-peft", "orbax", str(adapter), str(tmp_path / "orbax"), base=str(base))
    convert("orbax", "hf-peft", str(tmp_path / "orbax"), str(tmp_path / "back"), base=str(base))
    original, again = load_file(str(weights)), load_file(str(tmp_path / "back" / WEIGHTS_NAME))
    assert sorted(original) == sorted(again) and len(original) == 2 * 2 * 2  # 2 layers x 2 modules x A/B
    for key, arr in original.items():
        assert again[key].dtype == ml_dtypes.bfloat16, key
        assert np.array_equal(again[key].view(np.uint16), arr.view(np.uint16)), key
