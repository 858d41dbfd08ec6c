"""Model families on Tunix NNX: detection, HF weight loading and the HF <-> NNX mapping.

`detect_family` and `get_family` are the one registry; `load_model` reads an HF safetensors
checkpoint (local or gs://) into the family's model; `forward_logits` runs it.
"""

import importlib
from typing import Any

#: Where each name lives: imported at first use, so that the light part (the registry, the families'
#: declarations) is read without JAX.
_LAZY = {
    "forward_logits": "lora_trainer.models.forward",
    "LoadedModel": "lora_trainer.models.loading",
    "load_model": "lora_trainer.models.loading",
    "LoraTarget": "lora_trainer.models.mapping",
    "WeightRule": "lora_trainer.models.mapping",
    "FAMILIES": "lora_trainer.models.registry",
    "detect_family": "lora_trainer.models.registry",
    "family_of_checkpoint": "lora_trainer.models.registry",
    "get_family": "lora_trainer.models.registry",
    "FamilySpec": "lora_trainer.models.spec",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)


__all__ = [
    "FAMILIES",
    "FamilySpec",
    "LoadedModel",
    "LoraTarget",
    "WeightRule",
    "detect_family",
    "family_of_checkpoint",
    "forward_logits",
    "get_family",
    "load_model",
]
