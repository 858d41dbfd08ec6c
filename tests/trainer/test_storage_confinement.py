"""Names are confined to their destination on every path that maps stored names to local files or back.

The attack (issue 22): a bucket holding an object named `adapter//tmp/x` or `adapter/../../tmp/x`
made `lora-trainer convert` exit 0 and write `/tmp/x`. Every path is shown on the real GCS
emulator: adapters (`convert --source gs://`, the real CLI), base models (`model.source gs://`),
`lora.restoreFrom` (a training run), a merged export's `--base`, Orbax checkpoints (their array
names), uploads, and local sources with symbolic links (plain directories and the hub's cache).
The emulator refuses to store `..` in a name (real GCS allows it), so those objects are served by
the test proxy under their hostile name (tests/gcs_proxy.py). Each refusal is a UserError naming
the object and the source; nothing is written at the destination or where the name pointed.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gcs_proxy import FaultProxy
from trainer_fixtures import LORA_TRAINER, REPO, parse, tiny_llama, train_config, trainer_env

from lora_trainer import checkpoint, exit_codes, storage
from lora_trainer.adapters.export import export_checkpoint
from lora_trainer.adapters.merge import merge_adapter_into_checkpoint
from lora_trainer.adapters.peft_format import LoraHyper, PeftLoraAdapter
from lora_trainer.errors import UserError
from lora_trainer.models.loading import CACHE_ENV, resolve_local_dir
from lora_trainer.models.safetensors_io import SafetensorsCheckpoint
from lora_trainer.train import run_training

#: name below the source ({absolute}: an absolute path without its leading `/`) -> what the refusal says of it.
HOSTILE = {
    "absolute": ("/{absolute}", "an empty component"),
    "dot-dot": ("../../escaped", r"a '\.' or '\.\.' component"),
    "dot": ("./x.json", r"a '\.' or '\.\.' component"),
    "backslash": ("..\\..\\escaped", "a backslash"),
    "control character": ("x\ty.json", "a control character"),
}


def _put(uri: str, data: bytes = b"{}") -> None:
    """Create an object as named, however hostile the name (storage.write_bytes would do the same)."""
    bucket, name = uri[len("gs://") :].split("/", 1)
    storage._client().bucket(bucket).blob(name).upload_from_string(data)


@pytest.fixture
def prefix(gcs_bucket, request) -> str:
    return f"gs://{gcs_bucket}/confine/{request.node.name.replace('[', '-').replace(']', '').replace(' ', '-')}"


@pytest.fixture
def proxy(gcs_bucket, monkeypatch) -> Iterator[FaultProxy]:
    """The test process's google-cloud-storage client, through a proxy in front of the session's emulator."""
    target = int(os.environ["STORAGE_EMULATOR_HOST"].rsplit(":", 1)[1])
    proxy = FaultProxy(target)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.env["STORAGE_EMULATOR_HOST"])
    storage._client.cache_clear()
    yield proxy
    storage._client.cache_clear()
    proxy.close()


def _hostile(proxy: FaultProxy, source: str, kind: str, absolute: Path) -> tuple[str, str]:
    """Put an object named as `kind` says below `source` (`absolute`: where an absolute name points);
    returns (its name below `source`, what the refusal says of it)."""
    template, problem = HOSTILE[kind]
    name = template.format(absolute=str(absolute).lstrip("/"))
    _, _, prefix_name = source[len("gs://") :].partition("/")
    if ".." in name.replace("\\", "/").split("/"):  # the emulator refuses the name: store it plainly, serve it as named
        _put(f"{source}/hostile-{kind}")
        proxy.rename(f"{prefix_name}/hostile-{kind}", f"{prefix_name}/{name}")
    else:
        _put(f"{source}/{name}")
    return name, problem


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_a_download_refuses_names_that_leave_the_destination(kind, prefix, proxy, tmp_path):
    source = f"{prefix}/adapter"
    _put(f"{source}/adapter_config.json")
    dest = tmp_path / "a" / "b" / "dest"  # `../../escaped` below it is tmp_path/a/escaped
    _, problem = _hostile(proxy, source, kind, tmp_path / "escaped")
    with pytest.raises(UserError, match=rf"{source}/.* is named .* below {source}, a name with {problem}.*nothing was copied"):
        storage.download_dir(source, dest)
    assert not dest.exists() or list(dest.iterdir()) == []
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "a" / "escaped").exists()
    assert storage.listdir(source)  # the bucket as it was: only the local side was refused


def test_an_object_that_is_also_a_directory_is_refused(prefix, tmp_path):
    _put(f"{prefix}/m/x")
    _put(f"{prefix}/m/x/y")
    with pytest.raises(UserError, match=rf"{prefix}/m holds both an object named 'x' below it and objects below x/"):
        storage.download_dir(f"{prefix}/m", tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


@pytest.mark.parametrize("kind", ["absolute", "dot-dot"])
def test_convert_of_a_hostile_bucket_exits_3_and_writes_nothing(kind, prefix, proxy, tmp_path):
    """The issue's repro through the real `lora-trainer convert` process: exit 3, one stderr line
    naming the object, nothing at --out, nothing where the name pointed."""
    source = f"{prefix}/adapter"
    _put(f"{source}/adapter_config.json")
    tmp = tmp_path / "tmp"  # the process's TMPDIR: its download directory is tmp/lora-dl-XXX
    tmp.mkdir()
    name, _ = _hostile(proxy, source, kind, tmp_path / "escaped")  # `../../escaped` below tmp/lora-dl-XXX too
    out = tmp_path / "out"
    proc = subprocess.run(
        [LORA_TRAINER, "convert", "--from", "hf-peft", "--to", "orbax", "--source", source, "--out", str(out), "--base", str(tiny_llama())],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=trainer_env(**proxy.env, TMPDIR=str(tmp)),
    )
    assert proc.returncode == exit_codes.USER_ERROR, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("lora-trainer convert: error: --source "), proc.stderr[-3000:]
    assert f"{source}/{name}" in lines[0]
    assert not out.exists() and not (tmp_path / "escaped").exists() and list(tmp.iterdir()) == []


def test_a_base_model_on_gcs_with_a_hostile_name_is_refused(prefix, proxy, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    source = f"{prefix}/model"
    _put(f"{source}/config.json")
    name, _ = _hostile(proxy, source, "dot-dot", tmp_path / "escaped")  # below cache/<hash>: tmp_path/escaped
    with pytest.raises(UserError, match=rf"{source}/{name} is named"):
        resolve_local_dir(source)
    assert not (tmp_path / "escaped").exists() and not any((tmp_path / "cache").rglob("*.json"))


@pytest.mark.slow
def test_restore_from_a_hostile_adapter_is_refused(prefix, tmp_path):
    """`lora.restoreFrom` of a gs:// PEFT adapter is downloaded like any other: a training run refuses it."""
    source = f"{prefix}/adapter"
    _put(f"{source}/adapter_config.json")
    _put(f"{source}/sub//{tmp_path}/escaped")
    cfg = train_config(tmp_path, str(tmp_path / "run"), steps=1)
    cfg["lora"]["restoreFrom"] = source
    with pytest.raises(UserError, match=rf"{source}/sub//.*/escaped is named 'sub//.*escaped' below {source}, a name with an empty"):
        run_training(parse(cfg))
    assert not (tmp_path / "escaped").exists() and checkpoint.committed_steps(str(tmp_path / "run" / "checkpoints")) == []


