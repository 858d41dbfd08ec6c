"""The one family registry: config.json -> family name -> FamilySpec.

Each family is one folder, `lora_trainer/models/families/<name>/`, whose `__init__.py` declares
`FAMILY` (a FamilySpec: detection keys, the `auto` targets, the HF <-> NNX table, the tiny test
config) and whose `model.py` builds the Tunix model, imported at the first build. The registry
is the folders found there: detection, the declarations and `config.Family` need no JAX.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from typing import Any

from lora_trainer.config import family_names
from lora_trainer.errors import UserError
from lora_trainer.models.spec import FamilySpec

#: Every family's name: the folders of `lora_trainer.models.families` (`config.Family`'s values).
FAMILIES: tuple[str, ...] = family_names()


@functools.cache
def _declarations() -> dict[str, FamilySpec]:
    return {name: importlib.import_module(f"lora_trainer.models.families.{name}").FAMILY for name in FAMILIES}


def detect_family(hf_config: Mapping[str, Any]) -> str:
    """The family of an HF config.json, from `model_type` (or `architectures`)."""
    model_type = hf_config.get("model_type")
    architectures = tuple(hf_config.get("architectures") or ())
    declared = _declarations()
    for family, spec in declared.items():
        if model_type in spec.model_types:
            return family
    for family, spec in declared.items():
        if set(architectures) & set(spec.architectures):
            return family
    raise UserError(
        f"config.json has model_type {model_type!r} (architectures {list(architectures)}), which is not a "
        f"supported family; supported: {', '.join(FAMILIES)} (model_type "
        f"{', '.join(t for spec in declared.values() for t in spec.model_types)}); if the model is one of those under a "
        "model_type of its own, set model.family"
    )


def family_name(hf_config: Mapping[str, Any], family: str | None, *, where: str, field: str) -> str:
    """The family of config.json (`where`), or the given one (`field`, e.g. `model.family`): trusted
    where config.json names no supported family (a derivative's own model_type), refused where it
    names another."""
    if family is None:
        return detect_family(hf_config)
    try:
        detected = detect_family(hf_config)
    except UserError:
        return family
    if family != detected:
        raise UserError(
            f"{field} is {family!r} but {where} describes a {detected} model "
            f"(model_type {hf_config.get('model_type')!r}); drop {field} or fix it"
        )
    return family


def family_of_checkpoint(metadata: Mapping[str, Any]) -> FamilySpec:
    """The FamilySpec a LoRA checkpoint's metadata names: its `family`, as the decoder of a multimodal
    model when `multimodal` is true (absent in checkpoints of text-only models)."""
    spec = get_family(str(metadata["family"]))
    return spec.multimodal_view() if metadata.get("multimodal") else spec


@functools.cache
def get_family(name: str) -> FamilySpec:
    """The FamilySpec of `name` (one of FAMILIES)."""
    if name not in FAMILIES:
        raise UserError(f"unknown model family {name!r}; supported: {', '.join(FAMILIES)}")
    return _declarations()[name]
