"""`step_record`: the compiled train step kept under a fingerprint of what it was traced from.

A record taken for a program it was not built for would train the wrong program silently, so the
fingerprint must change with every input of a trace and must not change with anything else (a
moved project, another process). The restarts that take a record end to end are in
test_compile_cache (in one process) and test_resume (a new process each time, bit for bit).
"""

from __future__ import annotations

import importlib.metadata
import json
import pickle
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout
import numpy as np
import pytest
from trainer_fixtures import parse, stand_in_train_step, train_config, trainer_log

from lora_trainer import backend_start, step_preload, step_record


@pytest.fixture(autouse=True)
def _nothing_ahead() -> None:
    yield
    step_record._ahead.clear()


def _arguments(width: int = 8, dtype: Any = jnp.float32, sharding: Any = None) -> tuple[Any, ...]:
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return (jax.ShapeDtypeStruct((width, width), dtype, sharding=sharding),)


def _compiled(width: int = 8) -> jax.stages.Compiled:
    return jax.jit(stand_in_train_step).lower(*_arguments(width)).compile()


def _description(**changes: Any) -> dict[str, Any]:
    raw = train_config(Path("/data/a"), "/out/a")
    for dotted, value in changes.items():
        section, field = dotted.split(".")
        raw[section][field] = value
    return step_record.run_description(parse(raw), {"hidden_size": 64, "_name_or_path": "/models/a"}, "xla")


def test_the_fingerprint_follows_every_argument_and_everything_the_step_is_traced_from() -> None:
    base = step_record.fingerprint(_arguments(), {"config": 1})
    assert step_record.fingerprint(_arguments(), {"config": 1}) == base
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    others = [
        step_record.fingerprint(_arguments(16), {"config": 1}),
        step_record.fingerprint(_arguments(dtype=jnp.bfloat16), {"config": 1}),
        step_record.fingerprint(_arguments(sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())), {"config": 1}),
        step_record.fingerprint((*_arguments(), *_arguments()), {"config": 1}),
        step_record.fingerprint([*_arguments()], {"config": 1}),  # another tree
        step_record.fingerprint(_arguments(), {"config": 2}),
    ]
    assert len({base, *others}) == len(others) + 1


def test_the_run_description_leaves_out_where_inputs_and_outputs_lie_and_keeps_the_rest() -> None:
    """A project moved (its output, base, data and cache elsewhere) keeps its record; a constant of
    the program (a learning rate, a rank, a sequence length) or the base's shape gives another."""
    here = _description()
    moved_raw = train_config(Path("/elsewhere/data"), "/elsewhere/out")
    moved_raw["model"]["source"] = "/elsewhere/model"
    moved_raw["training"]["compilationCache"] = {"enabled": True}
    moved = step_record.run_description(parse(moved_raw), {"hidden_size": 64, "_name_or_path": "/elsewhere/model"}, "xla")
    assert moved == here
    assert "/out/a" not in json.dumps(here) and "/data/a" not in json.dumps(here)
    changed = [
        _description(**{"training.learningRate": 0.02}),
        _description(**{"lora.rank": 8}),
        _description(**{"dataset.maxSeqLen": 64}),
        _description(**{"model.dtype": "bfloat16"}),
        step_record.run_description(parse(train_config(Path("/data/a"), "/out/a")), {"hidden_size": 128}, "xla"),
        step_record.run_description(parse(train_config(Path("/data/a"), "/out/a")), {"hidden_size": 64}, "splash"),
    ]
    assert all(c != here for c in changed)


def test_another_process_computes_the_same_environment() -> None:
    """The fingerprint must not hold anything that differs between processes of the same run (an
    object's address, a worker's name): a restart is a new process."""
    code = ("import json, jax, numpy as np; from lora_trainer import step_record\n"
            "mesh = jax.sharding.Mesh(np.array(jax.devices()), ('data',))\n"
            "with mesh: print(json.dumps(step_record.environment(), sort_keys=True))")
    env = {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1", "PATH": "/usr/bin:/bin",
           "PYTHONPATH": ":".join(sys.path)}
    runs = [subprocess.run([sys.executable, "-c", code], env={**env, "TPU_WORKER_ID": str(i)}, capture_output=True,
                           text=True, timeout=120, check=True).stdout for i in range(2)]
    assert runs[0] == runs[1] and json.loads(runs[0])["trainer"]


def test_the_environment_names_every_installed_distribution_and_its_version() -> None:
    """Listed from the metadata folders' names, the distributions are those `importlib.metadata` parses."""
    listed = step_record.environment()["distributions"]
    for dist in importlib.metadata.distributions():
        name, version = dist.metadata["Name"], dist.version
        folder = f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}."
        assert any(entry.lower().startswith(folder) or entry.lower().startswith(f"{name.lower()}-{version}.") for entry in listed), (name, version)
    assert any(entry.startswith(f"jax-{jax.__version__}.") for entry in listed)


