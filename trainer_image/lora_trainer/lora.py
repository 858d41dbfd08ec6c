"""Apply (Q)LoRA to a family's NNX model with Qwix, and read/write the LoRA parameters.

`apply_lora` refuses to hand back a model without `nnx.LoRAParam`s: Tunix's PeftTrainer
would otherwise silently fine-tune every base weight. Target regexes are checked before
Qwix runs (nothing matched, a QLoRA tile that does not divide a weight) so the error can
name the regex or module and list what would have worked.

`lora_state` / `set_lora_state` are the one format the checkpoint and adapter code use:
`{module_path: {"<weight>_lora_a": array, "<weight>_lora_b": array}}`, e.g.
`{"layers/0/attn/q_proj": {"w_lora_a": [embed, r], "w_lora_b": [r, heads, head_dim]}}`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx
from jax.interpreters import partial_eval

from lora_trainer import lora_names
from lora_trainer.checkpoint import placed
from lora_trainer.config import LoraSpec
from lora_trainer.errors import UserError
from lora_trainer.lora_provider import LoraProvider
from lora_trainer.models.forward import positions_and_mask
from lora_trainer.models.spec import FamilySpec

log = logging.getLogger(__name__)

#: Train-config weightQtype -> Qwix qtype.
QTYPES: dict[str, Any] = {"nf4": "nf4", "int4": jnp.int4, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}

LoraTree = dict[str, dict[str, Any]]


@dataclasses.dataclass
class LoraApplied:
    """The model with LoRA params, the regex that chose the modules, and the modules it chose.

    `zeros`: the LoRA params are zeros for the caller to set (`structure_only`, QLoRA aside)."""

    model: nnx.Module
    target_regex: str
    module_paths: list[str]
    zeros: bool


def resolve_target_regex(target_modules: str, family: FamilySpec) -> str:
    """`auto` -> the family's `auto_target_regex` (its declaration); anything else is used as given."""
    return family.auto_target_regex if target_modules == "auto" else target_modules


def targetable_modules(model: nnx.Module, family: FamilySpec) -> dict[str, tuple[int, ...]]:
    """{module path: weight shape} of every LoRA-targetable projection in the model."""
    found: dict[str, tuple[int, ...]] = {}
    for path, module in nnx.iter_modules(model):
        module_path = "/".join(map(str, path))
        try:
            target, _ = family.target_for_path(module_path)
        except KeyError:
            continue
        found[module_path] = tuple(getattr(module, target.weight_name).get_value().shape)
    return found


def _summarise(paths: list[str]) -> str:
    """Module paths for an error message: layer 0's in full, then how many layers follow."""
    first = [p for p in paths if p.startswith("layers/0/")] or paths
    layers = {p.split("/")[1] for p in paths if p.startswith("layers/")}
    more = f" (and the same under layers/1..{len(layers) - 1})" if len(layers) > 1 else ""
    return ", ".join(first) + more


def _tiled_dim(path: str, shape: tuple[int, ...], family: FamilySpec) -> int:
    """The size of the axis Qwix tiles for QLoRA: the weight's last contracting (input) axis."""
    target, _ = family.target_for_path(path)
    sizes = dict(zip(target.weight.nnx_axes.split(), shape, strict=True))
    return sizes[target.a_axes.split()[-1]]


def _check_tile_size(tile_size: int, matched: dict[str, tuple[int, ...]], family: FamilySpec) -> None:
    """Reject a QLoRA tile that does not divide every matched weight's tiled axis, naming the module."""
    dims = {path: _tiled_dim(path, shape, family) for path, shape in matched.items()}
    for path, dim in dims.items():
        if dim % tile_size:
            valid = [t for t in (2**i for i in range(13)) if all(d % t == 0 for d in dims.values())]
            raise UserError(
                f"lora.quantization.tileSize {tile_size} does not divide the contracting dimension ({dim}) of "
                f"{path}; valid tile sizes for the targeted modules: {valid}"
            )


def _float32_init(initializer: Any) -> Any:
    """LoRA params are float32 whatever the base dtype (Qwix would use the weight's dtype)."""
    return lambda key, shape, dtype=None: initializer(key, shape, jnp.float32)


