"""Storage: outputs appear whole or not at all; missing inputs name themselves."""

import os

import pytest

from lora_trainer import storage
from lora_trainer.errors import UserError


def test_staged_output_publishes_only_on_success(tmp_path):
    out = tmp_path / "adapter"
    with pytest.raises(RuntimeError):
        with storage.staged_output_dir(str(out)) as stage:
            (stage / "adapter_config.json").write_text("{}")
            raise RuntimeError("export failed half-way")
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no staging debris either

    with storage.staged_output_dir(str(out)) as stage:
        (stage / "adapter_config.json").write_text('{"r": 8}')
    assert (out / "adapter_config.json").read_text() == '{"r": 8}'
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # readable like any directory, not mkdtemp's 0700

    # Republishing replaces the old output whole.
    with storage.staged_output_dir(str(out)) as stage:
        (stage / "adapter_model.safetensors").write_bytes(b"x")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_model.safetensors"]


def test_atomic_write_and_read_back(tmp_path):
    target = tmp_path / "a" / "progress.json"
    storage.write_text(str(target), '{"step": 3}')
    assert storage.read_text(str(target)) == '{"step": 3}'
    assert storage.read_text(f"file://{target}") == '{"step": 3}'
    assert [p.name for p in target.parent.iterdir()] == ["progress.json"]


def test_missing_input_is_a_user_error_naming_it(tmp_path):
    with pytest.raises(UserError, match="nope.json"):
        storage.read_text(str(tmp_path / "nope.json"))
    with pytest.raises(UserError, match="not a directory"):
        with storage.local_dir(str(tmp_path / "missing")):
            pass


def test_join_and_listdir(tmp_path):
    assert storage.join("gs://b/run/", "checkpoints", "10") == "gs://b/run/checkpoints/10"
    assert storage.join(str(tmp_path), "x") == str(tmp_path / "x")
    (tmp_path / "b").mkdir()
    (tmp_path / "a").write_text("")
    assert storage.listdir(str(tmp_path)) == ["a", "b"]
    assert storage.split_gcs("gs://bucket/a/b") == ("bucket", "a/b")
