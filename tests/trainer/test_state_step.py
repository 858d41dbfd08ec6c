"""`tunix_trainer.StateStep`: one jitted step over the arrays it changes, the frozen base read in place,
the donated inputs freed off the main thread, and no write to the base kept silently."""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from lora_trainer.tunix_trainer import StateStep


class _Adapted(nnx.Module):
    """A frozen weight, a LoRA factor that trains, and the optimizer over the factor only."""

    def __init__(self, lora: nnx.LoRAParam | None = None) -> None:
        self.base = nnx.Param(jnp.arange(6.0).reshape(2, 3))
        self.lora = lora if lora is not None else nnx.LoRAParam(jnp.ones((2, 3)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ (self.base[...] + self.lora[...])


def _train_step(model: _Adapted, optimizer: nnx.Optimizer, inputs: jax.Array) -> jax.Array:
    loss, grads = nnx.value_and_grad(lambda m: jnp.sum(m(inputs) ** 2), argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
    optimizer.update(model, grads)
    return loss


def _reference(model: _Adapted, steps: int, inputs: jax.Array) -> np.ndarray:
    """The LoRA factor after `steps` steps of the same update through `nnx.jit`."""
    optimizer = nnx.Optimizer(model, optax.sgd(0.01), wrt=nnx.LoRAParam)
    step = nnx.jit(_train_step)
    for _ in range(steps):
        step(model, optimizer, inputs)
    return np.asarray(model.lora[...])


def _step(model: _Adapted, body: Any = _train_step) -> tuple[StateStep, nnx.Optimizer]:
    optimizer = nnx.Optimizer(model, optax.sgd(0.01), wrt=nnx.LoRAParam)
    return StateStep(body, (model, optimizer), trained=nnx.LoRAParam), optimizer


def test_the_step_updates_the_trained_variables_in_place_and_reads_the_base():
    inputs = jnp.ones((4, 2))
    model = _Adapted()
    step, optimizer = _step(model)
    base = model.base.get_raw_value()
    losses = [float(step(inputs)) for _ in range(3)]
    assert model.base.get_raw_value() is base  # never returned, never replaced
    assert int(optimizer.step[...]) == 3
    assert losses[2] < losses[0]
    np.testing.assert_allclose(np.asarray(model.lora[...]), _reference(_Adapted(), 3, inputs), rtol=1e-6)
    assert step.jitted_fn._cache_size() == 1


def test_the_donated_inputs_are_freed_on_the_release_thread():
    """Freeing an array releases the GIL; on the main thread, during a save, that stalled each dispatch."""
    model = _Adapted()
    step, _ = _step(model)
    step(jnp.ones((4, 2)))  # compiled; from here on, every call donates the factor it was given
    freed_on: list[str] = []
    old = weakref.ref(model.lora.get_raw_value(), lambda _: freed_on.append(threading.current_thread().name))
    step(jnp.ones((4, 2)))
    deadline = time.monotonic() + 10
    while old() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert freed_on == ["lora-trainer-releases"]


def test_a_step_that_writes_the_frozen_base_is_refused():
    def _writes_base(model: _Adapted, optimizer: nnx.Optimizer, inputs: jax.Array) -> jax.Array:
        model.base[...] = model.base[...] * 0
        return jnp.sum(inputs)

    step, _ = _step(_Adapted(), _writes_base)
    with pytest.raises(RuntimeError, match="_writes_base wrote a frozen base weight"):
        step(jnp.ones((4, 2)))


def test_a_variable_with_value_hooks_is_written_through_them():
    """NNX's hooks run on `set_value`; raw access would skip them, so such variables are not accessed raw."""
    written: list[int] = []

    def hook(variable: nnx.Variable, value: jax.Array) -> jax.Array:
        written.append(1)
        return value

    model = _Adapted(nnx.LoRAParam(jnp.ones((2, 3)), on_set_value=hook))
    step, _ = _step(model)
    before = len(written)
    step(jnp.ones((4, 2)))
    assert len(written) == before + 1
    np.testing.assert_allclose(np.asarray(model.lora[...]), _reference(_Adapted(), 1, jnp.ones((4, 2))), rtol=1e-6)
