"""Gemma 3 (text): the HF <-> NNX weight and LoRA tables (the model itself: gemma3_model.py).

K and V map to `attn/kv_einsum/k_proj` and `attn/kv_einsum/v_proj`: gemma3_model.py splits
Tunix's fused `kv_einsum` so each maps to PEFT one to one.
"""

from __future__ import annotations

from lora_trainer.models.families.common import lazy_build
from lora_trainer.models.mapping import LoraTarget, WeightRule

_L = "model.layers.{i}"
Q = WeightRule(f"{_L}.self_attn.q_proj.weight", "layers/{i}/attn/q_einsum/w", "(n h) d", "n d h")
K = WeightRule(f"{_L}.self_attn.k_proj.weight", "layers/{i}/attn/kv_einsum/k_proj/w", "(k h) d", "k d h")
V = WeightRule(f"{_L}.self_attn.v_proj.weight", "layers/{i}/attn/kv_einsum/v_proj/w", "(k h) d", "k d h")
O = WeightRule(f"{_L}.self_attn.o_proj.weight", "layers/{i}/attn/attn_vec_einsum/w", "d (n h)", "n h d")
GATE = WeightRule(f"{_L}.mlp.gate_proj.weight", "layers/{i}/mlp/gate_proj/kernel", "f d", "d f")
UP = WeightRule(f"{_L}.mlp.up_proj.weight", "layers/{i}/mlp/up_proj/kernel", "f d", "d f")
DOWN = WeightRule(f"{_L}.mlp.down_proj.weight", "layers/{i}/mlp/down_proj/kernel", "d f", "f d")


def _norm(hf: str, nnx_path: str, axis: str = "d") -> WeightRule:
    # Both sides store the offset w of a `(1 + w)` RMSNorm scale, so it maps unchanged.
    return WeightRule(hf, nnx_path, axis, axis)


WEIGHTS = (
    WeightRule("model.embed_tokens.weight", "embedder/input_embedding", "v d", "v d"),
    _norm(f"{_L}.input_layernorm.weight", "layers/{i}/pre_attention_norm/scale"),
    _norm(f"{_L}.post_attention_layernorm.weight", "layers/{i}/post_attention_norm/scale"),
    _norm(f"{_L}.pre_feedforward_layernorm.weight", "layers/{i}/pre_ffw_norm/scale"),
    _norm(f"{_L}.post_feedforward_layernorm.weight", "layers/{i}/post_ffw_norm/scale"),
    _norm(f"{_L}.self_attn.q_norm.weight", "layers/{i}/attn/_query_norm/scale", "h"),
    _norm(f"{_L}.self_attn.k_norm.weight", "layers/{i}/attn/_key_norm/scale", "h"),
    Q, K, V, O, GATE, UP, DOWN,
    _norm("model.norm.weight", "final_norm/scale"),
)  # fmt: skip

LORA_TARGETS = (
    LoraTarget("layers/{i}/attn/q_einsum", f"{_L}.self_attn.q_proj", Q),
    LoraTarget("layers/{i}/attn/kv_einsum/k_proj", f"{_L}.self_attn.k_proj", K),
    LoraTarget("layers/{i}/attn/kv_einsum/v_proj", f"{_L}.self_attn.v_proj", V),
    LoraTarget("layers/{i}/attn/attn_vec_einsum", f"{_L}.self_attn.o_proj", O),
    LoraTarget("layers/{i}/mlp/gate_proj", f"{_L}.mlp.gate_proj", GATE),
    LoraTarget("layers/{i}/mlp/up_proj", f"{_L}.mlp.up_proj", UP),
    LoraTarget("layers/{i}/mlp/down_proj", f"{_L}.mlp.down_proj", DOWN),
)

SPEC_ARGS = dict(
    build=lazy_build("lora_trainer.models.families.gemma3_model"),
    weights=WEIGHTS,
    lora_targets=LORA_TARGETS,
)
