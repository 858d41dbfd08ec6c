"""Llama 3.x (3, 3.1, 3.2): the HF <-> NNX weight and LoRA tables (the model itself: model.py)."""

from __future__ import annotations

from lora_trainer.models.families.tables import LLAMA_STYLE_AUTO, lazy_build, llama_style_tables
from lora_trainer.models.spec import FamilySpec

WEIGHTS, LORA_TARGETS = llama_style_tables()

#: The tiny test model's config.json fields (on top of `tiny_models`' shared ones), as in the real checkpoints:
#: Llama 3.1 8B: untied, theta 500000, rope_scaling type llama3 (factor 8, 1/4, 8192).
#: original_max_position_embeddings is scaled down with the model so that the scaling
#: changes frequencies the short test sequences can see.
TINY_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
}

FAMILY = FamilySpec(
    name=__name__.rpartition(".")[2],
    model_types=("llama",),
    architectures=("LlamaForCausalLM",),
    auto_target_regex=LLAMA_STYLE_AUTO,
    build=lazy_build(f"{__name__}.model"),
    weights=WEIGHTS,
    lora_targets=LORA_TARGETS,
    tiny_config=TINY_CONFIG,
)
