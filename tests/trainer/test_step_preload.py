"""`step_preload`: a restart loads the newest cached train step on a thread and JAX's read of that
entry takes it; a wrong guess or a failure there costs nothing.

That the entry it picks is the one a real restarted run reads is checked on a preempted run
(test_compile_cache), and that `lora-trainer train` starts it on a real restart, whose result stays
bit for bit an uninterrupted run's, in test_resume.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from etils import epath
from jax._src.lib import xla_client
from trainer_fixtures import cache_a_train_step, stand_in_train_step, trainer_log

from lora_trainer import compile_cache, step_preload


@pytest.fixture(autouse=True)
def _nothing_held() -> Iterator[None]:
    yield
    step_preload.release()


def _loaded(cache: Path | str) -> step_preload.Loaded | None:
    pending = step_preload.start(str(cache))
    assert pending is not None
    return pending.result(timeout=120)


def test_the_newest_train_step_is_loaded_and_other_programs_are_not(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = tmp_path / "cache"
    older = cache_a_train_step(cache, 8)
    newer = cache_a_train_step(cache, 16)
    (cache / "jit__eval_step-0123-cache").write_bytes(b"not a train step, never read")
    os.utime(cache / older, (1_000_000_000, 1_000_000_000))
    with trainer_log(caplog, "lora_trainer.step_preload"):
        loaded = _loaded(cache)
    assert loaded is not None and loaded.key == newer.removesuffix("-cache")
    assert f"loaded the train step compiled earlier ({newer}" in caplog.text
    os.utime(cache / newer, (999_999_999, 999_999_999))
    assert step_preload.newest_train_step(str(cache)).name == older


def test_jax_reading_the_entry_takes_the_program_loaded_ahead_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = tmp_path / "cache"
    entry = cache_a_train_step(cache, 16)
    jax.clear_caches()  # as a new process: nothing compiled in memory
    loaded = _loaded(cache)
    assert loaded is not None and loaded.key == entry.removesuffix("-cache")
    x = jnp.arange(256, dtype=jnp.float32).reshape(16, 16) / 256
    with compile_cache.persistent(str(cache)), trainer_log(caplog, "lora_trainer.step_preload"):
        got = jax.jit(stand_in_train_step)(x)
    assert f"JAX's read of the train step ({loaded.key}) took the program loaded ahead" in caplog.text
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.tanh(x @ x.T).sum(axis=0)))
    assert step_preload.taken(loaded.key, loaded.devices) is None  # once only: the program is JAX's now


def test_a_program_loaded_for_other_devices_is_not_taken(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = tmp_path / "cache"
    cache_a_train_step(cache, 8)
    loaded = _loaded(cache)
    assert loaded is not None
    with trainer_log(caplog, "lora_trainer.step_preload"):
        assert step_preload.taken(loaded.key, xla_client.DeviceList(())) is None
    assert "was for other devices; JAX reads its entry itself" in caplog.text


def test_a_wrong_guess_is_dropped_by_release(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache_a_train_step(cache, 8)
    loaded = _loaded(cache)
    assert loaded is not None
    step_preload.release()  # the run's step compiled under another key
    assert step_preload.taken(loaded.key, loaded.devices) is None


def test_nothing_to_load_and_no_cache_are_quiet(tmp_path: Path) -> None:
    assert _loaded(tmp_path) is None  # a first start: nothing compiled yet
    assert _loaded(tmp_path / "absent") is None
    assert step_preload.start(None) is None  # training.compilationCache.enabled: false


def test_an_unreadable_entry_is_logged_and_dropped_on_its_thread(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "jit__train_step-0123-cache").write_bytes(b"\x00\x00\x00\x07not zlib")
    with trainer_log(caplog, "lora_trainer.step_preload"):
        assert _loaded(tmp_path) is None
        assert step_preload.taken("jit__train_step-0123", None) is None  # JAX's read of it goes on to its own
    assert "did not load the cached train step ahead (error:" in caplog.text
    assert "JAX reads it at the first step" in caplog.text


def test_the_newest_entry_is_found_on_gcs(gcs_bucket: str) -> None:
    cache = epath.Path(f"gs://{gcs_bucket}/test_step_preload/cache")
    (cache / "jit__train_step-abc-cache").write_bytes(b"entry")
    (cache / "jit__other-def-cache").write_bytes(b"entry")
    assert step_preload.newest_train_step(str(cache)) == cache / "jit__train_step-abc-cache"
