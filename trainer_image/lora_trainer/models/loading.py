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
from lora_trainer.models.mapping import expand_rules
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


_SHARDING_KEYS = ("out_sharding", "sharding", "sharding_names")


def _partition_spec(var: nnx.Variable, shape: tuple[int, ...], mesh: jax.sharding.Mesh) -> jax.sharding.PartitionSpec:
    """The parameter's Tunix sharding annotation, keeping only mesh axes that exist and divide the dim."""
    meta = var.get_metadata()
    names = next((meta[k] for k in _SHARDING_KEYS if meta.get(k)), ())
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


def fill_params(
    abstract: nnx.Module,
    family: FamilySpec,
    hf_config: Mapping[str, Any],
    tensors: SafetensorsCheckpoint,
    *,
    dtype: str,
    mesh: jax.sharding.Mesh | None = None,
) -> nnx.Module:
    """A concrete model whose every parameter comes from `tensors` through the family's table."""
    graphdef, state = nnx.split(abstract)
    variables = {"/".join(map(str, path)): var for path, var in nnx.to_flat_state(state)}
    loaded: dict[str, jax.Array] = {}
    for hf_key, nnx_path, rule in expand_rules(family.weights, hf_config, family.num_layers(hf_config)):
        if nnx_path not in variables:
            raise AssertionError(f"{family.name} weight table names {nnx_path}, which the model does not have")
        var = variables[nnx_path]
        shape = tuple(var.get_value().shape)
        expected = rule.hf_shape(shape)
        got = tensors.shape(hf_key)
        if got != expected:
            raise UserError(
                f"tensor {hf_key!r} in {tensors.directory} has shape {list(got)} but config.json implies "
                f"{list(expected)}: the weights do not match config.json (wrong file or edited config)"
            )
        array = np.asarray(rule.to_nnx(tensors.get(hf_key), shape)).astype(DTYPES[dtype])
        if mesh is not None:
            # Each process puts only its addressable shards on its devices (multi-host safe).
            spec = _partition_spec(var, shape, mesh)
            loaded[nnx_path] = jax.make_array_from_callback(shape, jax.sharding.NamedSharding(mesh, spec), lambda index, a=array: a[index])
            # The annotation says what was placed: Qwix gives each LoRA factor its weight's annotation
            # and Tunix constrains the optimizer state to it, so an axis that does not divide (3
            # heads over tp=2) raised IndivisibleError at the first step.
            key = next((k for k in _SHARDING_KEYS if var.get_metadata().get(k)), None)
            if key is not None:
                var.set_metadata(key, tuple(spec))
        else:
            loaded[nnx_path] = jnp.asarray(array)
    missing = sorted(set(variables) - set(loaded))
    if missing:
        raise AssertionError(f"{family.name} weight table does not cover NNX parameters {missing}")
    used = {hf_key for hf_key, _, _ in expand_rules(family.weights, hf_config, family.num_layers(hf_config))}
    unused = sorted(set(tensors.keys()) - used)
    if family.multimodal:
        others = [k for k in unused if not k.startswith(family.decoder_tensors)]
        log.info("training the text decoder of a multimodal checkpoint; %d other tensors (vision) stay out", len(others))
        unused = [k for k in unused if k.startswith(family.decoder_tensors)]
    if unused:
        log.warning("ignoring %d checkpoint tensors the %s model does not use: %s", len(unused), family.name, unused[:8])
    for path, var in nnx.to_flat_state(state):
        var.set_value(loaded["/".join(map(str, path))])
    return nnx.merge(graphdef, state)


def load_model(
    source: str, *, family: str | None = None, dtype: str = "float32", mesh: jax.sharding.Mesh | None = None
) -> LoadedModel:
    """Load an HF safetensors checkpoint (local dir or gs://) as the family's NNX model.

    `family` overrides detection from config.json; `dtype` is the dtype of the base weights
    (float32, bfloat16, float16); with `mesh`, each weight is placed with a NamedSharding
    from Tunix's per-parameter annotations (axes the mesh lacks or that do not divide a
    dimension are replicated).
    """
    if dtype not in DTYPES:
        raise UserError(f"model.dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    directory = resolve_local_dir(source)
    hf_config = read_hf_config(directory)
    name = family_name(hf_config, family, where=str(directory / "config.json"), field="model.family")
    tensors = SafetensorsCheckpoint(directory)
    spec, hf_config = get_family(name).for_checkpoint(hf_config, tensors.keys())
    abstract = build_abstract(spec, hf_config, dtype)
    model = fill_params(abstract, spec, hf_config, tensors, dtype=dtype, mesh=mesh)
    return LoadedModel(model=model, family=spec, hf_config=hf_config, local_dir=directory)
