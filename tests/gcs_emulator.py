"""A real GCS server on loopback for tests: `gcp-storage-emulator`, started once per session.

Why a real server and not mocks: the trainer reaches gs:// through three clients
(google-cloud-storage, gcsfs via etils.epath for Orbax directory operations, and
TensorStore for array data); each is pointed at the emulator by its own documented
endpoint setting, so tests run the production code path unchanged.

Use the `gcs_bucket` fixture (registered for every test by tests/conftest.py); it yields
the bucket name. Give each test its own prefix (e.g. `gs://{bucket}/{test name}/`) since
the server is shared by the session. Subprocesses inherit the environment. A test that needs
its own server starts one with `start_emulator` and passes `Emulator.env` to its subprocesses;
one that needs an outage puts a `Gate` in front of it and passes `Gate.env` instead.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

BUCKET = "lora-test"


def free_port() -> int:
    """A TCP port free on loopback now (for emulators, coordinators and probes the tests start)."""
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
    """Environment that points every GCS client at the emulator, each by its documented endpoint setting."""
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


def _wait_ready(url: str, proc: subprocess.Popen[bytes], stderr: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = stderr.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"gcp-storage-emulator exited with code {proc.returncode} before serving:\n{tail}")
        try:
            with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"gcp-storage-emulator did not answer on {url} within {timeout:.0f}s")


@dataclasses.dataclass
class Emulator:
    """One running gcp-storage-emulator process; `env` points every GCS client at it."""

    proc: subprocess.Popen[bytes]
    port: int

    @property
    def env(self) -> dict[str, str]:
        return emulator_env(self.port)

    def stop(self) -> None:
        """Terminate politely, then kill."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_emulator(*, bucket: str = BUCKET, port: int | None = None) -> Emulator:
    """A serving in-memory emulator with `bucket` created."""
    port = port or free_port()
    cmd = [_executable(), "start", "--host", "127.0.0.1", "--port", str(port), "--default-bucket", bucket, "--in-memory"]
    stderr = Path(tempfile.mkstemp(prefix="gcs-emulator-", suffix=".log")[1])
    atexit.register(stderr.unlink, missing_ok=True)
    with stderr.open("wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    emulator = Emulator(proc, port)
    try:
        _wait_ready(emulator.env["STORAGE_EMULATOR_HOST"], proc, stderr)
    except BaseException:
        emulator.stop()
        raise
    return emulator


class Gate:
    """A loopback TCP forwarder in front of a server: `cut()` is a storage outage on demand.

    Why not kill the server instead: gcp-storage-emulator rewrites its whole object index
    (`.meta`, JSON) in place on every write, so a server killed mid-write leaves it truncated and
    cannot start again on its data; real GCS loses nothing in an outage. Behind a gate the server
    and its objects live on; clients see their open connections reset and every new one refused
    (the gate's port is closed), which is what a dead endpoint looks like to them.
    """

    def __init__(self, target_port: int) -> None:
        self._target = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)  # so the accept loop sees `cut` promptly
        self.port = int(self._listener.getsockname()[1])
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._cut = threading.Event()
        threading.Thread(target=self._accept, name=f"gate-{self.port}", daemon=True).start()

    @property
    def env(self) -> dict[str, str]:
        """Environment that points every GCS client at the server through this gate."""
        return emulator_env(self.port)

    def cut(self) -> None:
        """From now on connections to the gate are refused; open ones are reset. Idempotent."""
        self._cut.set()
        self._listener.close()
        with self._lock:
            self._drop(*self._open)

    def _accept(self) -> None:
        while not self._cut.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed by `cut`
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self._target))
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._cut.is_set():
                    self._drop(client, upstream)
                    return
                self._open.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        """Copy src to dst until either end closes, then close both."""
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with self._lock:
            self._drop(src, dst)

    def _drop(self, *socks: socket.socket) -> None:
        """Reset and close `socks` (shutdown wakes a pump blocked in recv on them); hold the lock."""
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
            self._open.discard(sock)


@contextlib.contextmanager
def running_emulator(**kwargs: Any) -> Iterator[Emulator]:
    """`start_emulator` for the duration of a block."""
    emulator = start_emulator(**kwargs)
    try:
        yield emulator
    finally:
        emulator.stop()


@pytest.fixture(scope="session")
def gcs_bucket() -> Iterator[str]:
    """Start the emulator with an in-memory bucket, export the client env vars, yield the bucket."""
    with running_emulator() as emulator:
        saved = {k: os.environ.get(k) for k in emulator.env}
        try:
            os.environ.update(emulator.env)
            yield BUCKET
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
