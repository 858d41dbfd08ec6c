"""`training.compilationCache`: a restarted run loads its compiled train step instead of compiling it again."""

from __future__ import annotations

import jax
import pytest
from trainer_fixtures import parse, train_config

from lora_trainer import compile_cache
from lora_trainer.train import run_training


@pytest.fixture
def cache_events() -> list[str]:
    """JAX's compilation-cache events (hits and misses of the persistent cache) while the test runs."""
    seen: list[str] = []

    def listener(event: str, **_: object) -> None:
        if event.startswith("/jax/compilation_cache/"):
            seen.append(event)

    jax.monitoring.register_event_listener(listener)
    yield seen
    jax.monitoring.unregister_event_listener(listener)


@pytest.mark.slow
def test_a_resumed_run_loads_its_train_step_from_the_cache(tmp_path, cache_events, monkeypatch, capsys) -> None:  # noqa: ANN001
    monkeypatch.setattr(compile_cache, "MIN_COMPILE_SECONDS", 0.0)  # the tiny model compiles in well under JAX's 1 s
    out = tmp_path / "out"
    cfg = train_config(tmp_path, str(out), steps=2, checkpointEvery=2)
    before = jax.config.jax_compilation_cache_dir
    run_training(parse(cfg))
    cache = out / "compilation-cache"
    assert sorted(p.name for p in cache.iterdir() if "train_step" in p.name), "the train step was not cached"
    assert jax.config.jax_compilation_cache_dir == before  # the process's own setting is back
    hits_first = cache_events.count("/jax/compilation_cache/cache_hits")

    jax.clear_caches()  # as a new process after a preemption: nothing compiled in memory
    cfg["training"]["steps"] = 4
    capsys.readouterr()
    run_training(parse(cfg))
    log = capsys.readouterr().err  # the trainer logs to stderr
    assert "resuming from step 2" in log and f"compiled programs are cached in {cache}" in log
    assert cache_events.count("/jax/compilation_cache/cache_hits") > hits_first + 1  # the train step among them


@pytest.mark.slow
def test_the_cache_can_be_off_or_elsewhere(tmp_path) -> None:  # noqa: ANN001
    off = train_config(tmp_path, str(tmp_path / "off"), steps=1)
    off["training"]["compilationCache"] = {"enabled": False}
    run_training(parse(off))
    assert not (tmp_path / "off" / "compilation-cache").exists()
    assert compile_cache.location(parse(off).training.compilation_cache, "gs://bkt/run") is None
    shared = parse({**off, "training": {**off["training"], "compilationCache": {"uri": "gs://bkt/jax-cache"}}})
    assert compile_cache.location(shared.training.compilation_cache, "gs://bkt/run") == "gs://bkt/jax-cache"
    default = parse({**off, "training": {**off["training"], "compilationCache": {}}})
    assert compile_cache.location(default.training.compilation_cache, "gs://bkt/run") == "gs://bkt/run/compilation-cache"
