"""Every storage error the trainer can meet is classified: retriable (exit 42) or the user's (exit 3).

Two levels. The table (`storage_faults.classify`) is checked class by class on the exception objects
the three GCS clients and the local disk raise: google-cloud-storage and google.api_core, gcsfs,
TensorStore's status text, the transport libraries, google.auth, builtins. Then the faults real GCS
gives are made on the wire by an HTTP proxy in front of the emulator (tests/gcs_proxy.py), against
the production calls: 503 and 429 bursts ridden out, an outage and slow answers outlasting the retry
deadline, a 503 after an upload or a delete had succeeded, 403 and 400 answers, a missing bucket or
object, gcsfs's FileNotFoundError after a retried delete, and a bucket missing named by its field
through the real CLI.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import gcsfs
import jax
import pytest
import requests
import urllib3
import yarl
from gcs_proxy import Fault, FaultProxy
from multidict import CIMultiDict, CIMultiDictProxy
from google.api_core import exceptions as gexc
from google.auth import exceptions as auth_exc
from google.cloud.storage.exceptions import DataCorruption
from trainer_fixtures import LORA_TRAINER, REPO, tiny_llama, trainer_env

from lora_trainer import cli, exit_codes, storage
from lora_trainer.errors import RetriableError, UserError, naming_fields
from lora_trainer.storage_faults import classify

URI = "gs://bucket/run/checkpoints"
R, U = RetriableError, UserError


def _ts(text: str) -> ValueError:
    """An error as TensorStore raises it (Orbax's array data): a ValueError with an absl status in its text."""
    return ValueError(text + ' [tensorstore_spec=\'{"driver":"zarr","kvstore":{"bucket":"bucket","driver":"gcs"}}\']')


_REQUEST = aiohttp.RequestInfo(yarl.URL("http://gcs/b/o"), "GET", CIMultiDictProxy(CIMultiDict()), yarl.URL("http://gcs/b/o"))

#: name -> (exception, writing, bucket missing, expected class or None (a bug: keeps its traceback), text in the message)
TABLE: dict[str, tuple[BaseException, bool, bool, type | None, str]] = {
    "503 (google-cloud-storage)": (gexc.ServiceUnavailable("backend"), False, False, R, "storage fault while accessing"),
    "500": (gexc.InternalServerError("oops"), False, False, R, "storage fault"),
    "502": (gexc.BadGateway("proxy"), False, False, R, "storage fault"),
    "504": (gexc.GatewayTimeout("slow"), False, False, R, "storage fault"),
    "429": (gexc.TooManyRequests("slow down"), True, False, R, "storage fault"),
    "retry deadline exhausted": (gexc.RetryError("Timeout of 120.0s exceeded", ConnectionError("refused")), False, False, R, "storage unreachable for"),
    "404 object, reading": (gexc.NotFound("no such object"), False, False, U, f"{URI} does not exist: check the URI"),
    "404 bucket": (gexc.NotFound("no such bucket"), False, True, U, "bucket 'bucket' does not exist: create it"),
    "404 bucket, writing": (gexc.NotFound("no such bucket"), True, True, U, "bucket 'bucket' does not exist"),
    "404 object under a write": (gexc.NotFound("gone"), True, False, R, "an object was gone when a retried request reached it"),
    "403": (gexc.Forbidden("denied"), False, False, U, "was denied"),
    "401": (gexc.Unauthorized("who"), False, False, U, "was denied"),
    "400": (gexc.BadRequest("bad name"), False, False, U, "storage refused a request for"),
    "connection refused (requests)": (requests.exceptions.ConnectionError("refused"), False, False, R, "storage fault"),
    "read timeout (requests)": (requests.exceptions.ReadTimeout("slow"), False, False, R, "storage fault"),
    "body cut short (requests)": (requests.exceptions.ChunkedEncodingError("cut"), False, False, R, "storage fault"),
    "protocol error (urllib3)": (urllib3.exceptions.ProtocolError("reset"), False, False, R, "storage fault"),
    "503 (requests HTTPError)": (requests.exceptions.HTTPError("503", response=type("R", (), {"status_code": 503})()), False, False, R, "storage fault"),
    "server disconnected (aiohttp)": (aiohttp.ServerDisconnectedError(), False, False, R, "storage fault"),
    "503 (aiohttp)": (aiohttp.ClientResponseError(_REQUEST, (), status=503), False, False, R, "storage fault"),
    "403 (aiohttp)": (aiohttp.ClientResponseError(_REQUEST, (), status=403), False, False, U, "was denied"),
    "503 (gcsfs)": (gcsfs.retry.HttpError({"code": 503, "message": "Service Unavailable"}), True, False, R, "storage fault"),
    "429 (gcsfs)": (gcsfs.retry.HttpError({"code": "429", "message": "rate"}), True, False, R, "storage fault"),
    "400 (gcsfs)": (gcsfs.retry.HttpError({"code": 400, "message": "bad"}), False, False, U, "storage refused a request"),
    "403 (gcsfs)": (OSError("Forbidden: b/run\nno access"), False, False, U, "was denied"),
    "checksum (gcsfs)": (gcsfs.retry.ChecksumError("md5"), False, False, R, "storage fault"),
    "404 after a retried delete (gcsfs)": (FileNotFoundError("b/o/run%2Fx"), True, False, R, "an object was gone"),
    "404 reading (gcsfs)": (FileNotFoundError("b/o/run%2Fx"), False, False, U, "does not exist"),
    "404 bucket (gcsfs)": (FileNotFoundError("b/o/run%2Fx"), True, True, U, "bucket 'bucket' does not exist"),
    "corrupted download": (DataCorruption(None, "crc32c mismatch"), False, False, R, "storage fault"),
    "transport (google.auth)": (auth_exc.TransportError("metadata server"), False, False, R, "storage fault"),
    "refresh refused (google.auth), laptop": (auth_exc.RefreshError("invalid_grant"), False, False, U, "gcloud auth application-default login"),
    "connection reset (builtin)": (ConnectionResetError("reset"), False, False, R, "storage fault"),
    "timeout (builtin)": (TimeoutError("timed out"), False, False, R, "storage fault"),
    "503 (TensorStore)": (_ts("UNAVAILABLE: Error writing: HTTP response code: 503 with body: x"), True, False, R, "storage fault"),
    "429 (TensorStore)": (_ts("RESOURCE_EXHAUSTED: HTTP response code: 429"), True, False, R, "storage fault"),
    "unreachable (TensorStore)": (_ts("ABORTED: Error opening: All 8 retry attempts failed: CURL error"), False, False, R, "retry attempts failed"),
    "deadline (TensorStore)": (_ts("DEADLINE_EXCEEDED: timed out"), False, False, R, "storage fault"),
    "403 (TensorStore)": (_ts("PERMISSION_DENIED: Error writing: HTTP response code: 403 with body: denied"), True, False, U, "was denied"),
    "401 (TensorStore)": (_ts("UNAUTHENTICATED: no token"), True, False, U, "was denied"),
    "404 bucket (TensorStore)": (_ts("NOT_FOUND: Error writing: HTTP response code: 404"), True, True, U, "bucket 'bucket' does not exist"),
    "directory gone under a save's commit (Orbax)": (ValueError(f"Checkpoint directory does not exist: {URI}/4/lora."), True, False, R, "an object was gone"),
    "directory missing, reading (Orbax)": (ValueError(f"Checkpoint directory does not exist: {URI}/4/lora."), False, False, U, "does not exist"),
    "bad bucket name (TensorStore)": (_ts('INVALID_ARGUMENT: Invalid GCS bucket name: "b"'), True, False, U, "storage refused a request"),
    "permission denied (local)": (PermissionError(errno.EACCES, "Permission denied", "/data"), False, False, U, "was denied"),
    "disk full (local)": (OSError(errno.ENOSPC, "No space left on device", "/tmp/x"), True, False, U, "the disk is full"),
    "read-only (local)": (OSError(errno.EROFS, "Read-only file system", "/x"), True, False, U, "read-only"),
    "accelerator memory (XLA), not storage": (jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1024 bytes."), False, False, None, ""),
    "a bug": (ValueError("unsupported operand"), False, False, None, ""),
    "a KeyError": (KeyError("x"), False, False, None, ""),
}


@pytest.mark.parametrize("case", list(TABLE))
def test_every_storage_exception_has_its_exit_code(case):
    exc, writing, bucket_missing, expected, text = TABLE[case]
    uri = "/data/run" if "(local)" in case else URI
    got = classify(exc, uri, writing=writing, bucket_missing=lambda: bucket_missing, deadline_s=120)
    if expected is None:
        assert got is None
        return
    assert type(got) is expected, (case, got)
    assert text in str(got) and uri in str(got) and got.uri == uri, str(got)
    assert "\n" not in str(got)
    assert got.exit_code == (exit_codes.RETRIABLE if expected is R else exit_codes.USER_ERROR)


def test_a_refused_refresh_in_a_pod_is_retriable(monkeypatch):
    """GKE's metadata server can blip: in a pod a refused refresh restarts, on a laptop it is a login to redo."""
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    assert isinstance(classify(auth_exc.RefreshError("metadata"), URI), RetriableError)


def test_an_error_names_the_field_that_gave_its_uri():
    fields = {"output.uri": "gs://b/run", "model.source": "gs://b/run-model", "dataset.eval": None}
    with pytest.raises(UserError) as caught, naming_fields(fields):
        raise UserError("gs://b/run/checkpoints: bucket 'b' does not exist", uri="gs://b/run/checkpoints")
    assert str(caught.value).startswith("output.uri gs://b/run: gs://b/run/checkpoints: bucket")
    with pytest.raises(UserError) as caught, naming_fields(fields):
        raise UserError("x", uri="gs://b/run-model/config.json")  # the longest prefix at a `/`, not `gs://b/run`
    assert str(caught.value).startswith("model.source gs://b/run-model: x")
    with pytest.raises(RetriableError, match="^y$"), naming_fields(fields):
        raise RetriableError("y", uri="gs://other/x")


# --- on the wire: an HTTP proxy in front of the emulator ---------------------------------------

#: Seconds google-cloud-storage retries here (production: 120).
DEADLINE_S = 3


@pytest.fixture
def proxy(gcs_bucket, monkeypatch) -> Iterator[FaultProxy]:
    """The test process's GCS clients (google-cloud-storage, gcsfs) through a proxy in front of the session's emulator."""
    target = int(os.environ["STORAGE_EMULATOR_HOST"].rsplit(":", 1)[1])
    proxy = FaultProxy(target)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.env["STORAGE_EMULATOR_HOST"])
    monkeypatch.setenv(storage.RETRY_DEADLINE_ENV, str(DEADLINE_S))
    storage._client.cache_clear()
    gcsfs.GCSFileSystem.clear_instance_cache()
    yield proxy
    storage._client.cache_clear()
    gcsfs.GCSFileSystem.clear_instance_cache()
    proxy.close()


@pytest.fixture
def prefix(gcs_bucket, request) -> str:
    return f"gs://{gcs_bucket}/faults/{request.node.name.replace('[', '-').replace(']', '').replace(' ', '-')}"


def _is(method: str, *parts: str) -> Any:
    return lambda m, p: m == method and all(x in p for x in parts)


DOWNLOAD, UPLOAD, LIST = _is("GET", "alt=media"), _is("POST", "uploadType"), lambda m, p: m == "GET" and p.split("?")[0].endswith("/o")


def _statuses(proxy: FaultProxy) -> list[int]:
    return [status for _, _, status in proxy.log]


def test_bursts_of_503_and_429_and_a_dropped_connection_are_ridden_out(proxy, prefix):
    proxy.add(Fault(UPLOAD, status=429, times=2))
    proxy.add(Fault(DOWNLOAD, status=503, times=2))
    proxy.add(Fault(LIST, drop=True))
    storage.write_text(f"{prefix}/a.json", '{"ok": 1}')
    assert storage.read_text(f"{prefix}/a.json") == '{"ok": 1}'
    assert storage.listdir(prefix) == ["a.json"]
    assert _statuses(proxy).count(429) == 2 and _statuses(proxy).count(503) == 2 and 0 in _statuses(proxy)


def test_a_503_after_the_write_succeeded_leaves_one_whole_object(proxy, prefix):
    proxy.add(Fault(UPLOAD, status=503, after=True, times=2))
    storage.write_bytes(f"{prefix}/w.bin", b"x" * 1000)
    assert storage.read_bytes(f"{prefix}/w.bin") == b"x" * 1000
    assert [s for m, _, s in proxy.log if m == "POST"] == [503, 503, 200]


def test_a_503_after_a_delete_succeeded_is_no_missing_object(proxy, prefix):
    """The retried delete finds the object gone (404): its first attempt did the work."""
    for name in ("a", "b"):
        storage.write_text(f"{prefix}/tree/{name}", name)
    proxy.add(Fault(_is("DELETE"), status=503, after=True, times=2))
    storage.delete_tree(f"{prefix}/tree")
    assert not storage.exists(f"{prefix}/tree")
    assert 404 in [s for m, _, s in proxy.log if m == "DELETE"]  # the emulator's answer to a retry (the 503s hid the first)


def test_gcsfs_file_not_found_after_a_retried_delete_is_retriable(proxy, prefix):
    """What Orbax's directory operations (gcsfs, through etils.epath) raise when a delete's answer is lost:
    gcsfs retries the 503, the object is gone (404), and it raises FileNotFoundError. Writing, with the
    bucket there, that is a transient fault (it was exit 1); reading, a missing object (exit 3)."""
    storage.write_text(f"{prefix}/step/x", "x")
    proxy.add(Fault(_is("DELETE"), status=503, after=True))
    with pytest.raises(RetriableError, match=rf"storage fault while writing {prefix}/step: an object was gone when a retried request"):
        with storage.faults(f"{prefix}/step", writing=True):
            gcsfs.GCSFileSystem().rm_file(f"{prefix}/step/x")
    assert [s for m, _, s in proxy.log if m == "DELETE"] == [503, 404] and not storage.exists(f"{prefix}/step")
    with pytest.raises(UserError, match=rf"{prefix}/step does not exist"), storage.faults(f"{prefix}/step"):
        gcsfs.GCSFileSystem().cat_file(f"{prefix}/step/x")


@pytest.mark.parametrize(("fault", "message"), [
    (Fault(lambda m, p: True, status=503, times=None), "storage unreachable for 3s"),
    (Fault(lambda m, p: True, status=429, times=None), "storage unreachable for 3s"),
    (Fault(lambda m, p: True, delay_s=DEADLINE_S + 1, times=None), "storage unreachable for 3s"),
], ids=["503", "429", "slow answers"])
def test_an_outage_outlasting_the_deadline_is_retriable(proxy, prefix, fault, message):
    proxy.add(fault)
    start = time.monotonic()
    with pytest.raises(RetriableError, match=rf"{message} \({storage.RETRY_DEADLINE_ENV}\) while accessing {prefix}/p\.json"):
        storage.read_text(f"{prefix}/p.json")
    assert time.monotonic() - start < DEADLINE_S + 10
    # Retried before giving up (a slow answer takes the whole deadline: the request timeout is capped by it).
    assert fault.status is None or len(proxy.log) >= 2


@pytest.mark.parametrize(("status", "message"), [(403, "was denied"), (400, "storage refused a request")])
def test_a_refused_request_is_the_users_at_once(proxy, prefix, status, message):
    proxy.add(Fault(lambda m, p: True, status=status, times=None))
    with pytest.raises(UserError, match=rf"{message}.*{prefix}/p\.json|{prefix}/p\.json.*{message}"):
        storage.read_text(f"{prefix}/p.json")
    assert len([path for _, path, _ in proxy.log if "alt=media" in path]) == 1  # not retried


def test_a_missing_bucket_and_a_missing_object_are_told_apart(gcs_bucket, prefix):
    with pytest.raises(UserError, match=r"gs://no-such-bucket-22/x: bucket 'no-such-bucket-22' does not exist: create it"):
        storage.read_text("gs://no-such-bucket-22/x")
    with pytest.raises(UserError, match=rf"{prefix}/absent\.json does not exist: check the URI"):
        storage.read_text(f"{prefix}/absent.json")
    with pytest.raises(UserError, match="bucket 'no-such-bucket-22' does not exist"):
        storage.write_text("gs://no-such-bucket-22/x", "{}")


def test_the_cli_names_the_field_of_a_missing_bucket(gcs_bucket, tmp_path, capsys):
    """`lora-trainer train` in this process, and `convert` as a real process: exit 3, the field named."""
    import json

    from trainer_fixtures import train_config

    cfg = train_config(tmp_path, str(tmp_path / "run"), steps=1)
    cfg["dataset"]["train"] = "gs://no-such-bucket-22/data/train.jsonl"
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    assert cli.main(["train", "--config", str(tmp_path / "cfg.json")]) == exit_codes.USER_ERROR
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("lora-trainer train: error: dataset.train gs://no-such-bucket-22/data/train.jsonl: "), err
    assert "bucket 'no-such-bucket-22' does not exist" in err
    proc = subprocess.run(
        [LORA_TRAINER, "convert", "--from", "hf-peft", "--to", "orbax", "--source", "gs://no-such-bucket-22/adapter",
         "--out", str(tmp_path / "out"), "--base", str(tiny_llama())],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=trainer_env(),
    )
    assert proc.returncode == exit_codes.USER_ERROR, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lora-trainer convert: error: --source gs://no-such-bucket-22/adapter: ")
    assert "bucket 'no-such-bucket-22' does not exist" in lines[0] and not (tmp_path / "out").exists()


#: Saves an adapter-only checkpoint to each URI given, in its own process (TensorStore reads its endpoint
#: once per process); prints how each ended as one JSON line.
_SAVES = """
import json, sys
import numpy as np
from lora_trainer import checkpoint
from lora_trainer.errors import TrainerError
meta = {"family": "llama3", "baseModel": None, "rank": 2, "alpha": 4.0, "dropout": 0.0,
        "targetModules": "layers/0/attn/q_proj", "quantization": None, "modulePaths": ["layers/0/attn/q_proj"]}
tree = {"layers/0/attn/q_proj": {"w_lora_a": np.ones((8, 2), np.float32), "w_lora_b": np.ones((2, 4, 2), np.float32)}}
ended = {}
for root in sys.argv[1:]:
    try:
        checkpoint.write_lora(root, 0, tree, meta)
        ended[root] = "saved"
    except TrainerError as e:
        ended[root] = f"{type(e).__name__} {e.exit_code}: {e}"
print(json.dumps(ended))
"""


def test_tensorstore_faults_on_the_wire(proxy, prefix):
    """TensorStore (Orbax's arrays: `uploadType=media`) rides out a 503 burst and reports a 403 as the user's."""
    import json
    import sys

    def arrays_of(token: str) -> Any:
        return lambda m, p: "uploadType=media" in p and token in p

    proxy.add(Fault(arrays_of("flaky-arrays"), status=503, times=2))
    proxy.add(Fault(arrays_of("denied-arrays"), status=403, times=None))
    flaky, denied = f"{prefix}/flaky-arrays", f"{prefix}/denied-arrays"
    proc = subprocess.run([sys.executable, "-c", _SAVES, flaky, denied], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=trainer_env(**proxy.env, **{storage.RETRY_DEADLINE_ENV: str(DEADLINE_S)}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ended = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ended[flaky] == "saved" and storage.exists(f"{flaky}/0/commit_success.txt")
    assert ended[denied].startswith(f"UserError {exit_codes.USER_ERROR}: access to checkpoints at {denied} was denied ("), ended[denied]
    assert "PERMISSION_DENIED" in ended[denied] or "(HTTP 403: " in ended[denied], ended[denied]  # TensorStore says either
    assert not storage.exists(f"{denied}/0/commit_success.txt")
    assert [s for _, p, s in proxy.log if "flaky-arrays" in p and "uploadType=media" in p].count(503) == 2


def test_a_token_cache_hit_never_downloads_the_gs_data_file(proxy, prefix, tmp_path) -> None:
    """A restart names the tokenized entry by the object's MD5 and size from its metadata: a large
    gs:// dataset is not downloaded again. Proven on the wire: every download of it is refused."""
    from lora_trainer import data, token_cache
    from lora_trainer.config import DatasetSpec
    from lora_trainer.tiny_models import make_tiny_hf_model

    model_dir = make_tiny_hf_model("llama3", tmp_path / "model")
    rows = "".join(json.dumps({"prompt": f"Question {i}?", "completion": f" Answer {i}"}) + "\n" for i in range(6)).encode()
    uri = f"{prefix}/train.jsonl"
    storage.write_bytes(uri, rows)
    assert storage.md5_and_size(uri) is not None and token_cache._content_id(*storage.md5_and_size(uri)) == token_cache.content_id(rows)
    spec = DatasetSpec(train=uri, max_seq_len=16)

    def cache() -> token_cache.TokenCache:
        return token_cache.TokenCache(f"{prefix}/out/tokenized", model_dir, spec, data.Share(), primary=True)

    first, pad = cache().tokenized(uri)
    refused = proxy.add(Fault(lambda method, path: "train.jsonl" in path and "alt=media" in path, status=403, times=None))
    again, again_pad = cache().tokenized(uri)
    assert refused.hits == 0 and again_pad == pad
    assert [e.tokens.tolist() for e in again.examples] == [e.tokens.tolist() for e in first.examples]
    storage.write_bytes(uri, rows + rows)  # changed content: a miss, which must download it, and is refused
    with pytest.raises(Exception, match="(?i)denied|forbidden|403"):
        cache().tokenized(uri)
    assert refused.hits >= 1