def apply_lora(
    model: nnx.Module,
    lora_spec: LoraSpec,
    family: FamilySpec,
    *,
    seed: int,
    batch_shape: tuple[int, int] = (1, 8),
    structure_only: bool = False,
) -> LoraApplied:
    """A copy of `model` with LoRA (and QLoRA quantization) on the modules `lora_spec.target_modules` selects.

    Runs one dummy forward of `batch_shape` tokens so Qwix creates every `nnx.LoRAParam`
    (A: he-uniform from `seed`, B: zeros, so the model's output is unchanged).

    `structure_only` is for callers that set every LoRA value next (a resume from its
    checkpoint, an adapter's logits): the forward is then only traced (`nnx.eval_shape`) and
    the new params are zeros, placed as Qwix places them. Run op by op, that forward is ~176
    small programs: 4.0 s of a v5e restart, 2.1 s on CPU, against well under a second traced.
    QLoRA's forward computes the quantized weights, so under QLoRA it always runs.
    """
    regex = resolve_target_regex(lora_spec.target_modules, family)
    available, matched = _matched_modules(model, family, regex)
    provider = _provider(lora_spec, family, regex, matched)
    tokens = jnp.ones(batch_shape, dtype=jnp.int32)
    positions, mask = positions_and_mask(tokens, None)

    def with_lora() -> nnx.Module:
        return qwix.apply_lora_to_model(
            model, provider, tokens, positions, None, mask, rngs=nnx.Rngs(params=seed, dropout=seed)
        )

    zeros = structure_only and lora_spec.quantization is None
    if zeros:
        # `model` closed over, not an argument: its weights stay concrete in the trace, where Qwix reads their shardings.
        with _tracer_errors_without_origin():
            lora_model = _filled(nnx.eval_shape(with_lora), model)
    else:
        lora_model = with_lora()
    if lora_spec.dropout > 0:
        # Qwix draws dropout keys from `module.qwix_rngs`, which it clears after the dummy forward;
        # without this every later call fails. Evaluation traces without dropout (`no_lora_dropout`).
        lora_model.set_attributes(qwix_rngs=nnx.Rngs(dropout=seed + 1))
    created = _created_modules(lora_model, provider, regex, available, matched)
    # Said once, so that a regex written for another family's names (q_proj on Gemma 3, whose
    # query projection is q_einsum) shows what it left out.
    log.info("LoRA on %d modules (lora.targetModules %r): %s", len(created), regex, _summarise(created))
    return LoraApplied(model=lora_model, target_regex=regex, module_paths=created, zeros=zeros)


@contextlib.contextmanager
def _tracer_errors_without_origin() -> Iterator[None]:
    """Tracing without the origin part of tracer errors' messages.

    `getattr(tracer, "sharding", None)` is answered with an AttributeError whose message names
    the tracer's origin, found by walking the whole trace so far (`_origin_msg`). NNX asks it at
    each RNG draw, twice: tracing a 16-layer model's LoRA forward spent 2.5 s of 3.4 s composing
    messages `getattr` throws away (CPU, cProfile). Errors raised meanwhile keep the rest of their
    message.
    """
    tracer = partial_eval.DynamicJaxprTracer
    origin = tracer._origin_msg
    tracer._origin_msg = lambda self: ""  # type: ignore[method-assign]
    try:
        yield
    finally:
        tracer._origin_msg = origin  # type: ignore[method-assign]


def _filled(abstract: nnx.Module, base: nnx.Module) -> nnx.Module:
    """`abstract`, Qwix's LoRA model as `nnx.eval_shape` gives it, made concrete: `base`'s own
    arrays (not copies) at `base`'s paths, and zeros for the LoRA params Qwix added.

    Qwix places a new param as its weight's `NamedSharding`, with the axes its metadata
    (`out_sharding`) carries; the zeros go where Qwix would have put its values, so a resumed
    run's step sees the arrays a fresh run's does (and reads the same persistent-cache entry).
    """
    arrays = {path: var.get_value() for path, var in nnx.to_flat_state(nnx.state(base))}
    for path, var in nnx.to_flat_state(nnx.state(abstract)):
        if path in arrays:
            var.set_value(arrays[path])
            continue
        if not isinstance(var, nnx.LoRAParam):
            raise AssertionError(f"Qwix added {type(var).__name__} {path} besides LoRA params; it has no value to fill")
        shape = var.get_value()
        weight = arrays[(*path[:-1], lora_names.weight_of(str(path[-1])))]
        axes = var.get_metadata().get("out_sharding")
        zeros = jnp.zeros(shape.shape, shape.dtype)
        if isinstance(weight.sharding, jax.sharding.NamedSharding) and axes is not None:
            zeros = jax.device_put(zeros, jax.sharding.NamedSharding(weight.sharding.mesh, jax.sharding.PartitionSpec(*axes)))
        var.set_value(zeros)
    return abstract


