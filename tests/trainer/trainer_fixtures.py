"""Shared by the trainer tests: one tiny Llama-3 checkpoint per test process, a learnable toy
dataset, and train configs; a runner for the real `lora-trainer` CLI as a subprocess; and a
reader of the dots in a compiled HLO module."""

from __future__ import annotations

import atexit
import contextlib
import fnmatch
import functools
import json
import logging
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lora_trainer import compile_cache, step_record, storage
from lora_trainer.config import TrainConfig
from lora_trainer.lora import lora_state
from lora_trainer.loss import lm_loss, model_inputs
from lora_trainer.tiny_models import make_tiny_hf_model

REPO = Path(__file__).resolve().parents[2]
LORA_TRAINER = str(Path(sys.executable).with_name("lora-trainer"))


def hlo_dots(hlo: str) -> list[tuple[list[str], tuple[str, list[str]], tuple[str, list[str]]]]:
    """Every dot of an optimized HLO module: (output dims, (lhs element type, dims), (rhs element type, dims)).

    Instruction names are module-unique, so operands are looked up by name across computations.
    """
    values = {name: (t, dims.split(",")) for name, t, dims in re.findall(r"%([\w.\-]+) = (\w+)\[([\d,]*)\]", hlo)}
    dots = re.findall(r"= \w+\[([\d,]*)\]\S* dot\(%([\w.\-]+), %([\w.\-]+)\)", hlo)
    return [(out.split(","), values[a], values[b]) for out, a, b in dots]


def dot_operand_types(hlo: str) -> list[tuple[str, str]]:
    """The element types of every dot's operands in an optimized HLO module."""
    return [(lhs[0], rhs[0]) for _, lhs, rhs in hlo_dots(hlo)]


def random_lora(model: nnx.Module) -> dict[str, dict[str, np.ndarray]]:
    """Non-zero LoRA params (seeded) shaped like `model`'s, so that B = 0 hides no layout bug."""
    rng = np.random.default_rng(7)
    return {p: {n: (0.1 * rng.standard_normal(np.shape(v))).astype(np.float32) for n, v in d.items()} for p, d in lora_state(model).items()}


def stand_in_train_step(x: jax.Array) -> jax.Array:
    """A small program that XLA names as the trainer's step (`jit__train_step`, as `StateStep` names it)."""
    return jnp.tanh(x @ x.T).sum(axis=0)


stand_in_train_step.__name__ = stand_in_train_step.__qualname__ = "_train_step"


def cache_a_train_step(cache: Path, width: int) -> str:
    """Compile `stand_in_train_step` for [width, width] into the persistent cache at `cache`; its entry's name."""
    before = set(os.listdir(cache)) if cache.exists() else set()
    jax.clear_caches()  # compiled here, not taken from an earlier test's compile in memory
    with compile_cache.persistent(str(cache)):
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.jit(stand_in_train_step).lower(jax.ShapeDtypeStruct((width, width), jnp.float32)).compile()
    (entry,) = {p for p in os.listdir(cache) if p.startswith("jit__train_step-")} - before
    return entry


def kept_step(cache: str, other_than: str | None = None, timeout: float = 60) -> str:
    """The name of the one step record in `cache` (local or gs://), once it has landed and is not
    `other_than`: records are written on a thread, and a new one replaces the old."""
    deadline = time.monotonic() + timeout
    while True:
        names = [n for n in storage.listdir(cache) if fnmatch.fnmatch(n, step_record.RECORDS)]
        if len(names) == 1 and names[0] != other_than:
            return names[0]
        assert time.monotonic() < deadline, f"no step record other than {other_than} alone in {cache}: {names}"
        time.sleep(0.05)


