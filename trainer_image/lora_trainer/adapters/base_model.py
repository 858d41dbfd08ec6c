"""What the adapter code needs to know about a base model without loading its weights.

Converting an adapter only needs the base's config.json: the family (detected, or checked
against an explicit one) and the NNX weight shape of every LoRA-targetable module, which
the family's weight table gives from config.json alone. So converting an 8B adapter needs
neither a 16 GB download of the base nor a model build.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

from lora_trainer import storage
from lora_trainer.errors import UserError
from lora_trainer.models import FamilySpec, get_family
from lora_trainer.models.registry import family_name
from lora_trainer.models.loading import read_hf_config


@dataclasses.dataclass(frozen=True)
class BaseShapes:
    """A base model's family, config.json and `{module_path: NNX weight shape}` of its LoRA targets."""

    family: FamilySpec
    """The family with the base's HF names (`FamilySpec.for_checkpoint`)."""
    hf_config: dict[str, Any]
    """The decoder's config (config.json, or its `text_config` for a multimodal base)."""
    weight_shapes: dict[str, tuple[int, ...]]


def resolve_family(hf_config: dict[str, Any], family: str | None, where: str) -> FamilySpec:
    """The family of config.json; an explicit `family` must agree with it (see `family_name`)."""
    return get_family(family_name(hf_config, family, where=where, field="--family"))


def base_shapes(base_uri: str, family: str | None = None) -> BaseShapes:
    """Family and LoRA-target weight shapes of the base model at `base_uri` (reads only config.json)."""
    config_uri = storage.join(base_uri, "config.json")
    if not storage.exists(config_uri):
        raise UserError(f"{config_uri} does not exist: --base must be the HF checkpoint directory the adapter belongs to")
    with tempfile.TemporaryDirectory(prefix="lora-base-config-") as tmp:
        (Path(tmp) / "config.json").write_bytes(storage.read_bytes(config_uri))
        hf_config = read_hf_config(Path(tmp))
    # Module names (all an adapter needs) do not depend on how the base stores its tensors.
    spec, text_config = resolve_family(hf_config, family, config_uri).for_checkpoint(hf_config)
    return BaseShapes(family=spec, hf_config=text_config, weight_shapes=spec.lora_weight_shapes(text_config))
