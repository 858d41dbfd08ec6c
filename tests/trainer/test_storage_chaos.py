"""GCS faults on the wire: a training run and a conversion end as they do without them, and an outage
longer than the retry deadline ends in exit 42, after which a rerun resumes.

Real `lora-trainer` processes reach the session's GCS emulator through an HTTP proxy
(tests/gcs_proxy.py) that gives every client (google-cloud-storage, gcsfs, TensorStore) what real
GCS gives in a brownout, on a fixed schedule of requests: 503 and 429 answers, slow answers, 503s
after the write or delete succeeded, dropped connections. Meanwhile this process reads every
committed checkpoint step, and every published adapter, straight from the emulator: no reader may
ever see a torn one. Bounded: about a minute in all.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from gcs_proxy import Fault, FaultProxy
from trainer_fixtures import LORA_TRAINER, REPO, finish, parse, start_trainer, tiny_llama, train_config, trainer_env, write_config

from lora_trainer import checkpoint, exit_codes, storage
from lora_trainer.adapters.convert import convert
from lora_trainer.adapters.peft_format import LoraHyper, PeftLoraAdapter, write_peft_adapter
from lora_trainer.train import run_training

pytestmark = pytest.mark.slow

#: Seconds the trainers' gs:// calls retry here (production: 120).
DEADLINE_S = 5
#: One CPU device per trainer, and the short deadline.
ENV = {"JAX_NUM_CPU_DEVICES": "1", "JAX_PLATFORMS": "cpu", storage.RETRY_DEADLINE_ENV: str(DEADLINE_S)}
STEPS, EVERY = 4, 2
#: Restarts after exit 42 that a run gets here, as its JobSet (or a conversion's Job) would give them: a
#: fault that needs one (gcsfs's FileNotFoundError after a retried delete) is still a correct answer.
RESTARTS = 2


def _until_done(attempt: Callable[[int], int]) -> list[int]:
    """Exit codes of `attempt(i)`, repeated after each exit 42 (at most RESTARTS times)."""
    codes = [attempt(0)]
    while codes[-1] == exit_codes.RETRIABLE and len(codes) <= RESTARTS:
        codes.append(attempt(len(codes)))
    return codes


def _every(n: int, first: int, accepts: Callable[[str, str], bool] = lambda m, p: True) -> Callable[[str, str], bool]:
    """A request matcher for the `first`-th accepted request and every `n`-th after it (the proxy calls it under a lock)."""
    seen = [0]

    def matches(method: str, path: str) -> bool:
        if not accepts(method, path):
            return False
        seen[0] += 1
        return seen[0] >= first and (seen[0] - first) % n == 0

    return matches


def _from_first(accepts: Callable[[str, str], bool]) -> Callable[[str, str], bool]:
    """A request matcher for the first request `accepts` and every request after it (an outage)."""
    began = [False]

    def matches(method: str, path: str) -> bool:
        began[0] = began[0] or accepts(method, path)
        return began[0]

    return matches


def _writes(method: str, path: str) -> bool:
    """Uploads and deletes, but not the last request of a resumable upload session (`upload_id=`): real
    GCS answers its retry with the finished object, the emulator with a 404 (the session is gone), which
    gcsfs reports as FileNotFoundError and the trainer, rightly but needlessly here, as exit 42."""
    return method in ("POST", "PUT", "DELETE") and "upload_id=" not in path


def brownout(proxy: FaultProxy, scale: int) -> None:
    """The transient faults of one run, spread over its requests (`scale` thins them out: each costs its
    client a backoff of about a second)."""
    for fault in (
        Fault(_every(29 * scale, 5), status=503, times=None),
        Fault(_every(31 * scale, 9), status=429, times=None),
        Fault(_every(23 * scale, 3, _writes), status=503, after=True, times=None),  # the write was done
        Fault(_every(37 * scale, 14), delay_s=0.7, times=None),
        Fault(_every(41 * scale, 20, lambda m, p: m == "GET"), drop=True, times=None),
    ):
        proxy.add(fault)


class TornReader:
    """Reads, in a thread of this process and straight from the emulator, what `check` says a reader sees,
    every `period` seconds; collects anything other than a whole result."""

    def __init__(self, check: Callable[[], None], period: float = 1.0) -> None:
        self.check, self.period, self.torn, self.reads = check, period, [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.check()
                self.reads += 1
            except Exception as e:  # noqa: BLE001 - every failure is a finding
                self.torn.append(f"{type(e).__name__}: {e}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def _committed_steps_read_whole(root: str) -> Callable[[], None]:
    def check() -> None:
        for step in checkpoint.committed_steps(root):
            tree, meta = checkpoint.read_lora(root, step)
            assert meta["step"] == step and tree, step

    return check


@pytest.fixture
def proxy(gcs_bucket) -> Iterator[FaultProxy]:
    import os

    proxy = FaultProxy(int(os.environ["STORAGE_EMULATOR_HOST"].rsplit(":", 1)[1]))
    yield proxy
    proxy.close()


def test_training_through_a_brownout_ends_as_without_it(gcs_bucket, proxy, tmp_path):
    prefix = f"gs://{gcs_bucket}/chaos/train"
    base = train_config(tmp_path, "", steps=STEPS, checkpointEvery=EVERY, logEvery=1)
    reference = run_training(parse({**base, "output": {"uri": str(tmp_path / "reference")}}))  # local: only its numbers count
    run = f"{prefix}/run"
    root = f"{run}/checkpoints"
    cfg = write_config(tmp_path / "run.json", {**base, "output": {"uri": run}})
    reader = TornReader(_committed_steps_read_whole(root))
    try:
        # 1. A brownout, then an outage once step 2 is committed (saves are asynchronous: it begins
        # with the first request of step 4's save, which Orbax starts only after step 2's commit): exit
        # 42 within the deadline.
        brownout(proxy, scale=6)
        log1 = tmp_path / "outage.log"
        outage = _from_first(lambda m, p: f"checkpoints/{2 * EVERY}" in urllib.parse.unquote(p))
        proxy.add(Fault(outage, status=503, times=None), first=True)
        proc = start_trainer(cfg, log1, **ENV, **proxy.env)
        try:
            code = proc.wait(timeout=300)
        finally:
            finish([proc], 0.1)
        text = log1.read_text()
        assert code == exit_codes.RETRIABLE, text[-3000:]
        assert f"(retriable, exit {exit_codes.RETRIABLE}:" in text.strip().splitlines()[-1]
        stopped = checkpoint.latest_committed_step(root)
        assert stopped == EVERY, text[-3000:]

        # 2. Storage back, still browning out: the rerun resumes and finishes.
        proxy.clear()
        brownout(proxy, scale=6)
        def rerun(i: int) -> int:
            proc = start_trainer(cfg, tmp_path / f"resumed-{i}.log", **ENV, **proxy.env)
            finish([proc], 300)
            return proc.returncode

        codes = _until_done(rerun)
        text = (tmp_path / "resumed-0.log").read_text()
        assert codes[-1] == exit_codes.OK and set(codes[:-1]) <= {exit_codes.RETRIABLE}, (codes, text[-3000:])
        assert f"resuming from step {stopped}" in text
    finally:
        reader.stop()
    injected = [status for _, _, status in proxy.log if status in (0, 429, 503)]
    print(f"outage: exit {code}; reruns' exit codes {codes}; faults injected: {len(injected)}; "
          f"torn-step reads: {reader.reads}")
    assert len(injected) >= 5, proxy.log  # the brownout was real
    assert reader.torn == [] and reader.reads > 0

    # The same end state as the run without faults.
    assert checkpoint.committed_steps(root) == checkpoint.committed_steps(str(reference.checkpoint_root)) == [2, 4]
    got, meta = checkpoint.read_lora(root)
    want, _ = checkpoint.read_lora(str(reference.checkpoint_root))
    assert meta["step"] == STEPS and sorted(got) == sorted(want)
    assert max(float(np.max(np.abs(got[m][n] - want[m][n]))) for m in want for n in want[m]) <= 1e-6
    assert [json.loads(x)["step"] for x in storage.read_text(f"{run}/metrics.jsonl").splitlines()] == [1, 2, 3, 4]
    progress = json.loads(storage.read_text(f"{run}/progress.json"))
    assert progress["step"] == STEPS and progress["lastCheckpoint"] == f"{root}/{STEPS}"


def _peft_adapter(directory: Path) -> Path:
    """A random rank-4 PEFT adapter on q_proj and o_proj of the tiny Llama (hidden 64)."""
    rng = np.random.default_rng(7)
    modules = {
        f"model.layers.0.self_attn.{m}": (rng.standard_normal((4, 64)).astype(np.float32), rng.standard_normal((64, 4)).astype(np.float32))
        for m in ("q_proj", "o_proj")
    }
    directory.mkdir(parents=True)
    write_peft_adapter(directory, PeftLoraAdapter(LoraHyper(rank=4, alpha=8.0, target_modules=("o_proj", "q_proj")), modules))
    return directory


def _published_adapter_is_whole(uri: str, scratch: Path) -> Callable[[], None]:
    """A published adapter (its `_COMPLETE` marker written) converts whole; an unpublished one is not read."""

    def check() -> None:
        if storage.exists(f"{uri}/{storage.COMPLETE_MARKER}"):
            convert("hf-peft", "orbax", uri, str(scratch / f"read-{time.monotonic_ns()}"), base=str(tiny_llama()))

    return check


def test_conversions_through_a_brownout_end_as_without_it(gcs_bucket, proxy, tmp_path):
    prefix = f"gs://{gcs_bucket}/chaos/convert"
    storage.upload_dir(str(_peft_adapter(tmp_path / "peft")), f"{prefix}/peft")
    base = str(tiny_llama())
    convert("hf-peft", "orbax", f"{prefix}/peft", f"{prefix}/orbax-reference", base=base)
    convert("orbax", "hf-peft", f"{prefix}/orbax-reference", f"{prefix}/peft-reference", base=base)

    brownout(proxy, scale=2)
    reader = TornReader(_published_adapter_is_whole(f"{prefix}/peft-back", tmp_path), period=0.5)
    try:
        for argv in (
            ["--from", "hf-peft", "--to", "orbax", "--source", f"{prefix}/peft", "--out", f"{prefix}/orbax"],
            ["--from", "orbax", "--to", "hf-peft", "--source", f"{prefix}/orbax", "--out", f"{prefix}/peft-back"],
        ):
            errors: list[str] = []

            def attempt(_: int) -> int:
                proc = subprocess.run([LORA_TRAINER, "convert", *argv, "--base", base], capture_output=True, text=True,
                                      timeout=300, cwd=REPO, env=trainer_env(**ENV, **proxy.env))
                errors.append(proc.stderr[-3000:])
                return proc.returncode

            codes = _until_done(attempt)
            assert codes[-1] == exit_codes.OK and set(codes[:-1]) <= {exit_codes.RETRIABLE}, (codes, errors)
    finally:
        reader.stop()
    faults = [status for _, _, status in proxy.log if status in (0, 429, 503)]
    assert len(faults) >= 3, proxy.log
    assert reader.torn == [] and reader.reads > 0

    want, want_meta = checkpoint.read_lora(f"{prefix}/orbax-reference")
    got, got_meta = checkpoint.read_lora(f"{prefix}/orbax")
    assert got_meta == want_meta and all(np.array_equal(got[m][n], want[m][n]) for m in want for n in want[m])
    for name in ("adapter_model.safetensors", "adapter_config.json", storage.COMPLETE_MARKER):
        assert storage.read_bytes(f"{prefix}/peft-back/{name}") == storage.read_bytes(f"{prefix}/peft-reference/{name}"), name
    assert sorted(storage.listdir(f"{prefix}/peft-back")) == sorted(storage.listdir(f"{prefix}/peft-reference"))