@contextlib.contextmanager
def trainer_log(caplog: pytest.LogCaptureFixture, name: str) -> Iterator[pytest.LogCaptureFixture]:
    """`caplog` capturing the trainer's logger `name` at INFO, also once `trainer_logging.configure()`
    has stopped the trainer's records reaching the root logger, where `caplog` listens."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.INFO)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)
        logger.setLevel(level)


@functools.cache
def tiny_llama() -> Path:
    """A 1-layer tiny Llama 3.1 checkpoint (hidden 64, vocab 272) with its tokenizer; built once per process."""
    root = Path(tempfile.mkdtemp(prefix="lora-test-model-"))
    atexit.register(shutil.rmtree, root, True)
    return make_tiny_hf_model("llama3", root / "llama3", seed=0, num_hidden_layers=1)


def arithmetic_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    """A learnable toy task: the completion follows from the prompt."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": f"Question: {a} + {b}?", "completion": f" Answer: {a + b}."})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def train_config(tmp: Path, output: str, **training: Any) -> dict[str, Any]:
    """A small train config (wire form) on the tiny model and the toy task."""
    data = write_jsonl(tmp / "data" / "train.jsonl", arithmetic_rows(32))
    return {
        "model": {"source": str(tiny_llama()), "dtype": "float32"},
        "dataset": {"train": data, "maxSeqLen": 32},
        "lora": {"rank": 4, "alpha": 8.0},
        "training": {
            "steps": 8,
            "globalBatchSize": 4,
            "learningRate": 0.01,
            "schedule": "cosine",
            "warmupSteps": 1,
            "checkpointEvery": 3,
            "checkpointsToKeep": 5,
            "logEvery": 1,
            **training,
        },
        "output": {"uri": output},
    }


def parse(cfg: dict[str, Any]) -> TrainConfig:
    return TrainConfig.model_validate(cfg)


def write_config(path: Path, cfg: dict[str, Any]) -> str:
    path.write_text(json.dumps(cfg))
    return str(path)


def trainer_env(**extra: str) -> dict[str, str]:
    """The test process's environment (emulator settings included) for a trainer subprocess."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra}
    env.pop("JAX_PLATFORMS", None)
    return env


def start_trainer(config_path: str, log_path: Path, **env: str) -> subprocess.Popen[bytes]:
    """`lora-trainer train --config FILE` as a real process; stdout+stderr to `log_path`."""
    log = log_path.open("wb")
    return subprocess.Popen([LORA_TRAINER, "train", "--config", config_path], stdout=log, stderr=subprocess.STDOUT, env=trainer_env(**env), cwd=REPO)


def finish(procs: list[subprocess.Popen[bytes]], timeout: float) -> list[tuple[bytes | None, bytes | None]]:
    """Each process's (stdout, stderr) once it exits (None where not piped); when one does not exit
    in time, every process still running is killed, so no trainer outlives its test."""
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def progress_lines(log_path: Path) -> list[dict[str, Any]]:
    """The JSON progress lines a trainer printed."""
    out = []
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def wait_for_step(proc: subprocess.Popen[bytes], log: Path, step: int, timeout: float = 300) -> None:
    """Block until the trainer has printed progress for `step` (so it has written progress.json)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = progress_lines(log)
        if lines and lines[-1]["step"] >= step:
            return
        if proc.poll() is not None:
            pytest.fail(f"trainer exited with {proc.returncode} before step {step}:\n{log.read_text()[-3000:]}")
        time.sleep(0.02)
    proc.kill()
    pytest.fail(f"trainer did not reach step {step} within {timeout}s")


def random_inputs(length: int = 32) -> dict[str, jax.Array]:
    """The loss's inputs for two unpacked rows of `length` random tokens (the same on every call)."""
    tokens = np.random.default_rng(0).integers(3, 200, (2, length)).astype(np.int32)
    ones = np.ones((2, length), np.int32)
    return model_inputs({"input_tokens": jnp.asarray(tokens), "input_mask": jnp.asarray(ones), "segment_ids": jnp.asarray(ones),
                         "positions": jnp.asarray(np.broadcast_to(np.arange(length), (2, length)).astype(np.int32))})


@nnx.jit
def loss_and_lora_grads(model: nnx.Module, inputs: dict[str, jax.Array]) -> tuple[jax.Array, nnx.State]:
    """Loss and LoRA gradients, as Tunix's train step forms them (nnx.jit over nnx.value_and_grad)."""
    return nnx.value_and_grad(lambda m: lm_loss(m, **inputs)[0], argnums=nnx.DiffState(0, nnx.LoRAParam))(model)


def flat_lora_grads(model: nnx.Module) -> tuple[float, dict[str, np.ndarray]]:
    """`loss_and_lora_grads` on two rows of 10 random tokens: the loss, and each LoRA param's gradient by path."""
    loss, grads = loss_and_lora_grads(model, random_inputs(10))
    return float(loss), {"/".join(map(str, k)): np.asarray(v.value) for k, v in nnx.to_flat_state(grads)}
