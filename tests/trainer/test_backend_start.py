"""`backend_start`: the runtime starts on a thread while the trainer imports, and its errors reach the caller."""

from __future__ import annotations

import threading
from pathlib import Path

import jax
import pytest
from trainer_fixtures import parse, train_config

from lora_trainer import backend_start, step_preload
from lora_trainer.background import in_background, settle
from lora_trainer.errors import UserError


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A process in which nothing started yet; records the thread each start of the runtime ran on."""
    monkeypatch.setattr(backend_start, "_pending", None)
    threads: list[str] = []
    real = backend_start._start_runtime

    def recorded() -> None:
        threads.append(threading.current_thread().name)
        real()

    monkeypatch.setattr(backend_start, "_start_runtime", recorded)
    return threads


def test_start_begins_the_runtime_on_its_thread_and_ready_waits_for_it(fresh: list[str]) -> None:
    backend_start.start()
    backend_start.start()  # once per process
    backend_start.ready()
    assert fresh[0] == "backend-start" and fresh.count("backend-start") == 1
    assert jax.devices()  # the backend is up
    backend_start.ready()  # again: idempotent


def test_a_bad_pod_environment_is_raised_in_the_thread_that_waits(fresh: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.delenv("JAX_PROCESS_COUNT", raising=False)
    backend_start.start()
    with pytest.raises(UserError, match="JAX_PROCESS_COUNT"):
        backend_start.ready()
    assert fresh[0] == "backend-start"


def test_ready_without_start_does_the_work_in_place(fresh: list[str]) -> None:
    backend_start.ready()
    assert fresh == [threading.current_thread().name]


def test_background_work_hands_back_its_result_or_its_error_from_a_daemon_thread() -> None:
    """Daemon: a process that stops early must not wait at its exit for a compile no one needs."""
    seen: list[threading.Thread] = []

    def work() -> int:
        seen.append(threading.current_thread())
        return 7

    assert in_background(work, "probe").result(timeout=30) == 7
    assert seen[0].name == "probe" and seen[0].daemon and seen[0] is not threading.current_thread()

    def fail() -> None:
        raise UserError("the pod's environment names no coordinator")

    with pytest.raises(UserError, match="names no coordinator"):
        in_background(fail, "probe").result(timeout=30)


def test_settle_waits_for_finish_first_work_only_and_no_longer_than_told() -> None:
    """An error printed before a kept step's log line was not stderr's last line (`cli._fail`)."""
    release_short, release_long, never = threading.Event(), threading.Event(), threading.Event()
    short = in_background(lambda: release_short.wait(30), "short", finish_first=True)
    other = in_background(lambda: never.wait(30), "other")  # not finish_first: settle does not wait for it
    threading.Timer(0.2, release_short.set).start()
    settle(10)
    assert short.done() and not other.done()
    stuck = in_background(lambda: release_long.wait(30), "stuck", finish_first=True)
    settle(0.1)  # bounded: it returns with the work still running
    assert not stuck.done()
    release_long.set()
    never.set()


def test_the_cached_train_step_is_loaded_ahead_from_the_runs_own_cache_only(
        fresh: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A cache shared between runs (`compilationCache.uri`) may hold another run's newest step, for other chips."""
    caches: list[str | None] = []
    monkeypatch.setattr(step_preload, "start", caches.append)
    own = train_config(tmp_path, str(tmp_path / "out"), steps=1)
    backend_start.start(parse(own))
    backend_start.ready()
    assert caches == [str(tmp_path / "out" / "compilation-cache")]

    monkeypatch.setattr(backend_start, "_pending", None)
    backend_start.start(parse({**own, "training": {**own["training"], "compilationCache": {"uri": str(tmp_path / "shared")}}}))
    backend_start.ready()
    assert caches == [str(tmp_path / "out" / "compilation-cache")]  # nothing more