def test_a_merged_export_of_a_hostile_base_is_refused(prefix, tmp_path):
    base = tiny_llama()
    storage.upload_dir(str(base), f"{prefix}/base")
    _put(f"{prefix}/base//{tmp_path}/escaped")
    ckpt = tmp_path / "ckpt"
    tree = {"layers/0/attn/q_proj": {"w_lora_a": np.ones((64, 2), np.float32), "w_lora_b": np.zeros((2, 4, 16), np.float32)}}
    meta = {"family": "llama3", "baseModel": f"{prefix}/base", "rank": 2, "alpha": 4.0, "dropout": 0.0,
            "targetModules": "layers/0/attn/q_proj", "quantization": None, "modulePaths": sorted(tree)}
    checkpoint.write_lora(str(ckpt), 1, tree, meta)
    (tmp_path / "out").mkdir()
    with pytest.raises(UserError, match=rf"{prefix}/base//.*/escaped is named"):
        export_checkpoint(str(ckpt), str(tmp_path / "out" / "merged"), merged=True)
    assert list((tmp_path / "out").iterdir()) == [] and not (tmp_path / "escaped").exists()


def test_orbax_array_names_that_leave_the_checkpoint_are_refused_before_reading(prefix, tmp_path):
    """Orbax reads each array at `<step>/lora/<key>.<name>`, the keys from the item's `_METADATA`: a
    key `../../x` read an array from outside the checkpoint. Refused before any array is opened."""
    local = tmp_path / "ckpt"
    tree = {"layers/0/attn/q_proj": {"w_lora_a": np.ones((64, 2), np.float32), "w_lora_b": np.ones((2, 4, 16), np.float32)}}
    meta = {"family": "llama3", "baseModel": None, "rank": 2, "alpha": 4.0, "dropout": 0.0,
            "targetModules": "layers/0/attn/q_proj", "quantization": None, "modulePaths": sorted(tree)}
    checkpoint.write_lora(str(local), 0, tree, meta)
    root = f"{prefix}/ckpt"
    storage.upload_dir(str(local), root)
    assert checkpoint.read_lora(root)[1]["rank"] == 2  # whole and readable as uploaded
    record = json.loads((local / "0" / "lora" / "_METADATA").read_text().replace("layers/0/attn/q_proj", "../../outside"))
    storage.write_text(f"{root}/0/lora/_METADATA", json.dumps(record))
    with pytest.raises(UserError, match=rf"{root}/0/lora/\.\./\.\./outside is named"):
        checkpoint.read_lora(root)


