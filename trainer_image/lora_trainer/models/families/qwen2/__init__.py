"""Qwen2 / Qwen2.5: the HF <-> NNX weight and LoRA tables (the model itself: model.py)."""

from __future__ import annotations

from lora_trainer.models.families.tables import LAYER, LLAMA_STYLE_AUTO, lazy_build, llama_style_tables
from lora_trainer.models.mapping import WeightRule
from lora_trainer.models.spec import FamilySpec

WEIGHTS, LORA_TARGETS = llama_style_tables(
    extra=(
        WeightRule(f"{LAYER}.self_attn.q_proj.bias", "layers/{i}/attn/q_bias", "n", "n"),
        WeightRule(f"{LAYER}.self_attn.k_proj.bias", "layers/{i}/attn/k_bias", "k", "k"),
        WeightRule(f"{LAYER}.self_attn.v_proj.bias", "layers/{i}/attn/v_bias", "k", "k"),
    )
)

#: The tiny test model's config.json fields (on top of `tiny_models`' shared ones), as in the real checkpoints:
#: Qwen2.5 0.5B-3B: tied embeddings, q/k/v bias, theta 1e6, no sliding window.
TINY_CONFIG = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "hidden_act": "silu",
}

FAMILY = FamilySpec(
    name=__name__.rpartition(".")[2],
    model_types=("qwen2",),
    architectures=("Qwen2ForCausalLM",),
    auto_target_regex=LLAMA_STYLE_AUTO,
    build=lazy_build(f"{__name__}.model"),
    weights=WEIGHTS,
    lora_targets=LORA_TARGETS,
    tiny_config=TINY_CONFIG,
)
