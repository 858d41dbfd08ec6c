"""JAX's persistent compilation cache for a training run (`training.compilationCache`).

Why: a run restarted after a preemption compiles its train step again before its first step:
90-175 s on a v5e chip for Llama-3.2-1B-shaped models (issue 21). With the compiled programs
kept under the run's output (or any location the spec names, gs:// included, through etils),
a restart of the same run on the same kind of chip loads them instead.

The cache is trusted code: whoever can write to it can make the trainer run any program. Its
default location is the run's own output, which only the run's identity writes; a location
shared between runs must be writable by those runs alone (docs/tutorial.md).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import jax
from jax.experimental.compilation_cache import compilation_cache

from lora_trainer import storage
from lora_trainer.config import CompilationCacheSpec

log = logging.getLogger(__name__)

#: Programs that compile faster than this are not worth a cache entry in a remote location (gs://,
#: a round trip each): JAX's own default.
MIN_COMPILE_SECONDS = 1.0
#: On local disk a program loads in milliseconds (8 ms for the smallest on a v5e host), so the many
#: small programs of a start are kept too: applying LoRA (Qwix's dummy forward, op by op) compiles
#: about 170 of them in every restart, most in 50-70 ms on a v5e chip (issue 21). A threshold of
#: 0.1 s had left those out: 10.9 s of a 57 s restart.
MIN_LOCAL_COMPILE_SECONDS = 0.02


def location(spec: CompilationCacheSpec, output_uri: str) -> str | None:
    """Where the run's compiled programs are kept: the spec's URI or `<output>/compilation-cache`; None when off."""
    if not spec.enabled:
        return None
    uri = spec.uri or storage.join(output_uri, "compilation-cache")
    return uri if storage.is_gcs(uri) else str(storage.absolute_local_path(uri))


def own_location(spec: CompilationCacheSpec, output_uri: str) -> str | None:
    """`location` when only this run writes there (`<output>/compilation-cache`); None when the cache
    is off or shared (`uri`). What only the run's own cache is trusted with: its newest train step
    loaded ahead (`step_preload`), and the step it keeps (`step_record`, a pickle), since a shared
    cache's newest step may be another run's, and each run's record would remove another's."""
    return None if spec.uri is not None else location(spec, output_uri)


@contextlib.contextmanager
def persistent(path: str | None) -> Iterator[None]:
    """Compile with the persistent cache at `path` (None: without one) for the duration, then put
    back whatever the process had, so one process can run several trainings (tests, local mode).

    JAX's own XLA caches beside it are off (`jax_persistent_cache_enable_xla_caches`): by default
    JAX names a GPU autotuning directory under the cache in every program's compile options, which
    are part of each entry's key. So the keys depended on where the cache lies: a cache copied or
    moved (a local project directory moved, which a resume follows) was never read again. The
    trainer compiles for TPU and CPU, where that directory is unused."""
    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs,
              jax.config.jax_persistent_cache_enable_xla_caches)
    if path == before[0]:
        yield
        return
    _use(path, MIN_LOCAL_COMPILE_SECONDS if path and not storage.is_gcs(path) else MIN_COMPILE_SECONDS, "")
    if path:
        log.info("compiled programs are cached in %s", path)
    try:
        yield
    finally:
        _use(*before)


def _use(path: str | None, min_seconds: float, xla_caches: str | None) -> None:
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_seconds)
    jax.config.update("jax_persistent_cache_enable_xla_caches", xla_caches)
    compilation_cache.reset_cache()  # JAX opens its cache once per process; a new directory needs a reset
