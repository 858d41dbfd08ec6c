"""Scanned decoder layers (`training.scanLayers`): the layers' frozen weights stacked, one layer body
compiled and run by `lax.scan`.

Why: XLA compiles an unrolled model layer by layer, so compile time grows with depth. On a v5e
chip a 16-layer 1B QLoRA step took 390 s to compile, so a 32-layer 8B QLoRA would take about 13
minutes on every new configuration. Scanned, the step holds one layer's program whatever the
depth (MaxText's `scan_layers`, Tunix's `nnx.scan`): the 8B QLoRA step compiled in 127 s.

How, without changing a path: the LoRA parameters stay in each layer (`layers/3/attn/q_proj/lora_a`),
so checkpoints, resume, export and `restoreFrom` see the model they always saw. Only the frozen
weights move, once, into `model.layer_stack` as `[layers, ...]` arrays (and leave the layers: no
second copy in memory). A forward pass stacks the layers' small LoRA parameters, and the one
layer body takes layer i's slice of both. The values are those of the unrolled model: the same
operations run in the same order.

A model scans only when its layers are one program: the same modules, variables, shapes and
static attributes. Gemma 3 is not (sliding-window and global layers), nor are a `lora.targetModules`
that adapts only some layers, nor LoRA dropout (its keys live in the modules, not in the scan's
carry); `stack_layers` says which, and the model is left as it was.

The cost, measured on a v5e chip (docs/benchmarks.md, "TPU"): the step is slower (1B 6%, 3B 20%
under `remat: dots`) and needs more memory, so scanning is asked for (`training.scanLayers`),
not the default.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from lora_trainer.errors import UserError
from lora_trainer.models.loading import SHARDING_KEYS

#: The layers of the model whose forward pass is being traced scanned (see `ScansLayers`).
_SCANNING: contextvars.ContextVar[tuple[list[nnx.Module], LayerStack] | None] = contextvars.ContextVar(
    "lora_trainer_scanning", default=None
)


class LayerStack(nnx.Module):
    """The frozen weights of every decoder layer, stacked on a leading axis, and one layer's graph."""

    def __init__(self, graphdef: Any, frozen: nnx.State):
        self.graphdef = graphdef
        self.frozen = nnx.data(frozen)


class ScansLayers:
    """Mixin for a family's top model class (before the Tunix class in its bases): with a
    `layer_stack` set, Tunix's layer loop runs the scan at the first layer and passes through the
    rest (see `use_decoder_layer`'s decoder layer, which asks `scanned_call`). Training and scoring
    only: decoding with a KV cache needs the layers' own weights."""

    layer_stack: LayerStack | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.layer_stack is None:
            return super().__call__(*args, **kwargs)  # type: ignore[misc]
        if (args[2] if len(args) > 2 else kwargs.get("cache")) is not None:
            raise NotImplementedError("a scanned model has no KV-cache (decoding) path: its layers hold only LoRA parameters")
        with _scanning(list(self.layers), self.layer_stack):  # type: ignore[attr-defined]
            return super().__call__(*args, **kwargs)  # type: ignore[misc]


def _run(stack: LayerStack, layers: list[nnx.Module], x: jax.Array, args: tuple[Any, ...], kwargs: dict[str, Any]) -> jax.Array:
    """`x` through every layer in order, as one `lax.scan` over (frozen slice, LoRA slice).

    A function, not a LayerStack method: Qwix finds the module a product runs in by the nearest
    frame whose `self` is a module, so no frame here may have one."""
    graphdef = stack.graphdef
    lora = jax.tree.map(lambda *v: jnp.stack(v), *[nnx.state(layer, nnx.LoRAParam) for layer in layers])

    def body(h: jax.Array, weights: tuple[nnx.State, nnx.State]) -> tuple[jax.Array, None]:
        layer = nnx.merge(graphdef, *weights)
        _, h = layer.unscanned_call(h, *args, **kwargs)
        return h, None

    h, _ = jax.lax.scan(body, x, (stack.frozen, lora))
    return h


@contextmanager
def _scanning(layers: list[nnx.Module], stack: LayerStack) -> Iterator[None]:
    token = _SCANNING.set((layers, stack))
    try:
        yield
    finally:
        _SCANNING.reset(token)


