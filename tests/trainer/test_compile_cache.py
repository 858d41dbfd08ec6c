"""`training.compilationCache`: a restarted run loads its compiled train step instead of compiling it again (and
reads the data it tokenized, `token_cache`)."""

from __future__ import annotations

import logging
import os
import shutil
import signal

import jax
import jax.numpy as jnp
import pytest
from trainer_fixtures import cache_a_train_step, kept_step, parse, stand_in_train_step, train_config, trainer_log

from lora_trainer import compile_cache, data, step_preload
from lora_trainer.errors import Preempted
from lora_trainer.train import run_training


@pytest.mark.slow
def test_a_run_restarted_after_a_preemption_loads_its_train_step_from_the_cache(tmp_path, monkeypatch, caplog) -> None:  # noqa: ANN001
    monkeypatch.setattr(compile_cache, "MIN_LOCAL_COMPILE_SECONDS", 0.0)  # the tiny model's programs compile in milliseconds
    out = tmp_path / "out"
    cfg = parse(train_config(tmp_path, str(out), steps=4, checkpointEvery=4))
    before = jax.config.jax_compilation_cache_dir

    def preempt(record: dict) -> None:
        if record["step"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(Preempted):
        run_training(cfg, on_progress=preempt)
    cache = out / "compilation-cache"
    assert [p.name for p in cache.iterdir() if p.name.startswith("jit__train_step")], "the train step was not cached"
    assert jax.config.jax_compilation_cache_dir == before  # the process's own setting is back
    # Without the step the run kept (`step_record`: a trainer that kept none, or a record not written),
    # JAX's own entry is what a restart loads ahead.
    (cache / kept_step(str(cache))).unlink()

    decoy_entry = cache_a_train_step(tmp_path / "decoy", 8)  # another program under the step's name: a wrong guess
    jax.clear_caches()  # as a new process after the preemption: nothing compiled in memory
    decoy = step_preload.start(str(tmp_path / "decoy")).result(timeout=120)
    assert decoy is not None and decoy.key == decoy_entry.removesuffix("-cache")
    pending = step_preload.start(str(cache))  # what `lora-trainer train` loads ahead, at its start
    preloaded = pending.result(timeout=120) if pending is not None else None

    def no_tokenizer(model_dir: object) -> None:
        raise AssertionError("the restart loaded the tokenizer: the tokenized data should come from <output>/tokenized")

    monkeypatch.setattr(data, "load_tokenizer", no_tokenizer)
    with caplog.at_level(logging.DEBUG, logger="jax._src.compiler"), trainer_log(caplog, "lora_trainer.step_preload"):
        result = run_training(cfg)  # the same config, as the JobSet restarts it
    assert result.final_step == 4
    hits = [r.getMessage() for r in caplog.records if "Persistent compilation cache hit" in r.getMessage()]
    assert any("'jit__train_step'" in h for h in hits), hits
    assert preloaded is not None and any(f"with key '{preloaded.key}'" in h for h in hits), (preloaded, hits)
    assert f"JAX's read of the train step ({preloaded.key}) took the program loaded ahead" in caplog.text
    assert step_preload.taken(decoy.key, decoy.devices) is None  # dropped once the run's step was compiled


@pytest.mark.slow
def test_a_restart_calls_the_step_it_kept_without_tracing_it(tmp_path, monkeypatch, caplog) -> None:  # noqa: ANN001
    """The run keeps its compiled step under the fingerprint of what it was traced from; a restart
    with the same config calls it (JAX traces nothing of the step), and one that trains on with a
    changed learning rate and step count (constants of the program) traces its own and keeps it in
    place of the first."""
    out = tmp_path / "out"
    raw = train_config(tmp_path, str(out), steps=4, checkpointEvery=2)

    def preempt(record: dict) -> None:
        if record["step"] == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(Preempted):
        run_training(parse(raw), on_progress=preempt)
    first = kept_step(str(out / "compilation-cache"))
    jax.clear_caches()
    with caplog.at_level(logging.DEBUG, logger="jax._src.dispatch"), trainer_log(caplog, "lora_trainer.step_record"):
        assert run_training(parse(raw)).final_step == 4
    assert f"the train step is the one compiled earlier ({first}): not traced again" in caplog.text
    traced = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Finished tracing")]
    assert traced and not [m for m in traced if "_train_step" in m], traced  # other programs were traced, the step not

    caplog.clear()
    raw["training"].update(learningRate=0.02, steps=6)
    jax.clear_caches()
    with caplog.at_level(logging.DEBUG, logger="jax._src.dispatch"), trainer_log(caplog, "lora_trainer.step_record"):
        assert run_training(parse(raw)).final_step == 6
    assert "not traced again" not in caplog.text
    assert any("_train_step" in r.getMessage() for r in caplog.records if r.getMessage().startswith("Finished tracing"))
    kept_step(str(out / "compilation-cache"), other_than=first)  # the new record's write removes the old


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
    # Only the run's own cache gets its step loaded ahead and its step kept (`own_location`).
    assert compile_cache.own_location(default.training.compilation_cache, "gs://bkt/run") == "gs://bkt/run/compilation-cache"
    assert compile_cache.own_location(shared.training.compilation_cache, "gs://bkt/run") is None
    assert compile_cache.own_location(parse(off).training.compilation_cache, "gs://bkt/run") is None


def test_a_cache_copied_elsewhere_is_read_there(tmp_path) -> None:  # noqa: ANN001
    """Entries are keyed by the program, not by where the cache lies (a moved project directory's
    resume reads its train step instead of compiling it again)."""
    cache_a_train_step(tmp_path / "here", 8)
    shutil.copytree(tmp_path / "here", tmp_path / "moved")
    before = jax.config.jax_persistent_cache_enable_xla_caches
    jax.clear_caches()
    with compile_cache.persistent(str(tmp_path / "moved")):
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.jit(stand_in_train_step).lower(jax.ShapeDtypeStruct((8, 8), jnp.float32)).compile()
    assert sorted(os.listdir(tmp_path / "moved")) == sorted(os.listdir(tmp_path / "here"))  # read, nothing written anew
    assert jax.config.jax_persistent_cache_enable_xla_caches == before
