"""Load an HF safetensors checkpoint into the family's Tunix NNX model, optionally onto a mesh.

The model is first built abstractly (`nnx.eval_shape`: no memory, no random init), then
every parameter is filled from the family's weight table, so each NNX parameter must come
from exactly one HF tensor of the right shape; anything else is a UserError naming the key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lora_trainer import storage
from lora_trainer.errors import UserError
from lora_trainer.models.mapping import WeightRule, expand_rules
from lora_trainer.models.registry import family_name, get_family
from lora_trainer.models.safetensors_io import SafetensorsCheckpoint
from lora_trainer.models.spec import FamilySpec

log = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

#: Where gs:// base models are downloaded (one directory per URI); defaults under the temp dir.
CACHE_ENV = "LORA_TRAINER_MODEL_CACHE"
_DOWNLOADED = ".lora-trainer-complete"


@dataclasses.dataclass
class LoadedModel:
    """A base model ready for LoRA: the NNX module plus what it was built from."""

    model: nnx.Module
    family: FamilySpec
    """The family, with this checkpoint's HF names (`FamilySpec.for_checkpoint`)."""
    hf_config: dict[str, Any]
    """The decoder's config: config.json, or its `text_config` for a multimodal checkpoint."""
    local_dir: Path
    """A local directory with the checkpoint's files (config.json, tokenizer, safetensors)."""
    placeholders: bool = False
    """Every base weight is zeros, placed where its values go, until `late_weights.read_into` reads them."""


def resolve_local_dir(source: str) -> Path:
    """A local directory holding `source`'s files: the path itself, or a cached download of gs:// or hf://."""
    if source.startswith("file://"):
        source = source[len("file://") :]
    if not (storage.is_gcs(source) or storage.is_hf(source)):
        path = Path(source)
        if not path.is_dir():
            raise UserError(f"model.source {source} is not a directory: point it at an HF checkpoint directory")
        return path
    root = Path(os.environ.get(CACHE_ENV) or Path(tempfile.gettempdir()) / "lora-trainer-models")
    dest = root / hashlib.sha256(source.rstrip("/").encode()).hexdigest()[:16]
    if not (dest / _DOWNLOADED).exists():
        dest.mkdir(parents=True, exist_ok=True)
        storage.download_dir(source, dest)
        (dest / _DOWNLOADED).write_text(source)
    return dest


def read_hf_config(directory: Path) -> dict[str, Any]:
    """config.json of a checkpoint directory, with a clear error when absent or invalid."""
    path = directory / "config.json"
    if not path.is_file():
        raise UserError(f"{path} is missing: model.source must be an HF checkpoint directory with config.json")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}): re-upload the checkpoint") from e
    if not isinstance(cfg, dict):
        raise UserError(f"{path} must hold a JSON object")
    return cfg


#: Where a Tunix variable's metadata names its sharding axes (the key differs by Flax version and module).
SHARDING_KEYS = ("out_sharding", "sharding", "sharding_names")


def _partition_spec(var: nnx.Variable, shape: tuple[int, ...], mesh: jax.sharding.Mesh) -> jax.sharding.PartitionSpec:
    """The parameter's Tunix sharding annotation, keeping only mesh axes that exist and divide the dim."""
    meta = var.get_metadata()
    names = next((meta[k] for k in SHARDING_KEYS if meta.get(k)), ())
    axes = []
    for dim, name in zip(shape, tuple(names) + (None,) * (len(shape) - len(names))):
        keep = name is not None and name in mesh.shape and mesh.shape[name] > 1 and dim % mesh.shape[name] == 0
        axes.append(name if keep else None)
    return jax.sharding.PartitionSpec(*axes)


def build_abstract(family: FamilySpec, hf_config: Mapping[str, Any], dtype: str) -> nnx.Module:
    """The family's model with shapes only (no memory), for loading or inspection."""
    try:
        return nnx.eval_shape(lambda: family.build(hf_config, DTYPES[dtype], nnx.Rngs(0)))
    except KeyError as e:
        raise UserError(
            f"config.json has no {e.args[0]!r}, which a {family.name} model needs: use the checkpoint's original "
            "config.json (as written by transformers' save_pretrained)"
        ) from e
    except (TypeError, ValueError) as e:  # e.g. "num_hidden_layers": "two"
        raise UserError(
            f"config.json does not describe a {family.name} model ({e}): use the checkpoint's original config.json "
            "(as written by transformers' save_pretrained)"
        ) from e


