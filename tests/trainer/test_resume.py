"""Preemption and resume with real `lora-trainer` processes and real signals.

One scenario: an uninterrupted reference run (in this process); then a run that gets SIGTERM (saves at the
next step boundary, exits 42), is restarted, gets SIGKILL mid-training, is restarted
again and finishes. Its adapter must equal the reference's. Then a changed config is
refused against the same output.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from trainer_fixtures import finish, parse, progress_lines, start_trainer, train_config, write_config

from lora_trainer import checkpoint, exit_codes
from lora_trainer.errors import UserError
from lora_trainer.train import run_training

STEPS = 60
CKPT_EVERY = 10
#: One CPU device per trainer, whatever the test process uses.
ENV = {"JAX_NUM_CPU_DEVICES": "1", "JAX_PLATFORMS": "cpu"}


def _run_to_end(cfg_path: str, log: Path, timeout: float = 300) -> int:
    proc = start_trainer(cfg_path, log, **ENV)
    finish([proc], timeout)
    return proc.returncode


def _signal_when(proc: subprocess.Popen[bytes], log: Path, sig: int, min_step: int, timeout: float = 300) -> int:
    """Send `sig` once the trainer has printed progress for `min_step`; return the last step it had printed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = progress_lines(log)
        if lines and lines[-1]["step"] >= min_step:
            proc.send_signal(sig)
            return int(lines[-1]["step"])
        if proc.poll() is not None:
            pytest.fail(f"trainer exited with {proc.returncode} before step {min_step}:\n{log.read_text()[-3000:]}")
        time.sleep(0.01)
    proc.kill()
    pytest.fail(f"trainer did not reach step {min_step} in {timeout}s")


def _adapter(root: str) -> dict:
    tree, meta = checkpoint.read_lora(root)
    assert meta["step"] == STEPS
    return tree


@pytest.mark.slow
def test_sigterm_then_sigkill_then_resume_equals_uninterrupted_run(tmp_path):
    base = train_config(tmp_path, "", steps=STEPS, checkpointEvery=CKPT_EVERY, checkpointsToKeep=2, logEvery=1)
    run_cfg = write_config(tmp_path / "run.json", {**base, "output": {"uri": str(tmp_path / "run")}})
    root = str(tmp_path / "run" / "checkpoints")

    # The uninterrupted reference: in this process when it has one CPU device like the trainers, else a process.
    ref = {**base, "output": {"uri": str(tmp_path / "ref")}}
    if jax.device_count() == 1:
        run_training(parse(ref))
    else:
        assert _run_to_end(write_config(tmp_path / "ref.json", ref), tmp_path / "ref.log") == exit_codes.OK

    # 1. SIGTERM: checkpoint at the next step boundary, wait for the commit, exit PREEMPTED (restarted, not counted).
    log1 = tmp_path / "run1.log"
    proc = start_trainer(run_cfg, log1, **ENV)
    _signal_when(proc, log1, signal.SIGTERM, min_step=3)
    assert proc.wait(timeout=120) == exit_codes.PREEMPTED, log1.read_text()[-3000:]
    stopped = checkpoint.latest_committed_step(root)
    assert stopped is not None and 3 <= stopped < STEPS
    assert progress_lines(log1)[-1]["step"] == stopped  # saved exactly where it stopped
    assert "received SIGTERM" in log1.read_text()

    # 2. Restart, then SIGKILL after the next periodic checkpoint has committed.
    log2 = tmp_path / "run2.log"
    proc = start_trainer(run_cfg, log2, **ENV)
    # (Kill no later than 10 steps before the end, so the process cannot finish first.)
    next_ckpt = (stopped // CKPT_EVERY + 1) * CKPT_EVERY
    killed_after = _signal_when(proc, log2, signal.SIGKILL, min_step=min(next_ckpt + 1, STEPS - 10))
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert f"resuming from step {stopped}" in log2.read_text()
    assert killed_after < STEPS, "the run finished before it could be killed"
    resumed_at = checkpoint.latest_committed_step(root)
    assert resumed_at is not None and stopped <= resumed_at < STEPS

    # 3. Restart again: one line says where it resumes, and it finishes.
    log3 = tmp_path / "run3.log"
    assert _run_to_end(run_cfg, log3) == exit_codes.OK, log3.read_text()[-3000:]
    text = log3.read_text()
    assert text.count("resuming from step") == 1 and f"resuming from step {resumed_at}" in text
    assert "zeros until the checkpoint restores them" in text  # LoRA built from Qwix's forward traced, not run
    # The step the run kept, loaded at start on a thread, is called as it is: a new process computes the same
    # fingerprint (`step_record`), and the run below still ends bit for bit.
    assert "loaded the compiled train step train-step-" in text
    assert "not traced again" in text
    assert progress_lines(log3)[0]["step"] == resumed_at + 1

    ref, got = _adapter(str(tmp_path / "ref" / "checkpoints")), _adapter(root)
    diffs = [float(np.max(np.abs(ref[m][n] - got[m][n]))) for m in ref for n in ref[m]]
    assert max(diffs) <= 1e-6, max(diffs)
    # metrics.jsonl holds each step once, the redone steps replacing the killed run's.
    steps = [line["step"] for line in progress_lines(tmp_path / "run" / "metrics.jsonl")]
    assert steps == list(range(1, STEPS + 1))

    # A finished run restarted with the same config does nothing and succeeds.
    cfg = parse({**base, "output": {"uri": str(tmp_path / "run")}})
    assert run_training(cfg).final_step == STEPS
    assert checkpoint.latest_committed_step(root) == STEPS

    # A changed LoRA config is refused against the same output, naming what changed.
    changed = {**base, "output": {"uri": str(tmp_path / "run")}, "lora": {"rank": 8, "alpha": 16.0}}
    with pytest.raises(UserError, match=r"lora\.rank \(checkpoint: 4, config: 8\); lora\.alpha \(checkpoint: 8\.0, config: 16\.0\)"):
        run_training(parse(changed))
