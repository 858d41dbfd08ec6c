"""A real storage outage: GCS becomes unreachable under a training run, which exits 42 promptly.

The run writes to gs:// on its own gcp-storage-emulator (not the session's shared server),
through a `Gate` (a TCP forwarder; see tests/gcs_emulator.py for why not kill the server). A
first run commits checkpoint step 2; a second one resumes from it, and once it is training the
gate is cut: open connections reset, new ones refused. It must exit with the retriable code
within the storage retry deadline (shortened here) plus shutdown, naming the URI. Then storage
is back with the same objects: only the complete checkpoint counts, and a restarted trainer
resumes from it.

The second run saves no checkpoint while the outage starts, so the fault hits google-cloud-storage
(progress.json). A save in flight meets it in TensorStore (Orbax's array data), whose own retries
(32, backoff to 32 s: about a quarter of an hour) lora_trainer.checkpoint bounds by the same
deadline: a separate test cuts TensorStore alone off from storage in the middle of a save.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gcs_emulator import Gate, free_port, start_emulator
from trainer_fixtures import REPO, progress_lines, start_trainer, train_config, trainer_env, wait_for_step, write_config

from lora_trainer import exit_codes, storage
from lora_trainer.errors import RetriableError, UserError

BUCKET = "outage"
RUN = f"gs://{BUCKET}/run"
#: Seconds the trainer's gs:// calls retry here (production: 120, see lora_trainer.storage).
DEADLINE_S = 5
#: One CPU device per trainer, whatever the test process uses; a short storage retry deadline.
ENV = {"JAX_NUM_CPU_DEVICES": "1", "JAX_PLATFORMS": "cpu", storage.RETRY_DEADLINE_ENV: str(DEADLINE_S)}
#: How long after the outage the trainer may take to exit: the deadline plus shutting down.
EXIT_WITHIN_S = DEADLINE_S + 25


def _steps(endpoint: dict[str, str]) -> dict[str, list[int]]:
    """Step directories and committed steps under the run's checkpoints, each committed step read in full."""
    script = (
        "import json, sys; from lora_trainer import checkpoint, storage; root = sys.argv[1]; "
        "steps = checkpoint.committed_steps(root); [checkpoint.read_lora(root, s) for s in steps]; "
        "print(json.dumps({'dirs': sorted(int(d) for d in storage.listdir(root) if d.isdigit()), 'committed': steps}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, f"{RUN}/checkpoints"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env=trainer_env(**ENV, **endpoint),
        cwd=REPO,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _run(cfg: dict[str, Any], name: str, tmp_path: Path, endpoint: dict[str, str]) -> tuple[subprocess.Popen[bytes], Path]:
    """Start a trainer on `cfg` whose GCS clients use `endpoint` (an emulator's or a gate's env)."""
    log = tmp_path / f"{name}.log"
    return start_trainer(write_config(tmp_path / f"{name}.json", cfg), log, **ENV, **endpoint), log


def _finish(proc: subprocess.Popen[bytes], log: Path) -> str:
    assert proc.wait(timeout=300) == exit_codes.OK, log.read_text()[-3000:]
    return log.read_text()


@pytest.mark.slow
def test_storage_outage_exits_retriable_promptly_then_resumes(tmp_path):
    emulator = start_emulator(bucket=BUCKET)
    try:
        # A committed checkpoint at step 2, then a long run resuming from it that saves no more:
        # the outage then hits the run's own gs:// writes (progress.json), not a checkpoint save.
        cfg = train_config(tmp_path, RUN, steps=2, checkpointEvery=2, logEvery=1)
        _finish(*_run(cfg, "first", tmp_path, emulator.env))
        long_run = {**cfg, "training": {**cfg["training"], "steps": 10_000, "checkpointEvery": 10_000}}
        gate = Gate(emulator.port)
        proc, log = _run(long_run, "outage", tmp_path, gate.env)
        try:
            wait_for_step(proc, log, 4)
            gate.cut()
            cut = time.monotonic()
            code = proc.wait(timeout=EXIT_WITHIN_S)
            took = time.monotonic() - cut
        finally:
            gate.cut()  # also when the run failed before the outage: no forwarder outlives the test
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        text = log.read_text()
        assert "resuming from step 2" in text
        assert code == exit_codes.RETRIABLE, text[-3000:]
        final = text.strip().splitlines()[-1]
        assert final.startswith("lora-trainer train: error: ") and f"gs://{BUCKET}/run/" in final, final
        assert f"(retriable, exit {exit_codes.RETRIABLE}:" in final
        print(f"exit {code} {took:.1f}s after the outage: {final}")

        # Storage is back with the same objects: the checkpoint is whole, nothing half-written
        # counts, and a restarted run resumes from it.
        assert _steps(emulator.env) == {"dirs": [2], "committed": [2]}
        text = _finish(*_run({**cfg, "training": {**cfg["training"], "steps": 3}}, "resumed", tmp_path, emulator.env))
        assert "resuming from step 2" in text and progress_lines(tmp_path / "resumed.log")[-1]["step"] == 3
    finally:
        emulator.stop()


#: A checkpoint save in its own process; prints how it ended as one JSON line.
_SAVE = """
import json, time, numpy as np
from lora_trainer import checkpoint
root = "%s/checkpoints"
meta = {"family": "llama3", "baseModel": "m", "rank": 2, "alpha": 4.0, "dropout": 0.0,
        "targetModules": ".*/q_proj", "quantization": None, "modulePaths": ["layers/0/attn/q_proj"]}
tree = {"layers/0/attn/q_proj": {"w_lora_a": np.ones((8, 2), np.float32), "w_lora_b": np.ones((2, 8), np.float32)}}
start, error = time.monotonic(), None
try:
    checkpoint.write_lora(root, 1, tree, meta)
except Exception as e:
    error = f"{type(e).__name__}: {e}"
took = time.monotonic() - start
print(json.dumps({"error": error, "seconds": took, "committed": checkpoint.committed_steps(root)}))
""" % RUN


def test_a_save_whose_array_writes_cannot_reach_storage_fails_retriable_within_the_deadline():
    """gcsfs (Orbax's directories) reaches the bucket, TensorStore (the arrays) finds nothing listening.

    Without the bound TensorStore would keep retrying for about a quarter of an hour (the
    subprocess would time out); with it the save fails as retriable about when the deadline
    says, and no step looks committed.
    """
    emulator = start_emulator(bucket=BUCKET)
    try:
        env = trainer_env(**{**ENV, **emulator.env, "TENSORSTORE_GCS_HTTP_URL": f"http://127.0.0.1:{free_port()}"})
        proc = subprocess.run([sys.executable, "-c", _SAVE], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    finally:
        emulator.stop()
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["error"] and result["error"].startswith("RetriableError: storage fault while accessing checkpoints at gs://"), result
    assert "retry attempts failed" in result["error"]
    assert result["seconds"] < EXIT_WITHIN_S, result
    assert result["committed"] == []


@pytest.mark.parametrize("deadline, attempts", [(1, 1), (5, 3), (120, 8), (900, 33)])
def test_tensorstore_gets_the_fewest_attempts_whose_backoff_covers_the_deadline(deadline, attempts):
    assert storage.tensorstore_gcs_retries(deadline) == {"max_retries": attempts, "initial_delay": "1s", "max_delay": "32s"}


@pytest.fixture
def unreachable_storage(monkeypatch) -> Iterator[None]:
    """google-cloud-storage pointed at a closed loopback port, with a 1 s retry deadline."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv(storage.RETRY_DEADLINE_ENV, "1")
    storage._client.cache_clear()
    yield
    storage._client.cache_clear()  # the next test's client honours its own environment again


@pytest.mark.parametrize(
    "call",
    [
        lambda: storage.write_text(f"{RUN}/progress.json", "{}"),
        lambda: storage.read_text(f"{RUN}/progress.json"),
        lambda: storage.exists(f"{RUN}/progress.json"),
        lambda: storage.listdir(f"{RUN}/checkpoints"),
    ],
    ids=["write", "read", "exists", "listdir"],
)
def test_unreachable_storage_is_retriable_after_the_deadline(unreachable_storage, call):
    start = time.monotonic()
    with pytest.raises(RetriableError, match=rf"storage unreachable for 1s \({storage.RETRY_DEADLINE_ENV}\) while accessing gs://{BUCKET}/run/"):
        call()
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("raw", ["0", "-3", "soon"])
def test_a_bad_retry_deadline_is_a_user_error(monkeypatch, raw):
    monkeypatch.setenv(storage.RETRY_DEADLINE_ENV, raw)
    with pytest.raises(UserError, match=storage.RETRY_DEADLINE_ENV):
        storage.retry_deadline()


def test_the_retry_deadline_defaults_to_the_clients_own(monkeypatch):
    monkeypatch.delenv(storage.RETRY_DEADLINE_ENV, raising=False)
    assert storage.retry_deadline() == storage.DEFAULT_RETRY_DEADLINE_S == 120.0


def test_the_process_ends_with_its_exit_code_even_if_a_thread_never_finishes():
    """What a save that failed mid-commit leaves behind: a non-daemon thread waiting forever."""
    script = """
import sys, threading
from lora_trainer import cli
from lora_trainer.errors import RetriableError

def save_failed_mid_commit(args):
    threading.Thread(target=threading.Event().wait).start()
    raise RetriableError("storage fault while accessing checkpoints at gs://b/run/checkpoints")

cli.EXIT_GRACE_S, cli._dispatch = 0.5, save_failed_mid_commit
sys.argv = ["lora-trainer", "train", "--config", "unused.yaml"]
sys.exit(cli.main())
"""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == exit_codes.RETRIABLE, proc.stderr
    assert proc.stderr.startswith("lora-trainer train: error: storage fault") and time.monotonic() - start < 30