def host_device() -> jax.Device:
    """This process's CPU device: where a model too large for the accelerators in 16 bits is staged (QLoRA)."""
    return jax.local_devices(backend="cpu")[0]


def fill_params(
    abstract: nnx.Module,
    family: FamilySpec,
    hf_config: Mapping[str, Any],
    tensors: SafetensorsCheckpoint,
    *,
    dtype: str,
    mesh: jax.sharding.Mesh | None = None,
    on_host: bool = False,
    placeholders: bool = False,
) -> nnx.Module:
    """A concrete model whose every parameter comes from `tensors` through the family's table.

    With `on_host` every parameter stays on this process's CPU (`host_device`), annotated for
    `mesh` as if it had been placed there; `place_on_mesh` moves the model later. With
    `placeholders` every parameter is zeros, shape-checked against its tensor and placed as its
    values would be; `late_weights.read_into` reads the values later."""
    graphdef, state = nnx.split(abstract)
    variables = {"/".join(map(str, path)): var for path, var in nnx.to_flat_state(state)}
    loaded: dict[str, jax.Array] = {}
    for hf_key, nnx_path, rule in expand_rules(family.weights, hf_config, family.num_layers(hf_config)):
        if nnx_path not in variables:
            raise AssertionError(f"{family.name} weight table names {nnx_path}, which the model does not have")
        loaded[nnx_path] = _load_weight(variables[nnx_path], hf_key, rule, tensors, dtype=dtype, mesh=mesh, on_host=on_host,
                                        placeholder=placeholders)
    missing = sorted(set(variables) - set(loaded))
    if missing:
        raise AssertionError(f"{family.name} weight table does not cover NNX parameters {missing}")
    _log_unused(family, hf_config, tensors)
    for path, var in nnx.to_flat_state(state):
        var.set_value(loaded["/".join(map(str, path))])
    return nnx.merge(graphdef, state)


def _load_weight(
    var: nnx.Variable,
    hf_key: str,
    rule: WeightRule,
    tensors: SafetensorsCheckpoint,
    *,
    dtype: str,
    mesh: jax.sharding.Mesh | None,
    on_host: bool,
    placeholder: bool = False,
) -> jax.Array:
    """The HF tensor `hf_key` as the NNX parameter `var`: shape checked, converted by `rule`, placed;
    or, as a `placeholder`, zeros placed there (the tensor's data not read)."""
    shape = tuple(var.get_value().shape)
    expected = rule.hf_shape(shape)
    got = tensors.shape(hf_key)
    if got != expected:
        raise UserError(
            f"tensor {hf_key!r} in {tensors.directory} has shape {list(got)} but config.json implies "
            f"{list(expected)}: the weights do not match config.json (wrong file or edited config)"
        )
    array = None if placeholder else np.asarray(rule.to_nnx(tensors.get(hf_key), shape)).astype(DTYPES[dtype])
    if mesh is not None:
        spec = _partition_spec(var, shape, mesh)
        # The annotation says what was placed: Qwix gives each LoRA factor its weight's annotation
        # and Tunix constrains the optimizer state to it, so an axis that does not divide (3
        # heads over tp=2) raised IndivisibleError at the first step.
        key = next((k for k in SHARDING_KEYS if var.get_metadata().get(k)), None)
        if key is not None:
            var.set_metadata(key, tuple(spec))
    if on_host:
        return jax.device_put(array, host_device())
    if mesh is not None:
        sharding = jax.sharding.NamedSharding(mesh, spec)
        return jnp.zeros(shape, DTYPES[dtype], device=sharding) if array is None else placed(array, sharding)
    return jnp.zeros(shape, DTYPES[dtype]) if array is None else jnp.asarray(array)


