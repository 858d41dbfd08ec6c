"""The converter takes LoRA-target shapes from config.json alone; they must be the model's own."""

from __future__ import annotations

import pytest
from hf_side import FAMILIES

from lora_trainer.adapters.base_model import base_shapes
from lora_trainer.lora import targetable_modules
from lora_trainer.models.loading import build_abstract, read_hf_config


@pytest.mark.parametrize("family", FAMILIES)
def test_config_shapes_equal_the_built_model(family, tiny_base):
    base = tiny_base(family)
    shapes = base_shapes(str(base))
    assert shapes.family.name == family
    model = build_abstract(shapes.family, read_hf_config(base), "float32")
    assert shapes.weight_shapes == targetable_modules(model, shapes.family)