def scanned_call(layer: nnx.Module, x: jax.Array, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[None, jax.Array] | None:
    """What decoder layer `layer` returns inside a scanned forward pass (None outside one): the first
    layer runs them all, the others pass `x` on (Tunix's loop still calls each)."""
    active = _SCANNING.get()
    if active is None:
        return None
    layers, stack = active
    if layer is not layers[0]:
        return None, x
    _SCANNING.set(None)  # the scan body's layer runs unscanned
    try:
        return None, _run(stack, layers, x, args, kwargs)
    finally:
        _SCANNING.set(active)


def apply(model: nnx.Module, scan: bool) -> str:
    """Scan `model`'s layers if `training.scanLayers` asks; returns how they run, for the log.
    A model whose layers are not one program is a UserError naming why."""
    if not scan:
        return "unrolled"
    reason = stack_layers(model)
    if reason is not None:
        raise UserError(f"training.scanLayers is true, but {reason}; set training.scanLayers: false to unroll them")
    return "scanned"


def stack_layers(model: nnx.Module) -> str | None:
    """Move the frozen weights of `model`'s decoder layers into `model.layer_stack`; or, leaving
    the model as it was, the reason its layers are not one program.

    Each weight is stacked where it lies (same mesh, its sharding with the layer axis unsplit) and
    its per-layer arrays are released at once, so memory grows by one weight's stack at most.
    """
    if not isinstance(model, ScansLayers):
        return f"{type(model).__name__} has no scanned forward pass"
    layers = list(model.layers)  # type: ignore[attr-defined]
    reason = _not_one_program(layers)
    if reason:
        return reason
    graphdef = nnx.graphdef(layers[0])
    flat = [dict(nnx.to_flat_state(nnx.state(layer, nnx.Not(nnx.LoRAParam)))) for layer in layers]
    by_attribute: dict[tuple[Any, ...], list[tuple[Any, ...]]] = {}
    for path in flat[0]:
        by_attribute.setdefault(_module_attribute(layers[0], path), []).append(path)
    stacked: dict[tuple[Any, ...], nnx.Variable] = {}
    for attribute, paths in by_attribute.items():
        for path in paths:
            first = flat[0][path]
            values = [f.pop(path).get_value() for f in flat]
            stacked[path] = first.replace(jax.tree.map(stack_arrays, *values), **_with_layer_axis(first.get_metadata()))
            del values
        for layer in layers:
            _drop(layer, attribute)
    model.layer_stack = LayerStack(graphdef, nnx.from_flat_state(stacked))  # type: ignore[attr-defined]
    return None


def stacked_at(path: str) -> tuple[str, int] | None:
    """Where the weight a model held at `path` (`layers/3/attn/q_proj/w`) lives once `stack_layers`
    moved it: its stack's path (`layer_stack/frozen/attn/q_proj/w`) and its layer's index there.
    None for a path outside the decoder layers. Pure."""
    parts = path.split("/")
    if len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit():
        return "/".join(("layer_stack", "frozen", *parts[2:])), int(parts[1])
    return None


def _not_one_program(layers: list[nnx.Module]) -> str | None:
    """Why `layers` cannot share one scanned body, or None. Qwix names each adapted module by its
    path (`qwix_path`), which differs by the layer index only; the first layer's names then serve
    every layer once the rest is checked equal (a `targetModules` that picks layers changes the
    variables, which is checked)."""
    variable_kinds = {type(v).__name__ for layer in layers for _, v in nnx.to_flat_state(nnx.state(layer))}
    others = variable_kinds - {"Param", "LoRAParam"}
    if others:
        return f"the layers hold {', '.join(sorted(others))} variables (e.g. LoRA dropout's keys: set lora.dropout: 0 to scan)"
    names = {path: m.qwix_path for path, m in nnx.iter_modules(layers[0]) if hasattr(m, "qwix_path")}
    first = _signature(layers[0])
    for i, layer in enumerate(layers[1:], start=1):
        own = {}
        for path, m in nnx.iter_modules(layer):
            if hasattr(m, "qwix_path"):
                own[path] = m.qwix_path
                m.qwix_path = names.get(path, m.qwix_path)
        same = _signature(layer) == first
        for path, m in nnx.iter_modules(layer):
            if path in own:
                m.qwix_path = own[path]
        if not same:
            return f"decoder layer {i} differs from layer 0 (its modules, weights or settings)"
    return None


def _signature(layer: nnx.Module) -> tuple[Any, ...]:
    """A layer's graph and its weights' shapes and dtypes: equal for layers one program can run."""
    graphdef, state = nnx.split(layer)
    return graphdef, jax.tree.map(lambda a: (a.shape, a.dtype), state)


def stack_arrays(*leaves: Any, sharding: jax.sharding.Sharding | None = None) -> Any:
    """One weight's per-layer arrays as one [layers, ...] array, placed as `sharding` says, or else
    as they were plus the unsplit layer axis."""
    out = sharding
    placed = getattr(leaves[0], "sharding", None)
    if out is None and isinstance(placed, jax.sharding.NamedSharding):
        out = jax.sharding.NamedSharding(placed.mesh, jax.sharding.PartitionSpec(None, *placed.spec))
    return _stacker(out)(*leaves)


@functools.cache
def _stacker(out: jax.sharding.Sharding | None) -> Callable[..., jax.Array]:
    """`jnp.stack` compiled for one placement (cached: a model has a few weight shapes and placements)."""
    return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=out)


def _with_layer_axis(metadata: dict[str, Any]) -> dict[str, Any]:
    """A variable's sharding annotation with the (unsplit) layer axis in front."""
    return {k: (None, *metadata[k]) for k in SHARDING_KEYS if metadata.get(k)}


def _module_attribute(layer: nnx.Module, path: tuple[Any, ...]) -> tuple[Any, ...]:
    """The path of the module attribute that holds the variable at `path`: the variable itself, or
    the value object around it (a QLoRA weight is Qwix's frozen `WithAux` holding several)."""
    obj: Any = layer
    end = 1
    for i, part in enumerate(path):
        if isinstance(obj, nnx.Module):
            end = i + 1
        obj = _child(obj, part)
    return path[:end]


def _drop(layer: nnx.Module, attribute: tuple[Any, ...]) -> None:
    """Remove a module attribute from `layer` (its values now live in the stack)."""
    owner: Any = layer
    for part in attribute[:-1]:
        owner = _child(owner, part)
    delattr(owner, attribute[-1])


def _child(node: Any, part: Any) -> Any:
    """One step along an NNX state path: a list index or an attribute."""
    return node[part] if isinstance(part, int) else getattr(node, part)
