"""The base's weights read into a model built around placeholders, while the train step compiles.

Why: what the train step is compiled for (traced, lowered, and at a restart read from the
compilation cache: 6.5 s on a v5e host) depends on the weights' shapes, types and placements,
never on their values; and reading a 1B base took 3.7 s before LoRA was applied. So the trainer
builds the model with zeros where each weight goes (`load_model(placeholders=True)`, placed as
the weight will be), applies LoRA, rematerialisation and the layer stack to it, begins the step's
compilation on its thread, and only then reads the weights (`read_into`), into whichever variable
holds each one by then: the layer's own, or its layer's slice of the stack. Reading is mostly
file I/O and copies that let go of the GIL, which the tracing thread needs.

The values placed are those `load_model` places: the same conversion, type and sharding.
QLoRA loads the base whole: its quantized weights are computed from the values.

Where the devices have room for the weights beside their placeholders, the reading begins as soon
as the placeholders exist, on a thread (`read_ahead`): at a restart that calls the step kept by the
last start (`step_record`) nothing is traced, so the read was the end of the start-up's critical
path (2.5 s of a 1B base on a v5e host, begun 3.6 s after the placeholders). `read_into` then
takes each weight from that thread instead of reading it.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import defaultdict
from concurrent.futures import Future
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from lora_trainer.background import in_background
from lora_trainer.models import layer_stack
from lora_trainer.models.loading import LoadedModel, placed
from lora_trainer.models.mapping import WeightRule, expand_rules
from lora_trainer.models.safetensors_io import SafetensorsCheckpoint

log = logging.getLogger(__name__)
#: What the devices must keep free beyond the weights read ahead, in percent of them: the arrays a
#: start places meanwhile (LoRA, the optimizer's state, the train step's program) are small beside a base.
HEADROOM_PERCENT = 10


def targets(held: set[str], entries: list[tuple[str, str, WeightRule]]) -> dict[str, list[tuple[int | None, str, WeightRule]]]:
    """For each variable path in `held`, the checkpoint tensors its value is made of: `[(None, hf key,
    rule)]` for a weight in place, `[(layer, hf key, rule), ...]` for a stack of the layers' weights.
    `entries` are the family table's (hf key, nnx path, rule). A table path held nowhere, or a held
    base weight no tensor fills, is an error in the model's build (not the user's input). Pure."""
    found: dict[str, list[tuple[int | None, str, WeightRule]]] = defaultdict(list)
    for hf_key, nnx_path, rule in entries:
        if nnx_path in held:
            found[nnx_path].append((None, hf_key, rule))
            continue
        stacked = layer_stack.stacked_at(nnx_path)
        if stacked is None or stacked[0] not in held:
            raise AssertionError(f"the model holds no variable for {nnx_path} (tensor {hf_key}), in place or stacked")
        found[stacked[0]].append((stacked[1], hf_key, rule))
    unfilled = sorted(held - set(found))
    if unfilled:
        raise AssertionError(f"no checkpoint tensor fills the base weights {unfilled}")
    for path, sources in found.items():
        layers = [i for i, _, _ in sources]
        if layers != [None] and sorted(layers, key=lambda i: -1 if i is None else i) != list(range(len(layers))):
            raise AssertionError(f"{path} is filled from {[k for _, k, _ in sources]}: one tensor, or one per layer of a stack")
    return dict(found)


def _layer_sharding(stack: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """How one layer's slice of a stack placed as `stack` is placed (the stack's layer axis is never split)."""
    if isinstance(stack, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(stack.mesh, jax.sharding.PartitionSpec(*stack.spec[1:]))
    return stack


def _frozen_variables(model: nnx.Module) -> dict[str, nnx.Variable]:
    return {"/".join(map(str, path)): var
            for path, var in nnx.to_flat_state(nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))}


def _read(tensors: SafetensorsCheckpoint, hf_key: str, rule: WeightRule, shape: tuple[int, ...], dtype: np.dtype,
          sharding: jax.sharding.Sharding) -> jax.Array:
    """One checkpoint tensor converted as `load_model` converts it, placed with `sharding`."""
    return placed(np.asarray(rule.to_nnx(tensors.get(hf_key), shape)).astype(dtype, copy=False), sharding)


def bytes_per_device(arrays: list[jax.Array]) -> int:
    """What `arrays` take on the device that holds most of them (a shard each where they are split). Pure."""
    return max((sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in arrays if d in a.sharding.device_set)
                for d in {d for a in arrays for d in a.sharding.device_set}), default=0)


def has_room(needed: int, free: int | None) -> bool:
    """Whether `needed` bytes fit in `free` with `HEADROOM_PERCENT` to spare; unknown free memory is no room. Pure."""
    return free is not None and needed * (100 + HEADROOM_PERCENT) <= free * 100


def free_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The least memory free on this process's devices: their allocator's limit less what is in use;
    for the CPU, whose arrays live in host memory, the host's available memory (Linux). None if unknown."""
    stats = [d.memory_stats() for d in jax.local_devices()]
    if all(s and "bytes_limit" in s for s in stats):
        return min(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
    if jax.default_backend() != "cpu" or not meminfo.is_file():
        return None
    available = next((line.split()[1:] for line in meminfo.read_text().splitlines() if line.startswith("MemAvailable:")), None)
    return int(available[0]) * 1024 if available and available[1:] == ["kB"] else None


class Ahead:
    """The base's weights read and placed on a thread (`read_ahead`), each handed once to `read_into`.

    Each tensor is placed as its placeholder was when the thread began (a layer's own variable,
    before any stacking), which is how `read_into` places it. A failed read is raised again where
    `read_into` takes that tensor, or any after it."""

    def __init__(self, loaded: LoadedModel):
        held = _frozen_variables(loaded.model)
        family, hf_config = loaded.family, loaded.hf_config
        jobs = []
        for hf_key, nnx_path, rule in expand_rules(family.weights, hf_config, family.num_layers(hf_config)):
            value = held[nnx_path].get_value()
            jobs.append((hf_key, rule, tuple(value.shape), value.dtype, value.sharding))
        self._futures: dict[str, Future[jax.Array]] = {hf_key: Future() for hf_key, *_ in jobs}
        self._lock = threading.Lock()
        tensors = SafetensorsCheckpoint(loaded.local_dir)

        def read_all() -> None:
            for i, (hf_key, rule, shape, dtype, sharding) in enumerate(jobs):
                try:
                    self._futures[hf_key].set_result(_read(tensors, hf_key, rule, shape, dtype, sharding))
                except BaseException as e:  # noqa: BLE001  (raised again where read_into takes it)
                    for hf_key_left, *_ in jobs[i:]:
                        self._futures[hf_key_left].set_exception(e)
                    return

        in_background(read_all, "read-base-ahead")

    def take(self, hf_key: str) -> jax.Array:
        """Tensor `hf_key` as the thread placed it (waiting for it); the thread's reference is dropped."""
        with self._lock:
            future = self._futures.pop(hf_key)
        return future.result()


def read_ahead(loaded: LoadedModel) -> Ahead | None:
    """Begin reading `loaded`'s weights on a thread while its placeholders hold their places, if each
    device has room for both (logged either way); None leaves the whole read to `read_into`."""
    needed = bytes_per_device([var.get_value() for var in _frozen_variables(loaded.model).values()])
    free = free_bytes()
    gib = 2.0**30
    if not has_room(needed, free):
        log.info("the base's weights are read once the train step compiles: %.2f GiB a device beside their placeholders, "
                 "%s free", needed / gib, "unknown" if free is None else f"{free / gib:.2f} GiB")
        return None
    log.info("reading the base's weights ahead, on a thread (%.2f GiB a device beside their placeholders, %.2f GiB free)",
             needed / gib, free / gib)
    return Ahead(loaded)


def read_into(model: nnx.Module, loaded: LoadedModel, ahead: Ahead | None = None) -> None:
    """Replace each placeholder among `model`'s frozen weights with its values from `loaded`'s
    checkpoint (read now, or taken from `ahead`), keeping its shape, type and placement. The
    variables are updated, not replaced: a train step built on them (`tunix_trainer.StateStep`)
    reads the values."""
    held = _frozen_variables(model)
    family, hf_config = loaded.family, loaded.hf_config
    entries = list(expand_rules(family.weights, hf_config, family.num_layers(hf_config)))
    tensors = None if ahead is not None else SafetensorsCheckpoint(loaded.local_dir)
    for path, sources in targets(set(held), entries).items():
        var = held[path]
        value = var.get_value()
        # The placeholder is freed before its values are read: a stack's layers and the new stack are
        # then all the memory this weight takes at once, as when the eager load stacked it.
        placeholder = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=value.sharding)
        var.set_value(placeholder)
        del value
        stacked = sources[0][0] is not None
        sharding = _layer_sharding(placeholder.sharding) if stacked else placeholder.sharding
        shape = tuple(placeholder.shape[1:] if stacked else placeholder.shape)
        ordered = sorted(sources, key=lambda s: s[0] or 0)
        if ahead is None:
            arrays = [_read(tensors, hf_key, rule, shape, placeholder.dtype, sharding) for _, hf_key, rule in ordered]
        else:  # placed as the layer's own placeholder was, which a later placement (`_shard_optimizer`) may have renamed
            arrays = [a if a.sharding == sharding else jax.device_put(a, sharding) for a in (ahead.take(k) for _, k, _ in ordered)]
        value = layer_stack.stack_arrays(*arrays, sharding=placeholder.sharding) if stacked else arrays[0]
        del arrays
        if (value.shape, value.dtype, value.sharding) != (placeholder.shape, placeholder.dtype, placeholder.sharding):
            raise AssertionError(f"{path} holds {placeholder.shape} {placeholder.dtype} {placeholder.sharding} "
                                 f"but its tensors make {value.shape} {value.dtype} {value.sharding}")
        var.set_value(value)
    loaded.placeholders = False
