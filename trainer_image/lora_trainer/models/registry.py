"""The one family registry: config.json -> family name -> FamilySpec.

Detection needs no JAX: the `model_type`/`architectures` table is here; `get_family`
imports the family module (and Tunix) only when the spec is needed.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from importlib import resources
from typing import Any

import yaml

from lora_trainer.errors import UserError
from lora_trainer.models.spec import FamilySpec

#: family -> (config.json model_type values, architectures). Gemma 3's multimodal `gemma3`
#: checkpoints train their text decoder (`FamilySpec.for_checkpoint`).
_DETECT: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "llama3": (("llama",), ("LlamaForCausalLM",)),
    "qwen3": (("qwen3",), ("Qwen3ForCausalLM",)),
    "qwen2": (("qwen2",), ("Qwen2ForCausalLM",)),
    "gemma3": (("gemma3_text", "gemma3"), ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")),
}

FAMILIES: tuple[str, ...] = tuple(_DETECT)


def detect_family(hf_config: Mapping[str, Any]) -> str:
    """The family of an HF config.json, from `model_type` (or `architectures`)."""
    model_type = hf_config.get("model_type")
    architectures = tuple(hf_config.get("architectures") or ())
    for family, (types, archs) in _DETECT.items():
        if model_type in types:
            return family
    for family, (types, archs) in _DETECT.items():
        if set(architectures) & set(archs):
            return family
    raise UserError(
        f"config.json has model_type {model_type!r} (architectures {list(architectures)}), which is not a "
        f"supported family; supported: {', '.join(FAMILIES)} (model_type "
        f"{', '.join(t for types, _ in _DETECT.values() for t in types)}); if the model is one of those under a "
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


@functools.cache
def _target_table() -> dict[str, dict[str, str]]:
    text = resources.files("lora_trainer.models").joinpath("target_modules.yaml").read_text()
    return yaml.safe_load(text)


def family_of_checkpoint(metadata: Mapping[str, Any]) -> FamilySpec:
    """The FamilySpec a LoRA checkpoint's metadata names: its `family`, as the decoder of a multimodal
    model when `multimodal` is true (absent in checkpoints of text-only models)."""
    spec = get_family(str(metadata["family"]))
    return spec.multimodal_view() if metadata.get("multimodal") else spec


@functools.cache
def get_family(name: str) -> FamilySpec:
    """The FamilySpec of `name` (one of FAMILIES)."""
    if name not in _DETECT:
        raise UserError(f"unknown model family {name!r}; supported: {', '.join(FAMILIES)}")
    module = importlib.import_module(f"lora_trainer.models.families.{name}")
    model_types, architectures = _DETECT[name]
    return FamilySpec(
        name=name,
        model_types=model_types,
        architectures=architectures,
        auto_target_regex=_target_table()[name]["auto"],
        **module.SPEC_ARGS,
    )