def _matched_modules(model: nnx.Module, family: FamilySpec, regex: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(every LoRA-targetable module of `model`, those `regex` full-matches); UserError if none or not a regex."""
    try:
        compiled = re.compile(regex)
    except re.error as e:
        raise UserError(f"lora.targetModules '{regex}' is not a valid regex ({e})") from e
    available = targetable_modules(model, family)
    matched = {p: s for p, s in available.items() if compiled.fullmatch(p)}
    if not matched:
        raise UserError(
            f"lora.targetModules '{regex}' matches no LoRA-targetable module of this {family.name} model "
            f"(full match against module paths); the model's paths are: {_summarise(list(available))}"
        )
    return available, matched


def _provider(lora_spec: LoraSpec, family: FamilySpec, regex: str, matched: dict[str, Any]) -> LoraProvider:
    """Qwix's LoRA provider for `regex`: float32 A (he-uniform) and B (zeros), QLoRA's quantization if asked."""
    quant = lora_spec.quantization
    qwix_args: dict[str, Any] = {}
    if quant is not None:
        if quant.tile_size is not None:
            _check_tile_size(quant.tile_size, matched, family)
        qwix_args = {"weight_qtype": QTYPES[quant.weight_qtype], "tile_size": quant.tile_size}
    return LoraProvider(
        module_path=regex,
        rank=lora_spec.rank,
        alpha=lora_spec.alpha,
        dropout=lora_spec.dropout,
        lora_a_initializer=_float32_init(nnx.initializers.he_uniform()),
        lora_b_initializer=_float32_init(nnx.initializers.zeros),
        **qwix_args,
    )


def _created_modules(
    lora_model: nnx.Module, provider: LoraProvider, regex: str, available: dict[str, Any], matched: dict[str, Any]
) -> list[str]:
    """The module paths Qwix put LoRA on, checked: the rule was used, some were created, all are
    projections PEFT can name, and every matched module got its pair."""
    unused = provider.get_unused_rules()
    if unused:
        raise UserError(
            f"lora.targetModules '{regex}' stayed unused (no weight of a matching module went through LoRA); "
            f"the model's module paths are: {_summarise(list(available))}"
        )
    created = sorted(lora_state(lora_model))
    if not created:
        raise UserError(
            f"lora.targetModules '{regex}' created no LoRA parameters; refusing to train, since the trainer would "
            f"otherwise fine-tune the whole model. Module paths: {_summarise(list(available))}"
        )
    stray = sorted(set(created) - set(available))
    if stray:
        raise UserError(
            f"lora.targetModules '{regex}' also matches modules that are not attention/MLP projections "
            f"({', '.join(stray)}); adapters for them cannot be exported to HF PEFT. Narrow the regex."
        )
    missed = sorted(set(matched) - set(created))
    if missed:
        raise AssertionError(f"Qwix created no LoRA params on matched modules {missed}: the model's call path changed")
    return created


def lora_variables(model: nnx.Module) -> dict[str, dict[str, nnx.Variable]]:
    """`model`'s LoRA variables as `lora_state` names them; finding them walks the whole model graph."""
    tree: dict[str, dict[str, nnx.Variable]] = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        *module, name = map(str, path)
        tree.setdefault("/".join(module), {})[name] = var
    return tree


def lora_state(model: nnx.Module) -> LoraTree:
    """The LoRA params as `{module_path: {"<weight>_lora_a": array, "<weight>_lora_b": array}}`."""
    return read_lora(lora_variables(model))


def read_lora(variables: Mapping[str, Mapping[str, nnx.Variable]]) -> LoraTree:
    """`lora_state` read through variables `lora_variables` found earlier (no walk of the model)."""
    return {path: {name: var.get_value() for name, var in params.items()} for path, params in variables.items()}


def set_lora_state(model: nnx.Module, tree: Mapping[str, Mapping[str, Any]]) -> None:
    """Replace every LoRA param of `model` with `tree`'s; any module, name or shape mismatch is a
    UserError listing every difference, and nothing is changed unless everything matches."""
    current = lora_variables(model)
    problems: list[str] = []
    for path in sorted(set(current) - set(tree)):
        problems.append(f"{path}: missing from the restored adapter")
    for path in sorted(set(tree) - set(current)):
        problems.append(f"{path}: in the restored adapter but not a LoRA module of this model")
    for path in sorted(set(current) & set(tree)):
        names, given = set(current[path]), set(tree[path])
        if names != given:
            problems.append(f"{path}: has {sorted(given)}, expected {sorted(names)}")
            continue
        for name in sorted(names):
            want = tuple(current[path][name].get_value().shape)
            got = tuple(np.shape(tree[path][name]))
            if want != got:
                problems.append(f"{path}/{name}: shape {list(got)}, expected {list(want)} (rank or model differs)")
    if problems:
        raise UserError(
            "the adapter does not fit this model's LoRA configuration (rank, target modules and base model must "
            "match): " + "; ".join(problems[:12]) + (f"; and {len(problems) - 12} more" if len(problems) > 12 else "")
        )
    for path, params in current.items():
        for name, var in params.items():
            old = var.get_value()
            var.set_value(placed(tree[path][name], old) if isinstance(old, jax.Array) else jnp.asarray(tree[path][name], dtype=old.dtype))
