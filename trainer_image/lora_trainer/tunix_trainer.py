"""Tunix's PeftTrainer as this trainer runs it: the loss and inputs, AdamW with the schedule, steps
jitted over the arrays they change, batches placed on the mesh, and its state as checkpoint items.

`train._Run` drives it one optimizer step at a time (`trainer.train([micro-batches])`) and owns
checkpoints, logging and stopping; this module owns what happens inside a step.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import variablelib
from jax.interpreters import pxla
from tunix.sft import inflight_throttler, peft_trainer, sharding_utils

from lora_trainer import schedule, step_preload, step_record
from lora_trainer.background import in_background
from lora_trainer.config import TrainingSpec
from lora_trainer.errors import UserError
from lora_trainer.loss import lm_loss, model_inputs
from lora_trainer.lora_provider import no_lora_dropout

log = logging.getLogger(__name__)

_REPLICATED = jax.sharding.PartitionSpec()
#: How every batch array is split: its rows over the mesh's data and fsdp axes together.
_BATCH = jax.sharding.PartitionSpec(("data", "fsdp"))


class LoraPeftTrainer(peft_trainer.PeftTrainer):
    """Tunix's PeftTrainer, keeping each micro-step's loss and token counts (the loss fn's aux)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.train_aux: list[dict[str, jax.Array]] = []
        self.eval_aux: list[dict[str, jax.Array]] = []
        self.is_managed_externally = True  # the run (`train._Run`) owns the step count, checkpoints and stopping
        self._throttler = _StepsInFlight(self.config.max_inflight_computations)
        self._ahead: Future[None] | None = None  # the train step compiling on a thread (`compile_ahead`)

    def _post_process_train_step(self, aux: Any) -> None:
        self.train_aux.append(aux)

    def compile_ahead(self, micro_batch: dict[str, jax.Array], records: step_record.Records | None = None) -> None:
        """Trace the train step for `micro_batch`'s shapes and compile it (or read it from the
        persistent compilation cache) on a thread; `train` waits for it. With `records`, a step
        kept by an earlier start of the run is called instead, neither traced nor lowered
        (`step_record`), and a step compiled here is kept for the next.

        A restart read the step from the cache only at its first step: on a v5e chip, tracing
        and 6.9 s of loading, after the checkpoint's restore. Ahead, they overlap the restore.
        The step is lowered for abstract arrays that carry each argument's sharding, which JAX
        caches as it would the call's own: the first call is neither traced nor compiled again.
        The thread enters the caller's legacy mesh and context variables, which tracing reads.
        """
        self.jit_train_and_eval_step()  # on this thread: the optimizer is placed before anything restores into it
        arguments = self.train_step.arguments(self.step_inputs(micro_batch))
        abstract = jax.tree.map(_abstract, arguments)
        layouts = [x.format.layout if isinstance(x, jax.Array) else None for x in jax.tree.leaves(arguments)]
        del arguments  # the placeholders are freed as their weights are read (`late_weights`)
        mesh, context = pxla.thread_resources.env.physical_mesh, contextvars.copy_context()

        def compile_step() -> None:
            try:
                with contextlib.nullcontext() if mesh.empty else mesh:
                    context.run(lambda: self.train_step.compile(abstract, layouts, records))
            finally:
                step_preload.release()  # JAX has read the step: a program loaded ahead and not taken was a wrong guess

        self._ahead = in_background(compile_step, "compile-ahead")

    def step_inputs(self, micro_batch: dict[str, jax.Array]) -> Any:
        """A micro-batch as Tunix's `train` hands it to the train step."""
        return sharding_utils.shard_input(self._prepare_inputs(micro_batch), self.config.data_sharding_axis)

    def train(self, *args: Any, **kwargs: Any) -> None:
        """Tunix's `train`, once the step `compile_ahead` began is compiled (its error raised here)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.result()
        super().train(*args, **kwargs)

    def _shard_optimizer(self, mesh: jax.sharding.Mesh) -> None:
        """Tunix's optimizer placement, then every replicated model/optimizer array on the mesh's `P()`.

        Called once, just before the train step is first jitted (after any resume/restore). The
        jitted step returns replicated arrays as `NamedSharding(mesh, P())`, while loading, Qwix
        and the optimizer's init leave some as `P(None, None, None)` or on a `SingleDeviceSharding`
        (e.g. the step counts): without this the step compiles a second time on its second call.
        Values are not touched (a placement only), so resumed runs stay bitwise identical.
        """
        super()._shard_optimizer(mesh)
        if not mesh.empty:
            for obj in (self.model, self.optimizer):
                nnx.update(obj, jax.tree.map(functools.partial(_replicated_on, mesh), nnx.state(obj)))

    def jit_train_and_eval_step(self, skip_jit: bool = False, cache_nnx_graph: bool = False) -> tuple[Any, Any]:
        """The train and eval steps, each one `jax.jit` over the arrays it changes (see `StateStep`).

        Tunix jits its steps with `nnx.jit`, which takes the whole model apart and puts it back in
        Python at every call. That Python is where a save hurt: Orbax's threads hold the GIL, and
        each dispatch waited for it once per release (see `StateStep`). `cache_nnx_graph` is moot:
        a `StateStep` finds the model's variables once.
        """
        if skip_jit or self._jitted_train_step_fn is not None:
            return super().jit_train_and_eval_step(skip_jit, cache_nnx_graph)
        self._shard_optimizer(pxla.thread_resources.env.physical_mesh)  # as Tunix does, before the first jit
        nodes = (self.model, self.optimizer)
        self.train_step = StateStep(self.create_train_step_fn(), nodes, trained=self.optimizer.wrt)
        evaluate = self.create_eval_step_fn()

        def _eval_step(model: nnx.Module, optimizer: nnx.Optimizer, inputs: Any) -> Any:
            return evaluate(model, inputs)

        eval_step = StateStep(_eval_step, nodes, trained=self.optimizer.wrt)
        # Tunix's train() calls these with the inputs alone and reads `.func.jitted_fn`, as it binds its own
        self._jitted_train_step_fn = functools.partial(self.train_step)
        self._jitted_eval_step_fn = functools.partial(eval_step)
        return self._jitted_train_step_fn, self._jitted_eval_step_fn

    def _eval_step(self, model: nnx.Module, inputs: Any) -> Any:
        """Tunix's eval step, traced without LoRA dropout so eval loss is deterministic."""
        with no_lora_dropout():
            return super()._eval_step(model, inputs)

    def _post_process_eval_step(self, aux: Any) -> None:
        self.eval_aux.append(aux)


class _StepsInFlight(inflight_throttler.InflightThrottler):
    """Tunix's throttler (at most `max_inflight_computations` micro-steps queued on the device),
    without its wait for every one of them at the end of each `train()` call.

    The run calls `train()` once per optimizer step, so that wait made every step synchronous: the
    chip idled while the host logged the step, read the next batches and dispatched them (the
    trainer reads a step's loss only when it has queued the next one, `train._Run._loop`). What
    must wait for the device (the loss, a save's snapshot, eval) blocks on its own arrays.
    """

    def wait_for_all(self) -> None:
        """Nothing: see the class."""


class StateStep:
    """A step `body(model, optimizer, inputs) -> outputs` as one `jax.jit` over flat lists of arrays:
    the frozen base passed in and never returned, everything else (LoRA, optimizer, RNG counts)
    passed in, donated and returned.

    Why not `nnx.jit`: it walks the whole model graph in Python to split it before each call and to
    put every returned array back after it: 11-18 ms per micro-batch of a 3B-wide model on the v5e
    host. While an Orbax save ran on other threads, the same dispatch took 112-580 ms, because the
    main thread waits for the GIL (up to the 5 ms switch interval) at each of its many releases; the
    chip idled between micro-batches (docs/benchmarks.md, "Restart and saves"). Here a call reads
    the raw arrays of variables found once, makes one C++ `jax.jit` dispatch and puts the changed
    arrays back raw. Raw, because NNX's `get_value`/`set_value` copy through `jax.tree.map` and ask
    each array's type: on the chip's host a profile put most of a 16 ms dispatch there. Variables
    with value hooks or array refs are read and written through NNX instead.

    Why the donated arrays die on another thread (`_Releases`): on the chip's host, freeing an array
    releases the GIL; putting the new arrays in place freed the old ones, about 340 for 8 layers of
    LoRA and AdamW state, and during a save that took 250-460 ms of the 490 ms dispatch.

    Why the base is not returned: `nnx.jit` returns every array it is given, so the base had to be
    donated to be aliased rather than copied; here it is an input only, read in place.

    The variables are found once: a model whose variables are replaced (not updated, as
    `nnx.update` does) after the step is built would be trained through stale ones.
    """

    def __init__(self, body: Any, nodes: tuple[Any, ...], *, trained: Any) -> None:
        frozen = nnx.All(nnx.Param, nnx.Not(trained))
        graph, frozen_state, carried_state = nnx.split(nodes, frozen, ...)
        self._frozen = [v for _, v in nnx.to_flat_state(frozen_state)]
        self._carried = [v for _, v in nnx.to_flat_state(carried_state)]
        self._raw = all(map(_raw_access, self._frozen + self._carried))
        frozen_def = jax.tree.structure(nnx.as_pure(frozen_state))
        carried_def = jax.tree.structure(nnx.as_pure(carried_state))
        #: Where each carried array lies when the step is first traced: the step returns it there.
        self._placements: list[Any] | None = None

        def step(frozen_values: list[jax.Array], carried_values: list[jax.Array], inputs: Any) -> tuple[list[jax.Array], Any]:
            frozen_in = jax.tree.unflatten(frozen_def, frozen_values)
            nodes_in = nnx.merge(graph, frozen_in, jax.tree.unflatten(carried_def, carried_values))
            outputs = body(*nodes_in, inputs)
            _, frozen_out, carried_out = nnx.split(nodes_in, frozen, ...)
            if any(a is not b for a, b in zip(jax.tree.leaves(nnx.as_pure(frozen_out)), frozen_values, strict=True)):
                raise RuntimeError(f"{step.__name__} wrote a frozen base weight; only the trained variables are kept")
            carried = jax.tree.leaves(nnx.as_pure(carried_out))
            return [_placed_as(x, where) for x, where in zip(carried, self._placements or [None] * len(carried), strict=True)], outputs

        step.__name__ = step.__qualname__ = body.__name__  # XLA's module and cache names
        self.jitted_fn = jax.jit(step, donate_argnums=1)
        #: A program kept by an earlier start of the run (`compile`), called in place of `jitted_fn`.
        self.compiled: jax.stages.Compiled | None = None
        self._unchecked = False
        self._releases = _Releases()

    def compile(self, arguments: tuple[Any, ...], layouts: list[Any], records: step_record.Records | None = None) -> None:
        """Compile the step for `arguments` (abstract arrays with their shardings; `layouts`, those of
        the arrays they stand for), or read it from JAX's persistent cache, so that the first call
        runs it. With `records`: the program kept under the same fingerprint if there is one (called
        as it is, neither traced nor lowered), else compiled here and then kept if this process
        writes and the program takes the arrays as they lie (`step_record.mismatch`)."""
        self._placements = [x.sharding for x in arguments[1]]
        key = None
        if records is not None:
            traced_from = {**records.traced_from, "step": self.jitted_fn.__name__, "environment": step_record.environment()}
            key = step_record.fingerprint(arguments, traced_from)
            self.compiled = step_record.take(records.cache, key, arguments, layouts)
            self._unchecked = self.compiled is not None
            if self.compiled is not None:
                return
        compiled = self.jitted_fn.lower(*arguments).compile()
        if key is None or records is None or not records.write:
            return
        if (problem := step_record.mismatch(compiled, arguments, layouts)) is None:
            step_record.keep(records.cache, key, compiled)
        else:
            log.info("the train step is not kept for a restart, which would not call it as compiled (%s)", problem)

    def arguments(self, inputs: Any) -> tuple[list[Any], list[Any], Any]:
        """What a call for `inputs` passes the jitted step: the frozen and carried arrays, and `inputs`."""
        if self._raw:
            return [v.get_raw_value() for v in self._frozen], [v.get_raw_value() for v in self._carried], inputs
        return [v.get_value() for v in self._frozen], [v.get_value() for v in self._carried], inputs

    def __call__(self, inputs: Any) -> Any:
        frozen, donated, inputs = self.arguments(inputs)
        if self._placements is None:  # traced at this call: the carried arrays stay where they are now
            self._placements = [x.sharding for x in donated]
        if self._unchecked:
            self._unchecked = False
            if (problem := step_record.mismatch(self.compiled, (frozen, donated, inputs))) is not None:
                log.warning("the train step compiled earlier does not take this run's arrays (%s); it is traced and "
                            "compiled again", problem)
                self.compiled = None
        carried, outputs = (self.jitted_fn if self.compiled is None else self.compiled)(frozen, donated, inputs)
        for variable, value in zip(self._carried, carried, strict=True):
            if self._raw:
                variable.set_raw_value(value)
            else:
                variable.set_value(value)
        self._releases.put(donated)  # now the list's references are the last ones
        return outputs

    def lower(self, inputs: Any) -> Any:
        """The step lowered for `inputs` (JAX's cached trace when it has run): for its compiled memory."""
        return self.jitted_fn.lower(*self.arguments(inputs))


class _Releases:
    """A daemon thread that empties the lists it is given: the arrays in them are freed there.

    Freeing the donated inputs on the main thread cost it the GIL once per array (see `StateStep`).
    The thread empties a list in place, so the arrays die there even if the caller still holds the list.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[list[Any]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def put(self, arrays: list[Any]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lora-trainer-releases", daemon=True)
            self._thread.start()
        self._queue.put(arrays)

    def _run(self) -> None:
        while True:
            self._queue.get().clear()


def _abstract(x: Any) -> Any:
    """An array as its shape, type and sharding (other leaves as they are)."""
    if not isinstance(x, jax.Array):
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=x.weak_type)


def _placed_as(x: jax.Array, sharding: Any) -> jax.Array:
    """`x` (traced) constrained to `sharding` when that names a mesh: a carried array returned where it
    came in. Else XLA places it as it sees fit: with tensor parallelism, LoRA factors passed replicated
    came back split over `tp`, so the second call, on other placements, compiled the step again (the
    program kept by `compile` refused them)."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.lax.with_sharding_constraint(x, sharding)
    return x


def _raw_access(variable: nnx.Variable) -> bool:
    """Whether `variable`'s value is its raw value both ways: no get/set hooks, not an array ref."""
    hooks = {"on_get_value", "on_set_value"} & set(variable.get_metadata())
    return not hooks and not variablelib.is_array_ref(variable.get_raw_value())


def _replicated_on(mesh: jax.sharding.Mesh, x: Any) -> Any:
    """`x` placed as `NamedSharding(mesh, P())` if it is a fully replicated array not already so placed."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(x, jax.Array) or sharding is None or not sharding.is_fully_replicated:
        return x
    named = isinstance(sharding, jax.sharding.NamedSharding)
    if named and sharding.mesh == mesh and sharding.spec == _REPLICATED:
        return x
    target = jax.sharding.NamedSharding(mesh, _REPLICATED)
    if not named and not target.is_fully_addressable:
        return x  # a one-device array onto a multi-process mesh: leave it to jit (a second compile, not an error)
    return jax.device_put(x, target)


def make_trainer(model: nnx.Module, t: TrainingSpec, *, splash: bool = False, interpret: bool = False) -> LoraPeftTrainer:
    """Tunix's PeftTrainer for `model` (which must hold LoRAParams) with AdamW + schedule, our loss and inputs.

    `splash`: the model attends with the splash kernel (`loss.model_inputs`); `interpret` runs it on the CPU (tests).

    Batches are sharded over the mesh's (data, fsdp) axes together; Tunix's own checkpointing is off.
    The steps donate the LoRA, optimizer and RNG arrays (see `StateStep`) and read the base in place.
    """
    if not jax.tree.leaves(nnx.state(model, nnx.LoRAParam)):
        raise UserError("the model has no LoRA parameters; refusing to train (the trainer would update every base weight)")
    trainer = LoraPeftTrainer(
        model,
        schedule.optimizer(t),
        peft_trainer.TrainingConfig(
            eval_every_n_steps=t.eval_every or t.steps,
            max_steps=None,
            gradient_accumulation_steps=t.gradient_accumulation if t.gradient_accumulation > 1 else None,
            checkpoint_root_directory=None,
            data_sharding_axis=tuple(_BATCH),
            pbar_description=None,
        ),
    )
    inputs = functools.partial(model_inputs, splash=splash, interpret=interpret)
    trainer.with_loss_fn(lm_loss, has_aux=True).with_gen_model_input_fn(inputs)
    return trainer


def on_mesh(batch: dict[str, np.ndarray], mesh: jax.sharding.Mesh) -> dict[str, jax.Array]:
    """A global batch (every host holds all of it) as global arrays, rows split over the mesh's
    (data, fsdp) axes: each host places only the rows its own devices hold.

    Tunix shards a per-host batch itself, deciding by the host's *local* shape: with several
    hosts, a micro-batch whose rows per host did not divide data x fsdp (2 hosts x 4 chips, 8
    rows) was declared replicated, and where the mesh did not split rows across hosts (tensor
    parallelism spanning them) each host's share was taken for the whole batch: every host trained
    on other rows, silently. Arrays already on the mesh with this sharding pass Tunix untouched.
    """
    sharding = jax.sharding.NamedSharding(mesh, _BATCH)
    return {k: jax.make_array_from_callback(v.shape, sharding, lambda index, v=v: v[index]) for k, v in batch.items()}


def compiled_memory(trainer: LoraPeftTrainer, micro_batch: dict[str, jax.Array]) -> str | None:
    """What the compiled train step needs on each device, as XLA planned it: arguments, outputs
    and temporaries (device memory statistics miss the temporaries between steps). None where the
    backend reports nothing (CPU). The step is already compiled: this reads its program.
    """
    compiled = trainer.train_step.compiled or trainer.train_step.lower(trainer.step_inputs(micro_batch)).compile()
    stats = compiled.memory_analysis()
    if stats is None or not stats.temp_size_in_bytes:
        return None
    gib = 2.0**30
    peak = stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes + stats.temp_size_in_bytes
    return (f"{peak / gib:.2f} GiB at peak = arguments {stats.argument_size_in_bytes / gib:.2f} + outputs "
            f"{stats.output_size_in_bytes / gib:.2f} - donated {stats.alias_size_in_bytes / gib:.2f} + temporaries "
            f"{stats.temp_size_in_bytes / gib:.2f}")


def weighted_loss(aux: list[dict[str, jax.Array]]) -> tuple[float, int, int]:
    """(token-weighted mean loss, loss tokens, tokens) over micro-steps; blocks on the device."""
    host = jax.device_get(aux)
    n = sum(float(a["target_tokens"]) for a in host)
    loss = sum(float(a["loss"]) * float(a["target_tokens"]) for a in host) / max(n, 1.0)
    return loss, int(n), sum(int(a["tokens"]) for a in host)


# --------------------------------------------------------------------------- state <-> checkpoint


def _flat_variables(state: nnx.State) -> dict[str, nnx.Variable]:
    """An NNX state's variables as `{"a/b/0/c": variable}`: string keys only, so Orbax stores any optimizer."""
    return {"/".join(map(str, path)): var for path, var in nnx.to_flat_state(state)}


def _read_flat(variables: dict[str, nnx.Variable]) -> dict[str, jax.Array]:
    """The values of `_flat_variables`, PRNG keys as their raw data."""
    out = {}
    for key, var in variables.items():
        value = var.get_value()
        if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
            value = jax.random.key_data(value)
        out[key] = value
    return out


def _load_flat(module: nnx.Module, which: Any, flat: dict[str, Any]) -> None:
    """Write a `_read_flat` dict back into `module`'s variables selected by `which` (same paths required)."""
    state = nnx.state(module, which)
    for path, var in nnx.to_flat_state(state):
        key = "/".join(map(str, path))
        old = var.get_value()
        new = flat[key]
        if jnp.issubdtype(old.dtype, jax.dtypes.prng_key):
            new = jax.random.wrap_key_data(new, impl=jax.random.key_impl(old))
        var.set_value(new)
    nnx.update(module, state)


def optimizer_state(trainer: LoraPeftTrainer) -> dict[str, Any]:
    """The `optimizer` item: optax state (with its step count) and the model's RNG state (dropout)."""
    return read_optimizer(optimizer_variables(trainer))


def optimizer_variables(trainer: LoraPeftTrainer) -> dict[str, dict[str, nnx.Variable]]:
    """The variables of the `optimizer` item; finding them walks the whole model graph."""
    return {"opt": _flat_variables(nnx.state(trainer.optimizer)), "rng": _flat_variables(nnx.state(trainer.model, nnx.RngState))}


def read_optimizer(variables: dict[str, dict[str, nnx.Variable]]) -> dict[str, Any]:
    """`optimizer_state` read through variables `optimizer_variables` found earlier."""
    return {item: _read_flat(found) for item, found in variables.items()}


def restore_optimizer_state(trainer: LoraPeftTrainer, saved: dict[str, Any]) -> None:
    """Put an `optimizer_state` item back (on resume): the schedule and dropout continue where they stopped."""
    _load_flat(trainer.optimizer, ..., saved["opt"])
    _load_flat(trainer.model, nnx.RngState, saved["rng"])
