"""Merging in HF space: the merged checkpoint alone reproduces base + PEFT adapter."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hf_side import hf_logits, make_peft_adapter

from lora_trainer.adapters.merge import INDEX_FILE, merge_adapter_into_checkpoint
from lora_trainer.adapters.peft_format import read_peft_adapter
from lora_trainer.errors import UserError


def test_merged_sharded_model_matches_peft(tiny_base, tmp_path):
    base = tiny_base("llama3", sharded=True)
    adapter_dir = make_peft_adapter(base, tmp_path / "adapter", use_rslora=True)
    out = tmp_path / "merged"
    out.mkdir()
    merge_adapter_into_checkpoint(base, read_peft_adapter(adapter_dir), out, max_shard_bytes=64 * 1024)

    index = json.loads((out / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    assert not list(out.glob(".*"))  # no temporary shard names left

    expected = hf_logits(base, adapter_dir=adapter_dir)
    got = hf_logits(out)
    assert np.abs(got - hf_logits(base)).max() > 1e-2  # the adapter changes the model
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


def test_adapter_for_another_base_is_refused(tiny_base, tmp_path):
    base = tiny_base("llama3", sharded=True)
    adapter = read_peft_adapter(make_peft_adapter(base, tmp_path / "adapter", targets=["q_proj"]))
    bigger = {m: (np.zeros((a.shape[0], a.shape[1] * 2), a.dtype), b) for m, (a, b) in adapter.modules.items()}
    out = tmp_path / "merged"
    out.mkdir()
    with pytest.raises(UserError, match=r"q_proj\.weight.*different base model"):
        merge_adapter_into_checkpoint(base, type(adapter)(adapter.hyper, bigger), out)


def test_a_relative_base_is_recorded_absolute(tiny_base, tmp_path, monkeypatch):
    """`convert --base models/x` recorded the path as typed: `export --merged` from another directory
    then failed ("models/x is not a directory"), and adapter_config.json named a relative base."""
    from lora_trainer import cli

    base = tiny_base("llama3")
    adapter_dir = make_peft_adapter(base, tmp_path / "adapter", targets=["q_proj"])
    monkeypatch.chdir(base.parent)
    assert cli.main(["convert", "--from", "hf-peft", "--to", "orbax", "--source", str(adapter_dir),
                     "--out", str(tmp_path / "orbax"), "--base", base.name]) == 0
    monkeypatch.chdir(tmp_path)
    assert cli.main(["export", "--checkpoint", "orbax", "--out", "merged", "--merged"]) == 0
    assert cli.main(["export", "--checkpoint", "orbax", "--out", "again"]) == 0
    assert json.loads((tmp_path / "again" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    np.testing.assert_allclose(hf_logits(tmp_path / "merged"), hf_logits(base, adapter_dir=adapter_dir), atol=1e-4, rtol=0)
