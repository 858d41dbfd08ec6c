"""Model families on Tunix NNX: detection, HF weight loading and the HF <-> NNX mapping.

`detect_family` and `get_family` are the one registry; `load_model` reads an HF safetensors
checkpoint (local or gs://) into the family's model; `forward_logits` runs it.
"""

from lora_trainer.models.forward import forward_logits
from lora_trainer.models.loading import LoadedModel, load_model
from lora_trainer.models.mapping import LoraTarget, WeightRule
from lora_trainer.models.registry import FAMILIES, detect_family, family_of_checkpoint, get_family
from lora_trainer.models.spec import FamilySpec

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
