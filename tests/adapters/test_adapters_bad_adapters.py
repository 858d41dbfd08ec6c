"""Bad adapters are refused with the key or file named, and leave no output directory behind."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hf_side import make_peft_adapter
from safetensors.numpy import load_file, save_file

from lora_trainer import cli, exit_codes
from lora_trainer.adapters.convert import convert
from lora_trainer.adapters.export import export_checkpoint
from lora_trainer.adapters.peft_format import CONFIG_NAME, WEIGHTS_NAME
from lora_trainer.checkpoint import read_lora, write_lora
from lora_trainer.errors import UserError

Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.fixture(scope="module")
def good(tiny_base, tmp_path_factory) -> tuple[Path, Path]:
    base = tiny_base("llama3")
    return base, make_peft_adapter(base, tmp_path_factory.mktemp("good") / "peft", targets=["q_proj", "v_proj"])


def _edit_tensors(d: Path, edit: Callable[[dict[str, np.ndarray]], None]) -> None:
    tensors = load_file(str(d / WEIGHTS_NAME))
    edit(tensors)
    save_file(tensors, str(d / WEIGHTS_NAME), metadata={"format": "pt"})


def _edit_config(d: Path, **changes: object) -> None:
    cfg = json.loads((d / CONFIG_NAME).read_text())
    cfg.update(changes)
    (d / CONFIG_NAME).write_text(json.dumps(cfg))


def _nan(t: dict[str, np.ndarray]) -> None:
    t[Q_A] = t[Q_A].copy()
    t[Q_A][0, 0] = np.inf


def _unknown_module(t: dict[str, np.ndarray]) -> None:
    for half in "AB":
        t[f"base_model.model.model.layers.0.self_attn.qkv_proj.lora_{half}.weight"] = t.pop(Q_A.replace("lora_A", f"lora_{half}"))


def _too_wide(t: dict[str, np.ndarray]) -> None:
    t[Q_A] = np.ones((t[Q_A].shape[0], t[Q_A].shape[1] * 2), np.float32)


def _truncate(d: Path) -> None:
    data = (d / WEIGHTS_NAME).read_bytes()
    (d / WEIGHTS_NAME).write_bytes(data[: len(data) // 2])


CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "missing config": (lambda d: (d / CONFIG_NAME).unlink(), r"adapter_config\.json does not exist"),
    "unknown module": (lambda d: _edit_tensors(d, _unknown_module), r"qkv_proj\.lora_A\.weight.*llama3 mapping does not know"),
    "shape not fitting the base": (lambda d: _edit_tensors(d, _too_wide), r"q_proj\.lora_A\.weight has shape \[4, 128\].*needs \[4, 64\]"),
    "rank mismatch": (lambda d: _edit_config(d, r=8), r"lora_A\.weight.*r=8 \(rank mismatch"),
    "NaN/Inf": (lambda d: _edit_tensors(d, _nan), r"q_proj\.lora_A\.weight.*NaN or Inf"),
    "truncated safetensors": (_truncate, r"adapter_model\.safetensors is not a readable safetensors file"),
    "DoRA": (lambda d: _edit_config(d, use_dora=True), "DoRA"),
    "bias-trained": (lambda d: _edit_config(d, bias="all"), "trains biases"),
    "not LoRA": (lambda d: _edit_config(d, peft_type="LOHA"), "only LoRA adapters"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_adapter_is_refused_and_leaves_nothing(case, good, tmp_path):
    base, adapter = good
    breaks, message = CASES[case]
    bad = tmp_path / "in" / "bad"
    shutil.copytree(adapter, bad)
    breaks(bad)
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    with pytest.raises(UserError, match=message):
        convert("hf-peft", "orbax", str(bad), str(out_parent / "orbax"), base=str(base))
    assert list(out_parent.iterdir()) == []  # no output and no staging debris


def test_cli_reports_a_bad_adapter_with_the_user_error_code(good, tmp_path, capsys):
    base, adapter = good
    bad = tmp_path / "bad"
    shutil.copytree(adapter, bad)
    _edit_config(bad, use_dora=True)
    code = cli.main(["convert", "--from", "hf-peft", "--to", "orbax", "--source", str(bad), "--out", str(tmp_path / "o"), "--base", str(base)])
    assert code == exit_codes.USER_ERROR
    assert "DoRA" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_family_that_contradicts_the_base_is_refused(good, tmp_path):
    base, adapter = good
    with pytest.raises(UserError, match="--family is 'gemma3' but .* describes a llama3 model"):
        convert("hf-peft", "orbax", str(adapter), str(tmp_path / "o"), base=str(base), family="gemma3")


def test_diverged_checkpoint_is_not_exported(good, tmp_path):
    base, adapter = good
    convert("hf-peft", "orbax", str(adapter), str(tmp_path / "orbax"), base=str(base))
    tree, metadata = read_lora(str(tmp_path / "orbax"))
    tree["layers/0/attn/v_proj"]["w_lora_b"][0, 0, 0] = np.nan
    write_lora(str(tmp_path / "diverged"), 5, tree, metadata)
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    with pytest.raises(UserError, match="layers/0/attn/v_proj/w_lora_b of step 5 holds NaN or Inf"):
        export_checkpoint(str(tmp_path / "diverged"), str(out_parent / "hf"))
    assert list(out_parent.iterdir()) == []


def test_convert_and_export_processes_never_import_tunix_or_torch(good, tmp_path):
    """A conversion Job or the export hook needs only the weight tables: Tunix (and through it
    torch, pandas, tensorboardX) would add seconds to every such process. Checked on real CLI
    processes with Python's own import log."""
    base, adapter = good
    runs = [
        ["convert", "--from", "hf-peft", "--to", "orbax", "--source", str(adapter), "--out", str(tmp_path / "orbax"), "--base", str(base)],
        ["export", "--checkpoint", str(tmp_path / "orbax"), "--out", str(tmp_path / "peft")],
    ]
    for argv in runs:
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "lora_trainer.cli", *argv], capture_output=True, text=True, timeout=300)
        assert proc.returncode == exit_codes.OK, proc.stderr[-2000:]
        imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
        assert "lora_trainer.adapters.peft_format" in imported  # the log is real
        assert not {"tunix", "torch", "pandas"} & imported, argv[0]
    assert (tmp_path / "peft" / "adapter_model.safetensors").is_file()
