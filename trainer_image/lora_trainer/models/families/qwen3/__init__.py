"""Qwen3 (dense): the HF <-> NNX weight and LoRA tables (the model itself: model.py)."""

from __future__ import annotations

from lora_trainer.models.families.tables import LAYER, LLAMA_STYLE_AUTO, lazy_build, llama_style_tables
from lora_trainer.models.mapping import WeightRule
from lora_trainer.models.spec import FamilySpec

WEIGHTS, LORA_TARGETS = llama_style_tables(
    extra=(
        WeightRule(f"{LAYER}.self_attn.q_norm.weight", "layers/{i}/attn/q_norm/w", "h", "h"),
        WeightRule(f"{LAYER}.self_attn.k_norm.weight", "layers/{i}/attn/k_norm/w", "h", "h"),
    )
)

#: The tiny test model's config.json fields (on top of `tiny_models`' shared ones), as in the real checkpoints:
#: Qwen3 0.6B-4B: tied embeddings, qk-norm, theta 1e6, eps 1e-6.
TINY_CONFIG = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "hidden_act": "silu",
}

FAMILY = FamilySpec(
    name=__name__.rpartition(".")[2],
    model_types=("qwen3",),
    architectures=("Qwen3ForCausalLM",),
    auto_target_regex=LLAMA_STYLE_AUTO,
    build=lazy_build(f"{__name__}.model"),
    weights=WEIGHTS,
    lora_targets=LORA_TARGETS,
    tiny_config=TINY_CONFIG,
)