def _log_unused(family: FamilySpec, hf_config: Mapping[str, Any], tensors: SafetensorsCheckpoint) -> None:
    """Say which checkpoint tensors the family's table leaves out (a multimodal checkpoint's vision side apart)."""
    used = {hf_key for hf_key, _, _ in expand_rules(family.weights, hf_config, family.num_layers(hf_config))}
    unused = sorted(set(tensors.keys()) - used)
    if family.multimodal:
        others = [k for k in unused if not k.startswith(family.decoder_tensors)]
        log.info("training the text decoder of a multimodal checkpoint; %d other tensors (vision) stay out", len(others))
        unused = [k for k in unused if k.startswith(family.decoder_tensors)]
    if unused:
        log.warning("ignoring %d checkpoint tensors the %s model does not use: %s", len(unused), family.name, unused[:8])


def placed(array: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A host array as a global array: each process puts only its addressable shards on its devices (multi-host safe)."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def _leaf_on_mesh(leaf: Any, names: tuple[Any, ...], mesh: jax.sharding.Mesh) -> Any:
    """One array of a variable's value on `mesh`, split by the variable's axis names where they divide it."""
    if not isinstance(leaf, jax.Array):
        return leaf
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(_leaf_on_mesh(jax.random.key_data(leaf), names, mesh), impl=jax.random.key_impl(leaf))
    axes = [n if n is not None and n in mesh.shape and dim % mesh.shape[n] == 0 else None
            for dim, n in zip(leaf.shape, tuple(names) + (None,) * (leaf.ndim - len(names)))]
    return placed(np.asarray(leaf), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*axes)))


def place_on_mesh(model: nnx.Module, mesh: jax.sharding.Mesh) -> None:
    """Move a model staged on the host (`load_model(on_host=True)`, then QLoRA applied there) onto `mesh`.

    Every array of every variable takes its variable's sharding annotation, axes that do not
    divide it replicated: a QLoRA weight's packed values split like the weight, its scales
    where their (tiled) axes still divide. The host copies are released as the model lets go of them.
    """
    state = nnx.state(model)
    for _, var in nnx.to_flat_state(state):
        meta = var.get_metadata()
        names = tuple(next((meta[k] for k in SHARDING_KEYS if meta.get(k)), ()))
        var.set_value(jax.tree.map(lambda leaf, names=names: _leaf_on_mesh(leaf, names, mesh), var.get_value()))
    nnx.update(model, state)


def load_model(
    source: str,
    *,
    family: str | None = None,
    dtype: str = "float32",
    mesh: jax.sharding.Mesh | None = None,
    on_host: bool = False,
    placeholders: bool = False,
) -> LoadedModel:
    """Load an HF safetensors checkpoint (local dir or gs://) as the family's NNX model.

    `family` overrides detection from config.json; `dtype` is the dtype of the base weights
    (float32, bfloat16, float16); with `mesh`, each weight is placed with a NamedSharding
    from Tunix's per-parameter annotations (axes the mesh lacks or that do not divide a
    dimension are replicated). `on_host` keeps the weights on this process's CPU, annotated for
    `mesh` (`place_on_mesh` moves them): QLoRA quantizes there, so a base too large for the
    accelerators in 16 bits never has to fit on them. `placeholders` reads only the checkpoint's
    headers: the weights are zeros until `late_weights.read_into` reads them into the model as it
    is by then (LoRA applied, layers stacked), so that the train step compiles meanwhile.
    """
    if placeholders and on_host:
        raise ValueError("placeholders are placed on the mesh; a model staged on the host is loaded whole")
    if dtype not in DTYPES:
        raise UserError(f"model.dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    directory = resolve_local_dir(source)
    hf_config = read_hf_config(directory)
    name = family_name(hf_config, family, where=str(directory / "config.json"), field="model.family")
    tensors = SafetensorsCheckpoint(directory)
    spec, hf_config = get_family(name).for_checkpoint(hf_config, tensors.keys())
    abstract = build_abstract(spec, hf_config, dtype)
    model = fill_params(abstract, spec, hf_config, tensors, dtype=dtype, mesh=mesh, on_host=on_host, placeholders=placeholders)
    return LoadedModel(model=model, family=spec, hf_config=hf_config, local_dir=directory, placeholders=placeholders)
