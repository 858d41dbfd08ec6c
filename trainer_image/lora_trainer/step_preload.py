"""Load the train step kept in the persistent compilation cache once, on a thread, as soon as the
runtime is up.

Why: on a v5e chip the first load of a cached train step in a process is slow and later loads of
the same program are not. A 1B-wide scanned step (52 MiB) took 7.0-7.5 s to deserialize the first
time and 0.55 s each time after, in the same process (docs/benchmarks.md, "Where a warm restart's
step load goes"). JAX reads the step from the cache only once it has traced and lowered it, about
20 s into a warm restart, so those seconds were on the restart's critical path. Their slow part is
native code that lets go of the GIL (the main thread kept over 90% of its pace beside it), so here
it runs while the trainer's modules import and the base model loads. JAX's own read of the step
then took 2.7 s instead of 6.9 s, and the restart 30.0-31.2 s instead of 33.0 s.

Only a head start: the entry loaded is a guess (the newest train step in the run's own cache, which
after a preemption is the one the run's last process used; a cache shared between runs is left
alone, see `backend_start`). JAX still computes its own key and reads its own entry; a wrong guess
costs this thread's time and nothing else, and any error here is logged and dropped. The loaded
program is freed at once: kept alive until JAX's read, that read took 5.6 s rather than 2.7 s.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

import jax
from etils import epath
from jax._src import compilation_cache as jax_cache  # the entry's format: JAX's compression and header
from jax._src.lib import xla_client

from lora_trainer.background import in_background

log = logging.getLogger(__name__)

#: The cache entries of the train step: XLA names the module `jit_<function>`, and the step's
#: function is Tunix's `_train_step` (see `tunix_trainer.StateStep`); JAX writes `<key>-cache`.
TRAIN_STEP_ENTRIES = "jit__train_step-*-cache"


def newest_train_step(cache: str) -> epath.Path | None:
    """The train step most recently written to the compilation cache at `cache` (local or gs://), if any."""
    entries = list(epath.Path(cache).glob(TRAIN_STEP_ENTRIES))
    if not entries:
        return None
    return max(entries, key=lambda entry: (entry.stat().mtime, entry.name))


def preload(cache: str) -> str | None:
    """Deserialize the newest train step in `cache` on this process's devices; its entry's name, or None when there is none."""
    entry = newest_train_step(cache)
    if entry is None:
        return None
    began = time.perf_counter()
    stored = entry.read_bytes()
    serialized, _ = jax_cache.extract_executable_and_time(jax_cache.decompress_executable(stored))
    devices = jax.devices()
    devices[0].client.deserialize_executable(serialized, executable_devices=xla_client.DeviceList(tuple(devices)))
    log.info("loaded the train step compiled earlier (%s, %.0f MiB) in %.1fs, ahead of its first use",
             entry.name, len(serialized) / 2**20, time.perf_counter() - began)
    return entry.name


def start(cache: str | None) -> Future[str | None] | None:
    """`preload(cache)` on a daemon thread, its errors logged there and dropped; None when the run keeps no cache."""
    if cache is None:
        return None

    def guarded() -> str | None:
        try:
            return preload(cache)
        except Exception as e:  # noqa: BLE001  (a head start only: JAX reads its own entry later)
            log.info("did not load the cached train step ahead (%s: %s); JAX reads it at the first step", type(e).__name__, e)
            return None

    return in_background(guarded, "step-preload")
