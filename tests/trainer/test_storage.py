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


def test_hf_uris_read_through_the_hub_cache(tmp_path):
    from hf_cache import publish_to_hub_cache

    from lora_trainer.errors import RetriableError

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text('{"model_type": "llama"}')
    (src / "model.safetensors").write_bytes(b"weights")
    (src / "notes.bin").write_bytes(b"not a model file")
    uri = publish_to_hub_cache(src, "acme/storage-test")

    assert storage.read_text(f"{uri}/config.json") == '{"model_type": "llama"}'
    with storage.local_dir(uri) as d:
        assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.safetensors"]
    assert storage.split_hf("hf://org/name@v1.0/sub/f.json") == ("org/name", "v1.0", "sub/f.json")
    with pytest.raises(UserError, match="hf://ORG/NAME"):
        storage.split_hf("hf://just-a-name")
    # Offline and not cached: the hub is unreachable, which a restart may fix.
    with pytest.raises(RetriableError, match="hf://acme/absent"):
        storage.read_text("hf://acme/absent/config.json")
