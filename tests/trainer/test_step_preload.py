"""`step_preload`: a restart loads the newest cached train step on a thread, and a failure there costs nothing.

That the entry it picks is the one JAX then reads is checked on a real preempted run
(test_compile_cache), and that `lora-trainer train` starts it on a real restart in test_resume.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from etils import epath

from lora_trainer import compile_cache, step_preload


def _cache_a_train_step(cache: Path, width: int) -> str:
    """Compile a program named as the trainer's step into the persistent cache at `cache`; its entry's name."""

    def _train_step(x: jax.Array) -> jax.Array:
        return jnp.tanh(x @ x.T).sum(axis=0)

    before = set(os.listdir(cache)) if cache.exists() else set()
    with compile_cache.persistent(str(cache)):
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.jit(_train_step).lower(jax.ShapeDtypeStruct((width, width), jnp.float32)).compile()
    (entry,) = {p for p in os.listdir(cache) if p.startswith("jit__train_step-")} - before
    return entry


def test_the_newest_train_step_is_loaded_and_other_programs_are_not(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = tmp_path / "cache"
    older = _cache_a_train_step(cache, 8)
    newer = _cache_a_train_step(cache, 16)
    (cache / "jit__eval_step-0123-cache").write_bytes(b"not a train step, never read")
    os.utime(cache / older, (1_000_000_000, 1_000_000_000))
    with caplog.at_level(logging.INFO, logger="lora_trainer.step_preload"):
        assert step_preload.preload(str(cache)) == newer
    assert f"loaded the train step compiled earlier ({newer}" in caplog.text
    os.utime(cache / newer, (999_999_999, 999_999_999))
    assert step_preload.newest_train_step(str(cache)).name == older


def test_nothing_to_load_and_no_cache_are_quiet(tmp_path: Path) -> None:
    assert step_preload.preload(str(tmp_path)) is None  # a first start: nothing compiled yet
    assert step_preload.preload(str(tmp_path / "absent")) is None
    assert step_preload.start(None) is None  # training.compilationCache.enabled: false


def test_an_unreadable_entry_is_logged_and_dropped_on_its_thread(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "jit__train_step-0123-cache").write_bytes(b"\x00\x00\x00\x07not zlib")
    with caplog.at_level(logging.INFO, logger="lora_trainer.step_preload"):
        pending = step_preload.start(str(tmp_path))
        assert pending is not None and pending.result(timeout=60) is None
    assert "did not load the cached train step ahead (error:" in caplog.text
    assert "JAX reads it at the first step" in caplog.text


def test_the_newest_entry_is_found_on_gcs(gcs_bucket: str) -> None:
    cache = epath.Path(f"gs://{gcs_bucket}/test_step_preload/cache")
    (cache / "jit__train_step-abc-cache").write_bytes(b"entry")
    (cache / "jit__other-def-cache").write_bytes(b"entry")
    assert step_preload.newest_train_step(str(cache)) == cache / "jit__train_step-abc-cache"