def test_uploads_refuse_names_and_links_that_would_not_come_back(prefix, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok.json").write_text("{}")
    (src / "a\\b.json").write_text("{}")
    with pytest.raises(UserError, match=r"a\\\\b\.json' below .*src, a name with a backslash"):
        storage.upload_dir(str(src), f"{prefix}/up")
    assert not storage.exists(f"{prefix}/up")
    (src / "a\\b.json").unlink()
    (tmp_path / "secret").write_text("token")
    (src / "token.json").symlink_to(tmp_path / "secret")
    with pytest.raises(UserError, match=r"src holds 'token\.json', a symbolic link to .*secret: only links to files inside"):
        storage.upload_dir(str(src), f"{prefix}/up")
    assert not storage.exists(f"{prefix}/up")


def test_local_sources_follow_links_only_inside_them(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "config.json").write_text('{"a": 1}')
    (src / "alias.json").symlink_to("sub/config.json")  # inside: copied as a file
    storage.download_dir(str(src), tmp_path / "copy")
    assert (tmp_path / "copy" / "alias.json").read_text() == '{"a": 1}' and not (tmp_path / "copy" / "alias.json").is_symlink()
    (tmp_path / "secret").write_text("token")
    for link, target in (("leak.json", tmp_path / "secret"), ("dir", tmp_path), ("dangling.json", tmp_path / "nothing")):
        (src / link).symlink_to(target)
        with pytest.raises(UserError, match=rf"src holds '{link}', a symbolic link to .*: only links to files inside"):
            storage.download_dir(str(src), tmp_path / f"copy-{link}")
        assert not (tmp_path / f"copy-{link}").exists()
        (src / link).unlink()


def test_hub_snapshots_follow_links_into_their_repository_only(tmp_path):
    """The hub's cache keeps a snapshot's files as links to `../../blobs/`: followed; one pointing
    anywhere else is refused."""
    repo = Path(os.environ["HF_HUB_CACHE"]) / "models--acme--confine"
    snapshot = repo / "snapshots" / ("0" * 40)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "blobs" / "abc").write_text('{"model_type": "llama"}')
    (snapshot / "config.json").symlink_to("../../blobs/abc")
    storage.download_dir("hf://acme/confine", tmp_path / "model")
    assert (tmp_path / "model" / "config.json").read_text() == '{"model_type": "llama"}'
    (tmp_path / "secret").write_text("token")
    (snapshot / "tokenizer.json").symlink_to(tmp_path / "secret")
    with pytest.raises(UserError, match=r"hf://acme/confine holds 'tokenizer\.json', a symbolic link to .*secret"):
        storage.download_dir("hf://acme/confine", tmp_path / "model2")
    assert not (tmp_path / "model2").exists()


def test_a_merge_does_not_carry_a_linked_file_into_its_output(tmp_path):
    base = tmp_path / "base"
    storage.download_dir(str(tiny_llama()), base)
    (tmp_path / "secret").write_text("token")
    (base / "tokenizer_config.json").unlink(missing_ok=True)
    (base / "tokenizer_config.json").symlink_to(tmp_path / "secret")
    adapter = PeftLoraAdapter(LoraHyper(rank=2, alpha=4.0), {"model.layers.0.self_attn.q_proj": (np.ones((2, 64), np.float32), np.zeros((64, 2), np.float32))})
    (tmp_path / "out").mkdir()
    with pytest.raises(UserError, match=r"base holds 'tokenizer_config\.json', a symbolic link"):
        merge_adapter_into_checkpoint(base, adapter, tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


def test_a_safetensors_index_cannot_name_files_outside_its_directory(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../outside.safetensors"}}))
    with pytest.raises(UserError, match=r"base/\.\./outside\.safetensors is named '\.\./outside\.safetensors' below .*base"):
        SafetensorsCheckpoint(base)
