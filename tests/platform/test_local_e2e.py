"""`lora-operator run-local` end to end on a tiny model: train a few steps, export, report.

Runs the real CLI in a subprocess (stdout is a pipe, so progress comes as plain lines), the way
`make demo` does, on the unit-test sized Llama-3 model and the shipped demo data.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from lora_trainer import checkpoint, exit_codes
from lora_trainer.tiny_models import make_tiny_hf_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LORA_OPERATOR = Path(sys.executable).with_name("lora-operator")


def manifest(tmp_path: Path, model: Path, **training: object) -> Path:
    doc = {
        "apiVersion": "lora-operator.dev/v1alpha1",
        "kind": "LoraFinetune",
        "metadata": {"name": "tiny-e2e"},
        "spec": {
            "model": {"source": str(model), "family": "llama3", "dtype": "float32"},
            "dataset": {"train": str(EXAMPLES / "data" / "train.jsonl"), "format": "prompt-completion", "maxSeqLen": 64},
            "lora": {"rank": 4, "alpha": 8},
            "training": {"steps": 6, "globalBatchSize": 4, "learningRate": 0.003, "checkpointEvery": 3, "logEvery": 1, **training},
            "output": {"uri": "out", "export": {"hfPeft": True, "merged": True}},
            "tpu": {"type": "v5p", "topology": "2x2x2"},
            "queueName": "tpu-v5p",
        },
    }
    path = tmp_path / "lft.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def run_local(path: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LORA_OPERATOR), "run-local", "-f", str(path)], cwd=cwd, capture_output=True, text=True, timeout=540)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model("llama3", tmp_path_factory.mktemp("tiny") / "llama")


def test_run_local_trains_exports_and_reports(tiny_model: Path, tmp_path: Path) -> None:
    proc = run_local(manifest(tmp_path, tiny_model), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"  # relative output.uri resolves against the manifest's directory

    # The same post-job export as on a cluster: an HF PEFT adapter and the merged model.
    config = json.loads((out / "hf-adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert (out / "hf-adapter" / "adapter_model.safetensors").stat().st_size > 0
    assert (out / "merged" / "config.json").exists()

    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    stdout = proc.stdout.splitlines()
    assert any("ignoring cluster-only fields tpu, queueName" in line for line in stdout)
    progress = [line for line in stdout if line.startswith("step ")]
    assert progress[0].startswith("step 1/6  loss ") and progress[-1].startswith("step 6/6  loss ")
    assert not [line for line in stdout if line.startswith("{")], "the trainer's JSON lines are replaced by the progress view"
    header = next(i for i, line in enumerate(stdout) if line.startswith("NAME "))
    assert stdout[header].split() == ["NAME", "PHASE", "TPU", "STEP", "LOSS", "RESTARTS", "PREEMPTIONS", "AGE"]
    row = stdout[header + 1].split()
    assert row[:2] == ["tiny-e2e", "Succeeded"] and "6/6" in row
    assert "adapter:      out/hf-adapter" in stdout  # relative to the working directory
    assert "loss curve:   out/loss.png" in stdout

    # Running it again finds the run finished: no training, the same export and the same table.
    again = run_local(manifest(tmp_path, tiny_model), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert not [line for line in again.stdout.splitlines() if line.startswith("step ")]
    lines = again.stdout.splitlines()
    assert lines[lines.index(stdout[header]) + 1].split()[:-1] == row[:-1]  # all but AGE


def test_run_local_trainer_error_is_one_paragraph_and_exit_3(tiny_model: Path, tmp_path: Path) -> None:
    path = manifest(tmp_path, tiny_model)
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["dataset"]["train"] = "data/missing.jsonl"
    path.write_text(yaml.safe_dump(doc))
    proc = run_local(path, cwd=tmp_path)
    assert proc.returncode == exit_codes.USER_ERROR, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lora-operator run-local:")]
    assert len(errors) == 1 and "missing.jsonl" in errors[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "hf-adapter").exists()


def test_ctrl_c_saves_a_checkpoint_and_a_rerun_resumes(tiny_model: Path, tmp_path: Path) -> None:
    """Ctrl-C stops after the current step once its checkpoint is saved: exit 130, one paragraph
    (a Ctrl-C in the middle of a save printed dozens of tracebacks from Orbax's threads and left a
    temporary step behind); the same command resumes from that step."""
    path = manifest(tmp_path, tiny_model, steps=400, checkpointEvery=1000)
    log = tmp_path / "stdout.log"
    with log.open("w") as out:
        proc = subprocess.Popen([str(LORA_OPERATOR), "run-local", "-f", str(path)], cwd=tmp_path, stdout=out,
                                stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while not [line for line in log.read_text().splitlines() if line.startswith("step 3/")]:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("lora-operator run-local:")]
    assert len(errors) == 1 and "interrupted: checkpoint step" in errors[0], stderr[-3000:]
    saved = checkpoint.committed_steps(str(tmp_path / "out" / "checkpoints"))
    assert len(saved) == 1 and f"checkpoint step {saved[0]} " in errors[0]
    assert [p.name for p in (tmp_path / "out" / "checkpoints").iterdir()] == [str(saved[0])]

    again = run_local(manifest(tmp_path, tiny_model, steps=saved[0] + 1, checkpointEvery=1000), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from step {saved[0]}" in again.stdout + again.stderr
    assert [line.split()[1] for line in again.stdout.splitlines() if line.startswith("step ")] == [f"{saved[0] + 1}/{saved[0] + 1}"]
