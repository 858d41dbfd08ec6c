"""Storage: outputs appear whole or not at all; missing inputs name themselves."""

import os
import subprocess
import sys

import pytest

from lora_trainer import storage
from lora_trainer.errors import UserError


def test_staged_output_publishes_only_on_success(tmp_path):
    out = tmp_path / "adapter"
    with pytest.raises(RuntimeError, match="export failed half-way"):
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

    # Republishing replaces an earlier output of the same files whole (a partial one too).
    with storage.staged_output_dir(str(out)) as stage:
        (stage / "adapter_config.json").write_text('{"r": 4}')
        (stage / "adapter_model.safetensors").write_bytes(b"x")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert (out / "adapter_config.json").read_text() == '{"r": 4}'


def test_staged_output_never_replaces_what_it_does_not_write(tmp_path):
    run = tmp_path / "run"  # a run's output: export pointed at it instead of at run/hf-adapter
    (run / "checkpoints" / "3").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(UserError, match=r"run already holds checkpoints, metrics.jsonl, which this output does not write"):
        with storage.staged_output_dir(str(run)) as stage:
            (stage / "adapter_config.json").write_text("{}")
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "metrics.jsonl"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no staging debris
    (tmp_path / "afile").write_text("")
    with pytest.raises(UserError, match="is a file"):
        with storage.staged_output_dir(str(tmp_path / "afile")) as stage:
            (stage / "adapter_config.json").write_text("{}")
    assert (tmp_path / "afile").is_file()


def test_staged_output_on_gcs_replaces_only_its_own_files(gcs_bucket, tmp_path):
    out = f"gs://{gcs_bucket}/test_storage/adapter"
    for _ in range(2):
        with storage.staged_output_dir(out) as stage:
            (stage / "adapter_config.json").write_text("{}")
    assert storage.exists(f"{out}/_COMPLETE")
    storage.write_text(f"{out}/notes/readme.txt", "mine")
    with pytest.raises(UserError, match="already holds notes, which this output does not write"):
        with storage.staged_output_dir(out) as stage:
            (stage / "adapter_config.json").write_text("{}")
    assert storage.read_text(f"{out}/notes/readme.txt") == "mine"


def test_atomic_write_and_read_back(tmp_path):
    target = tmp_path / "a" / "progress.json"
    storage.write_text(str(target), '{"step": 3}')
    assert storage.read_text(str(target)) == '{"step": 3}'
    assert storage.read_text(f"file://{target}") == '{"step": 3}'
    assert [p.name for p in target.parent.iterdir()] == ["progress.json"]


def test_missing_input_is_a_user_error_naming_it(tmp_path):
    with pytest.raises(UserError, match="nope.json"):
        storage.read_text(str(tmp_path / "nope.json"))
    (tmp_path / "train.jsonl").mkdir()
    with pytest.raises(UserError, match="train.jsonl is a directory, not a file"):
        storage.read_bytes(str(tmp_path / "train.jsonl"))
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


def test_output_location_is_checked_before_any_work(tmp_path, gcs_bucket):
    (tmp_path / "afile").write_text("")
    with pytest.raises(UserError, match=r"output.uri .*afile/run: cannot create the directory"):
        storage.check_output_location(str(tmp_path / "afile" / "run"), "output.uri")
    storage.check_output_location(str(tmp_path / "new" / "run"), "output.uri")
    assert (tmp_path / "new" / "run").is_dir()
    with pytest.raises(UserError, match=r"output.uri gs://no-such-bucket-xyz/run: bucket 'no-such-bucket-xyz' does not exist"):
        storage.check_output_location("gs://no-such-bucket-xyz/run", "output.uri")
    storage.check_output_location(f"gs://{gcs_bucket}/fresh-run", "output.uri")


def test_staged_output_at_dot_or_under_a_file(tmp_path, monkeypatch):
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    with storage.staged_output_dir(".") as stage:  # the (empty) working directory itself
        (stage / "adapter_config.json").write_text("{}")
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["adapter_config.json"]
    (tmp_path / "afile").write_text("")
    with pytest.raises(UserError, match="cannot create its parent directory"):
        with storage.staged_output_dir(str(tmp_path / "afile" / "x")) as stage:
            pass


@pytest.mark.parametrize(("on_kubernetes", "error"), [(False, "UserError"), (True, "RetriableError")])
def test_missing_google_credentials_are_named_not_a_traceback(tmp_path, on_kubernetes, error):
    """No credentials for gs:// (no ADC file, no metadata server): on a laptop a user error saying
    how to log in (it was a DefaultCredentialsError traceback, exit 1); in a pod a retriable one,
    since GKE's metadata server can lag the pod's start. Own process: the client is cached."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STORAGE_EMULATOR", "GOOGLE_", "CLOUDSDK_", "KUBERNETES_"))}
    env.update(HOME=str(tmp_path), CLOUDSDK_CONFIG=str(tmp_path / "gcloud"), GCE_METADATA_HOST="127.0.0.1:9",
               GCE_METADATA_IP="127.0.0.1:9", NO_GCE_CHECK="True")
    if on_kubernetes:
        env["KUBERNETES_SERVICE_HOST"] = "10.0.0.1"
    script = (
        "from lora_trainer import storage\n"
        "try:\n    storage._client()\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith(error), out.stdout + out.stderr[-2000:]
    assert ("gcloud auth application-default login" if not on_kubernetes else "Workload Identity") in out.stdout
