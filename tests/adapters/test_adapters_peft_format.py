"""PEFT's file format: what we write PEFT reads, and adapters we cannot express are refused by name."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from lora_trainer.adapters import peft_format as pf
from lora_trainer.errors import UserError

MODULE = "model.layers.0.self_attn.q_proj"


def _adapter(rank: int = 4) -> pf.PeftLoraAdapter:
    rng = np.random.default_rng(0)
    modules = {
        MODULE: (rng.standard_normal((rank, 32), np.float32), rng.standard_normal((32, rank), np.float32)),
        "model.layers.0.mlp.down_proj": (rng.standard_normal((rank, 48), np.float32), rng.standard_normal((32, rank), np.float32)),
    }
    return pf.PeftLoraAdapter(pf.LoraHyper(rank=rank, alpha=8.0, target_modules=("down_proj", "q_proj"), base_model="gs://b/m"), modules)


def _written(tmp_path: Path, **config_overrides) -> Path:
    d = tmp_path / "ad"
    d.mkdir()
    pf.write_peft_adapter(d, _adapter())
    if config_overrides:
        cfg = json.loads((d / pf.CONFIG_NAME).read_text())
        cfg.update(config_overrides)
        (d / pf.CONFIG_NAME).write_text(json.dumps(cfg))
    return d


def test_safetensors_writer_is_read_bitwise_by_safetensors(tmp_path):
    """Every layout the mapping produces (transposed, strided), and every float dtype, byte for byte."""
    import ml_dtypes
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    rng = np.random.default_rng(3)
    tensors = {
        "t": rng.standard_normal((5, 3), np.float32).T,
        "s": rng.standard_normal((3, 4, 5), np.float32)[:, ::2],
        "c": rng.standard_normal((2, 3)),
        "h": rng.standard_normal((2, 3)).astype(np.float16),
        "be": rng.standard_normal((2, 3)).astype(">f4"),
        "bf": rng.standard_normal((4, 2)).astype(ml_dtypes.bfloat16).T,
        "empty": np.zeros((0, 3), np.float32),
    }
    path = tmp_path / "x.safetensors"
    pf.write_safetensors(path, tensors, {"format": "pt"})
    with safe_open(str(path), framework="np") as f:
        assert f.metadata() == {"format": "pt"} and sorted(f.keys()) == sorted(tensors)
        for key, want in tensors.items():
            if key != "bf":  # numpy has no bfloat16 in safetensors; torch reads it below
                got = f.get_tensor(key)
                assert got.dtype == want.dtype.newbyteorder("<") and np.array_equal(got, want), key
    bf = load_file(str(path))["bf"]
    assert bf.dtype == torch.bfloat16 and np.array_equal(bf.float().numpy(), tensors["bf"].astype(np.float32))
    with pytest.raises(ValueError, match="int32"):
        pf.write_safetensors(tmp_path / "y.safetensors", {"i": np.zeros(2, np.int32)}, {})


def test_round_trip_is_bitwise_and_peft_reads_it(tmp_path):
    from peft import LoraConfig
    from peft.utils import load_peft_weights

    d = _written(tmp_path)
    back = pf.read_peft_adapter(d)
    assert back.hyper == _adapter().hyper
    for name, (a, b) in _adapter().modules.items():
        assert np.array_equal(back.modules[name][0], a) and np.array_equal(back.modules[name][1], b)

    cfg = LoraConfig.from_pretrained(str(d))
    assert (cfg.r, cfg.lora_alpha, cfg.use_rslora, cfg.bias) == (4, 8, False, "none")
    assert set(cfg.target_modules) == {"q_proj", "down_proj"}
    weights = load_peft_weights(str(d), device="cpu")
    assert tuple(weights[f"base_model.model.{MODULE}.lora_A.weight"].shape) == (4, 32)
    assert tuple(weights[f"base_model.model.{MODULE}.lora_B.weight"].shape) == (32, 4)


def test_a_hub_base_is_named_as_peft_names_it():
    hub = pf.config_json(pf.LoraHyper(rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj",), base_model="hf://org/name@v1"))
    assert (hub["base_model_name_or_path"], hub["revision"]) == ("org/name", "v1")
    gcs = pf.config_json(pf.LoraHyper(rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj",), base_model="gs://b/m"))
    assert (gcs["base_model_name_or_path"], gcs["revision"]) == ("gs://b/m", None)


def test_inits_that_leave_the_base_alone_are_plain_lora(tmp_path):
    for init in (True, False, "gaussian", "eva", "orthogonal"):
        (tmp_path / str(init)).mkdir()
        assert pf.read_peft_adapter(_written(tmp_path / str(init), init_lora_weights=init)).hyper.rank == 4


def test_missing_alpha_takes_peft_default(tmp_path):
    d = _written(tmp_path)
    cfg = json.loads((d / pf.CONFIG_NAME).read_text())
    del cfg["lora_alpha"]
    (d / pf.CONFIG_NAME).write_text(json.dumps(cfg))
    assert pf.read_peft_adapter(d).hyper.scale == 8 / 4


def test_rslora_is_folded_into_alpha(tmp_path):
    hyper = pf.read_peft_adapter(_written(tmp_path, use_rslora=True, lora_alpha=8)).hyper
    assert hyper.scale == pytest.approx(8 / math.sqrt(4), rel=1e-12)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "lora_only"}, "trains biases"),
        ({"lora_bias": True}, "trains biases"),
        ({"peft_type": "IA3"}, "only LoRA adapters"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 8}}, "per-module ranks"),
        # PEFT rewrites the base weights when it loads these: same tensors, other logits.
        ({"init_lora_weights": "pissa"}, "init_lora_weights is 'pissa': PEFT changes the base weights"),
        ({"init_lora_weights": "pissa_niter_16"}, "PiSSA, OLoRA, CorDA and LoftQ"),
        ({"init_lora_weights": "olora"}, "init_lora_weights is 'olora'"),
        ({"init_lora_weights": "loftq"}, "init_lora_weights is 'loftq'"),
        ({"r": 0}, "r must be a positive integer"),
        ({"lora_dropout": "0.1"}, r"lora_dropout must be a number in \[0, 1\)"),
    ],
)
def test_features_plain_lora_cannot_express_are_refused(tmp_path, override, message):
    with pytest.raises(UserError, match=message):
        pf.read_peft_adapter(_written(tmp_path, **override))


def test_rank_mismatch_names_the_tensor(tmp_path):
    with pytest.raises(UserError, match=r"lora_A\.weight.*r=8 \(rank mismatch"):
        pf.read_peft_adapter(_written(tmp_path, r=8, lora_alpha=16))


def test_missing_config_names_the_file(tmp_path):
    d = _written(tmp_path)
    (d / pf.CONFIG_NAME).unlink()
    with pytest.raises(UserError, match="adapter_config.json does not exist"):
        pf.read_peft_adapter(d)


def test_weights_are_read_as_views_of_the_file(tmp_path):
    """No copy on read: the tensors are read-only views of one memory map, with the written values."""
    adapter = pf.read_peft_adapter(_written(tmp_path))
    arrays = [x for ab in adapter.modules.values() for x in ab]
    assert all(isinstance(x.base, np.memmap) and not x.flags.writeable for x in arrays)
    for module, (a, b) in _adapter().modules.items():
        np.testing.assert_array_equal(adapter.modules[module][0], a)
        np.testing.assert_array_equal(adapter.modules[module][1], b)


def test_truncated_weights_name_the_file(tmp_path):
    d = _written(tmp_path)
    data = (d / pf.WEIGHTS_NAME).read_bytes()
    (d / pf.WEIGHTS_NAME).write_bytes(data[: len(data) - 100])
    with pytest.raises(UserError, match=r"adapter_model\.safetensors is not a readable safetensors file.*truncated"):
        pf.read_peft_adapter(d)


def test_nan_and_stray_keys_name_the_key(tmp_path):
    from safetensors.numpy import save_file

    d = _written(tmp_path)
    a = np.ones((4, 32), np.float32)
    a[1, 2] = np.nan
    save_file({f"base_model.model.{MODULE}.lora_A.weight": a, f"base_model.model.{MODULE}.lora_B.weight": np.ones((32, 4), np.float32)}, str(d / pf.WEIGHTS_NAME))
    with pytest.raises(UserError, match=r"q_proj\.lora_A\.weight.*NaN or Inf"):
        pf.read_peft_adapter(d)
    save_file({f"base_model.model.{MODULE}.lora_magnitude_vector": np.ones(32, np.float32)}, str(d / pf.WEIGHTS_NAME))
    with pytest.raises(UserError, match="lora_magnitude_vector.*not a LoRA weight"):
        pf.read_peft_adapter(d)
    save_file({f"base_model.model.{MODULE}.lora_A.weight": np.ones((4, 32), np.float32)}, str(d / pf.WEIGHTS_NAME))
    with pytest.raises(UserError, match="no lora_B.weight"):
        pf.read_peft_adapter(d)
    # A model's state_dict saved by hand, not by PEFT: the key says what to do.
    save_file({f"base_model.model.{MODULE}.lora_A.default.weight": np.ones((4, 32), np.float32)}, str(d / pf.WEIGHTS_NAME))
    with pytest.raises(UserError, match="still carries the adapter name 'default'.*save_pretrained"):
        pf.read_peft_adapter(d)
    save_file({f"{MODULE}.lora_A.weight": np.ones((4, 32), np.float32)}, str(d / pf.WEIGHTS_NAME))
    with pytest.raises(UserError, match="lacks PEFT's 'base_model.model.' prefix"):
        pf.read_peft_adapter(d)
