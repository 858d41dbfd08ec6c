"""Load the train step kept in the persistent compilation cache once, on a thread, as soon as the
runtime is up, and hand it to JAX when JAX reads that entry.

Why: on a v5e chip the first load of a cached train step in a process is slow and later loads of
the same program are not. A 1B-wide scanned step (52 MiB) took 7.0-7.5 s to deserialize the first
time and 0.55 s each time after, in the same process (docs/benchmarks.md, "Where a warm restart's
step load goes"). JAX reads the step from the cache only once it has traced and lowered it, about
20 s into a warm restart, so those seconds were on the restart's critical path. Their slow part is
native code that lets go of the GIL (the main thread kept over 90% of its pace beside it), so here
it runs while the trainer's modules import and the base model loads.

The entry loaded is a guess (the newest train step in the run's own cache, which after a preemption
is the one the run's last process used; a cache shared between runs is left alone, see
`backend_start`). It is handed over only when JAX's own read asks for the same key (JAX's key: a
hash of the lowered program, the compile options and the backend) on the same devices, in place of
JAX deserializing the entry a second time: freed at once and read again by JAX, that read still
took 2.7 s on the chip. A wrong guess costs this thread's time and the memory it holds until
`release()`; any error here is logged and dropped, and JAX reads its own entry as before.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, NamedTuple

import jax
from etils import epath
from jax._src import compilation_cache as jax_cache  # the entry's format and JAX's read of it
from jax._src.lib import xla_client

from lora_trainer.background import in_background

log = logging.getLogger(__name__)

#: The cache entries of the train step: XLA names the module `jit_<function>`, and the step's
#: function is Tunix's `_train_step` (see `tunix_trainer.StateStep`); JAX writes `<key>-cache`.
TRAIN_STEP_ENTRIES = "jit__train_step-*-cache"
_SUFFIX = "-cache"


class Loaded(NamedTuple):
    """A cache entry deserialized on devices: JAX's key for it, the program and its compile time."""

    key: str
    executable: Any
    compile_time: int | None
    devices: Any


_lock = threading.Lock()
#: Entries being or already loaded ahead, by JAX's key: taken once by JAX's read, or dropped by `release`.
_ahead: dict[str, Future[Loaded | None]] = {}


def newest(cache: str, pattern: str) -> epath.Path | None:
    """The file matching `pattern` most recently written to the cache at `cache` (local or gs://), if any."""
    entries = list(epath.Path(cache).glob(pattern))
    if not entries:
        return None
    return max(entries, key=lambda entry: (entry.stat().mtime, entry.name))


def newest_train_step(cache: str) -> epath.Path | None:
    """The train step most recently written to JAX's compilation cache at `cache`, if any."""
    return newest(cache, TRAIN_STEP_ENTRIES)


def load(entry: epath.Path) -> Loaded:
    """Read and deserialize the cache entry `entry` on this process's devices, as JAX's read would."""
    began = time.perf_counter()
    serialized, compile_time = jax_cache.extract_executable_and_time(jax_cache.decompress_executable(entry.read_bytes()))
    devices = jax.devices()
    device_list = xla_client.DeviceList(tuple(devices))
    executable = devices[0].client.deserialize_executable(serialized, executable_devices=device_list)
    log.info("loaded the train step compiled earlier (%s, %.0f MiB) in %.1fs, ahead of its first use",
             entry.name, len(serialized) / 2**20, time.perf_counter() - began)
    return Loaded(entry.name.removesuffix(_SUFFIX), executable, compile_time, device_list)


def start(cache: str | None) -> Future[Loaded | None] | None:
    """Find the newest train step in `cache` and load it on a daemon thread, for JAX's read of it;
    errors are logged there and dropped. None when the run keeps no cache."""
    if cache is None:
        return None
    _serve_jax_reads()

    def guarded() -> Loaded | None:
        try:
            entry = newest_train_step(cache)
            if entry is None:
                return None
            loading: Future[Loaded | None] = Future()
            with _lock:
                _ahead[entry.name.removesuffix(_SUFFIX)] = loading
            try:
                loaded = load(entry)
            except BaseException:
                loading.set_result(None)  # a read waiting on it goes on to JAX's own
                raise
            loading.set_result(loaded)
            return loaded
        except Exception as e:  # noqa: BLE001  (a head start only: JAX reads its own entry later)
            log.info("did not load the cached train step ahead (%s: %s); JAX reads it at the first step", type(e).__name__, e)
            return None

    return in_background(guarded, "step-preload")


def taken(cache_key: str, executable_devices: Any) -> tuple[Any, int | None] | None:
    """The program loaded ahead for JAX's key `cache_key` on `executable_devices`, once; None when
    there is none (or it was loaded on other devices). Waits for a load of that key still running."""
    with _lock:
        loading = _ahead.pop(cache_key, None)
    loaded = None if loading is None else loading.result()
    if loaded is None:
        return None
    if loaded.devices != executable_devices:
        log.info("the train step loaded ahead was for other devices; JAX reads its entry itself")
        return None
    log.info("JAX's read of the train step (%s) took the program loaded ahead", cache_key)
    return loaded.executable, loaded.compile_time


def release() -> None:
    """Drop what was loaded ahead and not taken (a wrong guess): called once the train step is compiled
    (`tunix_trainer.LoraPeftTrainer.compile_ahead`)."""
    with _lock:
        _ahead.clear()


def _serve_jax_reads() -> None:
    """Put `taken` in front of JAX's read of its persistent cache (`compilation_cache.get_executable_and_time`),
    once per process. Every read that `taken` does not answer is JAX's own, unchanged."""
    read = jax_cache.get_executable_and_time
    if getattr(read, "serves_loaded_ahead", False):
        return

    @functools.wraps(read)
    def get_executable_and_time(cache_key: str, compile_options: Any, backend: Any, executable_devices: Any) -> Any:
        return taken(cache_key, executable_devices) or read(cache_key, compile_options, backend, executable_devices)

    get_executable_and_time.serves_loaded_ahead = True  # type: ignore[attr-defined]
    jax_cache.get_executable_and_time = get_executable_and_time
