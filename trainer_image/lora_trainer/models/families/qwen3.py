"""Qwen3 (dense): the HF <-> NNX weight and LoRA tables (the model itself: qwen3_model.py)."""

from __future__ import annotations

from lora_trainer.models.families.common import LAYER, lazy_build, llama_style_tables
from lora_trainer.models.mapping import WeightRule

WEIGHTS, LORA_TARGETS = llama_style_tables(
    extra=(
        WeightRule(f"{LAYER}.self_attn.q_norm.weight", "layers/{i}/attn/q_norm/w", "h", "h"),
        WeightRule(f"{LAYER}.self_attn.k_norm.weight", "layers/{i}/attn/k_norm/w", "h", "h"),
    )
)

SPEC_ARGS = dict(
    build=lazy_build("lora_trainer.models.families.qwen3_model"),
    weights=WEIGHTS,
    lora_targets=LORA_TARGETS,
)
