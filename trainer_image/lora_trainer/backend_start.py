"""Start JAX's runtime on a thread while the trainer's heavy modules import.

Why: every start of a training process, restarts after preemption included, pays both before
its first step. On a v5e host, starting the TPU runtime took 5.7-7.3 s and importing JAX,
Flax, Tunix, Qwix and Orbax 5.1 s, one after the other (docs/benchmarks.md, "Restart and
saves"). The runtime's start is native code that does not need the interpreter, and the
imports are Python that does not need the runtime, so the two can overlap.

`start()` is called by `lora-trainer train` before it imports the trainer; `ready()` is
where `run_training` needs the runtime. Given the run's config, `start()` then also loads the
train step kept in the run's compilation cache, on a thread of its own (`step_preload`).
`ready()` without a `start()` (tests, library use) does the same work in place (no preload),
and either way its effects are those of the calls it makes: malloc tuned before JAX's thread
pools exist, the multi-host run joined before the backend starts (JAX requires that order),
and an error raised there (a bad pod environment) raised again in the caller's thread, where
the CLI maps it to its exit code.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING

from lora_trainer import host_memory, trainer_logging
from lora_trainer.background import in_background

if TYPE_CHECKING:
    from lora_trainer.config import TrainConfig

_lock = threading.Lock()
_pending: Future[None] | None = None


def _start_runtime() -> None:
    """Join the multi-host run (nothing for one process), then start the backend."""
    import jax

    from lora_trainer import distributed

    distributed.initialize()
    jax.devices()


def _start_runtime_then_preload(cfg: TrainConfig | None) -> None:
    """`_start_runtime`, then (for a run keeping its own compilation cache) the load of the train
    step that the run kept begun on its own thread (`step_record`), or if it kept none, of the
    newest train step in JAX's cache (`step_preload`). Not from a cache shared with other runs
    (`compile_cache.own_location`): its newest train step may be another run's, compiled for other chips."""
    _start_runtime()
    if cfg is not None:
        from lora_trainer import compile_cache, step_preload, step_record

        cache = compile_cache.own_location(cfg.training.compilation_cache, cfg.output.uri)
        if cache is not None and not step_record.preload(cache):
            step_preload.start(cache)


def start(cfg: TrainConfig | None = None) -> None:
    """Tune malloc here, then join the run and start the backend on a daemon thread, and once it is
    up load `cfg`'s cached train step ahead (`step_preload`). Once per process."""
    global _pending
    with _lock:
        if _pending is not None:
            return
        host_memory.retain_freed_memory()  # before any JAX thread exists (see host_memory)
        trainer_logging.configure()  # joining a multi-host run, on the thread, logs
        _pending = in_background(lambda: _start_runtime_then_preload(cfg), "backend-start")


def ready() -> None:
    """Return once the runtime has started: wait for `start()`'s thread and raise its error, or
    do its work here if nothing started it. Idempotent: later calls cost nothing."""
    with _lock:
        pending = _pending
    if pending is not None:
        pending.result()
    else:
        host_memory.retain_freed_memory()
    _start_runtime()
