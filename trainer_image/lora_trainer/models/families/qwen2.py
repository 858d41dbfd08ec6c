"""Qwen2 / Qwen2.5: the HF <-> NNX weight and LoRA tables (the model itself: qwen2_model.py)."""

from __future__ import annotations

from lora_trainer.models.families.common import LAYER, lazy_build, llama_style_tables
from lora_trainer.models.mapping import WeightRule

WEIGHTS, LORA_TARGETS = llama_style_tables(
    extra=(
        WeightRule(f"{LAYER}.self_attn.q_proj.bias", "layers/{i}/attn/q_bias", "n", "n"),
        WeightRule(f"{LAYER}.self_attn.k_proj.bias", "layers/{i}/attn/k_bias", "k", "k"),
        WeightRule(f"{LAYER}.self_attn.v_proj.bias", "layers/{i}/attn/v_bias", "k", "k"),
    )
)

SPEC_ARGS = dict(
    build=lazy_build("lora_trainer.models.families.qwen2_model"),
    weights=WEIGHTS,
    lora_targets=LORA_TARGETS,
)
