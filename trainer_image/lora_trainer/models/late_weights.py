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
"""

from __future__ import annotations

from collections import defaultdict

import jax
import numpy as np
from flax import nnx

from lora_trainer.models import layer_stack
from lora_trainer.models.loading import LoadedModel, placed
from lora_trainer.models.mapping import WeightRule, expand_rules
from lora_trainer.models.safetensors_io import SafetensorsCheckpoint


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


def read_into(model: nnx.Module, loaded: LoadedModel) -> None:
    """Replace each placeholder among `model`'s frozen weights with its values from `loaded`'s
    checkpoint, keeping its shape, type and placement. The variables are updated, not replaced:
    a train step built on them (`tunix_trainer.StateStep`) reads the values."""
    held = {"/".join(map(str, path)): var
            for path, var in nnx.to_flat_state(nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))}
    family, hf_config = loaded.family, loaded.hf_config
    entries = list(expand_rules(family.weights, hf_config, family.num_layers(hf_config)))
    tensors = SafetensorsCheckpoint(loaded.local_dir)
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
        arrays = [placed(np.asarray(rule.to_nnx(tensors.get(hf_key), shape)).astype(placeholder.dtype, copy=False), sharding)
                  for _, hf_key, rule in sorted(sources, key=lambda s: s[0] or 0)]
        value = layer_stack.stack_arrays(*arrays, sharding=placeholder.sharding) if stacked else arrays[0]
        del arrays
        if (value.shape, value.dtype, value.sharding) != (placeholder.shape, placeholder.dtype, placeholder.sharding):
            raise AssertionError(f"{path} holds {placeholder.shape} {placeholder.dtype} {placeholder.sharding} "
                                 f"but its tensors make {value.shape} {value.dtype} {value.sharding}")
        var.set_value(value)
    loaded.placeholders = False
