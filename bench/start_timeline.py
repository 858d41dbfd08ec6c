"""`lora-trainer` with its start-up's pieces timed on every thread: run by hand, never in CI.

    python bench/start_timeline.py train --config run.yaml

Prints to stderr, beside the trainer's own output, one line as each piece begins and ends:
"[t] +SECONDS THREAD PIECE begins|ends" (seconds from this process's start). The trainer's log
says when a milestone is reached; these lines say which thread was busy with what until then,
which is what a restart's critical path is made of (docs/benchmarks.md). `tpu_throughput.py
--restart-timed` runs a warm restart this way.

The pieces are wrapped once `lora-trainer train` has started the runtime and the step's preload
(`backend_start.start`), just before the trainer's own imports, so the process starts as the CLI does.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from typing import Any

BEGAN = time.perf_counter()
# The path as `python -m lora_trainer.cli` has it: the working directory first, not bench/. The step
# record's fingerprint lists the distributions on the path, so a restart run from here finds its record.
sys.path[0] = os.getcwd()

from lora_trainer import backend_start, cli  # noqa: E402  (light: the CLI imports the trainer lazily)


def mark(what: str) -> None:
    print(f"[t] +{time.perf_counter() - BEGAN:6.2f} {threading.current_thread().name:>20} {what}", file=sys.stderr, flush=True)


def timed(owner: Any, name: str) -> None:
    """Replace `owner.name` with a wrapper that marks its beginning and end."""
    function = getattr(owner, name)

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        mark(f"{name} begins")
        try:
            return function(*args, **kwargs)
        finally:
            mark(f"{name} ends")

    setattr(owner, name, wrapper)


def start_then_wrap(*args: Any, **kwargs: Any) -> Any:
    """The CLI's own start, then the pieces wrapped (importing what the CLI would import next)."""
    started = backend_start_start(*args, **kwargs)
    mark("runtime and preload started")
    from lora_trainer import checkpoint, step_record, train, tunix_trainer
    from lora_trainer.models import late_weights

    for owner, names in [
        (train._Run, ["_load_base", "_data", "_adapter", "_read_weights", "_resume"]),
        (train, ["set_lora_state"]),
        (late_weights, ["read_into"]),
        (tunix_trainer, ["make_trainer", "restore_optimizer_state"]),
        (tunix_trainer.LoraPeftTrainer, ["compile_ahead", "jit_train_and_eval_step", "train"]),
        (tunix_trainer.StateStep, ["compile"]),
        (step_record, ["environment", "fingerprint", "take", "mismatch"]),
        (checkpoint.TrainingCheckpoints, ["read"]),
        (checkpoint, ["placed_like"]),
    ]:
        for name in names:
            timed(owner, name)
    return started


backend_start_start = backend_start.start
backend_start.start = start_then_wrap

if __name__ == "__main__":
    sys.exit(cli.main())
