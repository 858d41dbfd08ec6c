"""A real GCS server on loopback for tests: `gcp-storage-emulator`, started once per session.

Why a real server and not mocks: the trainer reaches gs:// through three clients
(google-cloud-storage, gcsfs via etils.epath for Orbax directory operations, and
TensorStore for array data); each is pointed at the emulator by its own documented
endpoint setting, so tests run the production code path unchanged.

Use the `gcs_bucket` fixture (registered for every test by tests/conftest.py); it yields
the bucket name. Give each test its own prefix (e.g. `gs://{bucket}/{test name}/`) since
the server is shared by the session. Subprocesses inherit the environment.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

BUCKET = "lora-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _executable() -> str:
    """The emulator console script of this interpreter's environment."""
    beside = Path(sys.executable).with_name("gcp-storage-emulator")
    found = str(beside) if beside.exists() else shutil.which("gcp-storage-emulator")
    if not found:
        raise RuntimeError("gcp-storage-emulator is not installed: pip install the `test` extra")
    return found


def emulator_env(port: int) -> dict[str, str]:
    """Environment that points every GCS client at the emulator (see shared/reference/README.md)."""
    url = f"http://127.0.0.1:{port}"
    return {
        "STORAGE_EMULATOR_HOST": url,  # google-cloud-storage, gcsfs
        "TENSORSTORE_GCS_HTTP_URL": url,  # TensorStore's gcs driver (Orbax array data)
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "dummy",  # TensorStore: skip the credential search
        "FSSPEC_GS_TOKEN": "anon",  # etils.epath builds gcsfs without arguments
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # else ~60 s per op asking the bucket type over gRPC
        "GCE_METADATA_HOST": "127.0.0.1:1",  # keep metadata-server probes on loopback
        "NO_GCE_CHECK": "True",
    }


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gcp-storage-emulator exited with code {proc.returncode} before serving")
        try:
            with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"gcp-storage-emulator did not answer on {url} within {timeout:.0f}s")


@pytest.fixture(scope="session")
def gcs_bucket() -> Iterator[str]:
    """Start the emulator with an in-memory bucket, export the client env vars, yield the bucket."""
    port = _free_port()
    proc = subprocess.Popen(
        [_executable(), "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory", "--default-bucket", BUCKET],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = emulator_env(port)
    saved = {k: os.environ.get(k) for k in env}
    try:
        _wait_ready(env["STORAGE_EMULATOR_HOST"], proc)
        os.environ.update(env)
        yield BUCKET
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
