"""gs:// end to end on a real GCS server (gcp-storage-emulator): data in, checkpoints/metrics/progress out, resume."""

from __future__ import annotations

import json

import pytest
from trainer_fixtures import arithmetic_rows, kept_step, parse, train_config

from lora_trainer import checkpoint, storage
from lora_trainer.train import run_training


@pytest.mark.slow
def test_train_and_resume_on_gcs(gcs_bucket, tmp_path, capsys):
    run = f"gs://{gcs_bucket}/test_gcs/run"
    data = f"gs://{gcs_bucket}/test_gcs/data/train.jsonl"
    storage.write_text(data, "".join(json.dumps(r) + "\n" for r in arithmetic_rows(16)))
    cfg = train_config(tmp_path, run, steps=4, checkpointEvery=2, checkpointsToKeep=3)
    cfg["dataset"]["train"] = data

    first = run_training(parse(cfg))
    root = f"{run}/checkpoints"
    assert first.checkpoint_root == root and checkpoint.committed_steps(root) == [2, 4]
    # Orbax's gs:// commit marker is what makes those steps count.
    assert storage.exists(f"{root}/4/commit_success.txt")
    progress = json.loads(storage.read_text(f"{run}/progress.json"))
    assert progress["step"] == 4 and progress["lastCheckpoint"] == f"{root}/4"  # named once it committed
    assert [json.loads(x)["step"] for x in storage.read_text(f"{run}/metrics.jsonl").splitlines()] == [1, 2, 3, 4]
    assert any(n.startswith("events.out.tfevents") for n in storage.listdir(f"{run}/tensorboard"))
    kept = kept_step(f"{run}/compilation-cache")  # the compiled step kept for a restart (step_record), in the bucket
    capsys.readouterr()

    # More steps with the same output: resumes from gs:// and continues.
    cfg["training"]["steps"] = 6
    second = run_training(parse(cfg))
    assert "resuming from step 4" in capsys.readouterr().err
    assert second.final_step == 6 and checkpoint.latest_committed_step(root) == 6
    assert [json.loads(x)["step"] for x in storage.read_text(f"{run}/metrics.jsonl").splitlines()] == [1, 2, 3, 4, 5, 6]
    tree, meta = checkpoint.read_lora(root)
    assert meta["step"] == 6 and len(tree) == 7
    # Six steps are another schedule, so another program: kept in place of the first.
    kept_step(f"{run}/compilation-cache", other_than=kept)
