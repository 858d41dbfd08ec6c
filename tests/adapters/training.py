"""The JAX side of the export proofs: a tiny adapter trained by `run_training` itself."""

from __future__ import annotations

import json
from pathlib import Path

from lora_trainer.config import TrainConfig
from lora_trainer.train import run_training

#: Steps of every adapter trained here; each is checkpointed.
STEPS = 3


def train_adapter(base: Path, tmp: Path) -> str:
    """Train a rank-4 adapter on every projection of `base` for STEPS steps; returns the checkpoint root."""
    rows = [{"text": f"the quick brown fox {i} jumps over the lazy dog {i * 7}"} for i in range(8)]
    (tmp / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = TrainConfig.model_validate(
        {
            "model": {"source": str(base), "dtype": "float32"},
            "dataset": {"train": str(tmp / "train.jsonl"), "format": "text", "maxSeqLen": 16},
            "lora": {"rank": 4, "alpha": 8.0},
            # A high learning rate so that B moves far from zero in a few steps.
            "training": {"steps": STEPS, "globalBatchSize": 2, "learningRate": 0.05, "schedule": "constant", "checkpointEvery": 1},
            "output": {"uri": str(tmp / "run")},
        }
    )
    return str(run_training(cfg).checkpoint_root)
