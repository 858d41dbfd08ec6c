"""Llama 3.x (3, 3.1, 3.2): the HF <-> NNX weight and LoRA tables (the model itself: llama3_model.py)."""

from __future__ import annotations

from lora_trainer.models.families.common import lazy_build, llama_style_tables

WEIGHTS, LORA_TARGETS = llama_style_tables()

SPEC_ARGS = dict(
    build=lazy_build("lora_trainer.models.families.llama3_model"),
    weights=WEIGHTS,
    lora_targets=LORA_TARGETS,
)