def test_a_kept_step_is_taken_for_its_own_fingerprint_and_arguments(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = str(tmp_path)
    step_record.save(cache, "k1", _compiled())
    assert step_record.take(cache, "k2", _arguments()) is None  # none for that fingerprint: traced, silently
    with trainer_log(caplog, "lora_trainer.step_record"):
        compiled = step_record.take(cache, "k1", _arguments())
    assert compiled is not None and "not traced again" in caplog.text
    x = jnp.arange(64, dtype=jnp.float32).reshape(8, 8) / 64
    np.testing.assert_array_equal(np.asarray(compiled(x)), np.asarray(jax.jit(stand_in_train_step)(x)))


def test_a_kept_step_that_does_not_take_the_arguments_is_not_used(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Belt and braces: a record under the right name for arrays of other shapes is refused, loudly."""
    step_record.save(str(tmp_path), "k1", _compiled(8))
    with trainer_log(caplog, "lora_trainer.step_record"):
        assert step_record.take(str(tmp_path), "k1", _arguments(16)) is None
    assert "argument 0 is float32[16, 16], the record's float32[8,8]" in caplog.text
    assert "traced and compiled as usual" in caplog.text


def test_a_program_does_not_take_arrays_on_other_devices_or_in_other_layouts() -> None:
    """What JAX's call of a compiled program refuses, where a jitted function would compile again."""
    compiled = _compiled(8)
    assert step_record.mismatch(compiled, _arguments(8)) is None
    x = jnp.ones((8, 8))
    assert step_record.mismatch(compiled, (x,)) is None
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    if len(jax.devices()) > 1:
        elsewhere = jax.device_put(x, jax.devices()[1])
        assert "is on" in step_record.mismatch(compiled, (elsewhere,))
    (program_format,), _ = compiled.input_formats
    transposed = Layout(major_to_minor=tuple(reversed(program_format.layout.major_to_minor)))
    assert "has the layout" in step_record.mismatch(compiled, _arguments(8), layouts=[transposed])
    assert step_record.mismatch(compiled, _arguments(8), layouts=[program_format.layout]) is None
    assert "another tree" in step_record.mismatch(compiled, [*_arguments(8)] * 2)
    assert step_record.mismatch(compiled, (jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec())),)) is None  # the same device, named: equivalent


@pytest.mark.parametrize("damage", ["truncated", "other layout"])
def test_a_damaged_record_is_not_used(tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str) -> None:
    step_record.save(str(tmp_path), "k1", _compiled())
    path = tmp_path / step_record.record_name("k1")
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:1000])
    else:
        _, *rest = pickle.loads(path.read_bytes())
        path.write_bytes(pickle.dumps((step_record.FORMAT + 1, *rest)))
    with trainer_log(caplog, "lora_trainer.step_record"):
        assert step_record.take(str(tmp_path), "k1", _arguments()) is None
    assert "did not use the compiled train step" in caplog.text


def test_a_cache_keeps_one_record_and_leaves_jax_s_entries(tmp_path: Path) -> None:
    (tmp_path / "jit__train_step-abc-cache").write_bytes(b"JAX's")
    step_record.save(str(tmp_path), "k1", _compiled())
    step_record.save(str(tmp_path), "k2", _compiled(16))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["jit__train_step-abc-cache", step_record.record_name("k2")]
    assert step_preload.newest(str(tmp_path), step_record.RECORDS).name == step_record.record_name("k2")


def test_a_restart_loads_the_kept_step_ahead_instead_of_jax_s_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At start (`backend_start`), the record the run kept is loaded on a thread and `take` hands it
    over; JAX's newest entry is loaded ahead only for a cache without a record."""
    raw = train_config(tmp_path, str(tmp_path / "out"), steps=1)
    cache = tmp_path / "out" / "compilation-cache"
    started: list[str | None] = []
    monkeypatch.setattr(step_preload, "start", started.append)

    monkeypatch.setattr(backend_start, "_pending", None)
    backend_start.start(parse(raw))
    backend_start.ready()
    assert started == [str(cache)] and not step_record._ahead  # no record: JAX's entry, as before

    step_record.save(str(cache), "k1", _compiled())
    monkeypatch.setattr(backend_start, "_pending", None)
    backend_start.start(parse(raw))
    backend_start.ready()
    assert started == [str(cache)]  # not again
    assert list(step_record._ahead) == [step_record.record_name("k1")]
    step_record._ahead[step_record.record_name("k1")].result(timeout=60)
    reads: list[str] = []
    monkeypatch.setattr(step_record, "load", reads.append)
    assert step_record.take(str(cache), "k1", _arguments()) is not None
    assert not reads and not step_record._ahead  # the load ahead taken, not a second read


def test_a_wrong_guess_loaded_ahead_is_dropped(tmp_path: Path) -> None:
    step_record.save(str(tmp_path), "k1", _compiled())
    assert step_record.preload(str(tmp_path))
    assert step_record.take(str(tmp_path), "k2", _arguments()) is None
    assert not step_record._ahead
    assert not step_record.preload(str(tmp_path / "none"))
