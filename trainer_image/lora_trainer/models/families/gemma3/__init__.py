"""Gemma 3: the HF <-> NNX weight and LoRA tables (the model itself: model.py).

K and V map to `attn/kv_einsum/k_proj` and `attn/kv_einsum/v_proj`: model.py splits
Tunix's fused `kv_einsum` so each maps to PEFT one to one.

Text-only checkpoints (1B, 270M: `Gemma3ForCausalLM`) are the tables as written; the
multimodal ones (4B-27B: `Gemma3ForConditionalGeneration`) train their text decoder, under
the names `NESTED_TEXT` gives (see `FamilySpec.multimodal_view`).
"""

from __future__ import annotations

from lora_trainer.models.families.tables import lazy_build
from lora_trainer.models.mapping import LoraTarget, WeightRule
from lora_trainer.models.spec import FamilySpec, NestedText

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

#: transformers' `Gemma3TextConfig` defaults, in the config.json fields of transformers 4.50, which
#: wrote the released multimodal checkpoints' sparse `text_config` (e.g. 4B: hidden size, MLP
#: size, layers, sliding window and the global layers' linear rope scaling; nothing else).
#: `layer_types` is left out: it follows from the layer count and `sliding_window_pattern`.
#: tests/adapters/test_adapters_multimodal.py checks these against the installed transformers.
TEXT_DEFAULTS = {
    "model_type": "gemma3_text",
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "tie_word_embeddings": True,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
}

NESTED_TEXT = NestedText(
    model_type="gemma3",
    config_key="text_config",
    defaults=TEXT_DEFAULTS,
    module_prefix="model.language_model.",
    tensor_prefixes=("language_model.model.", "model.language_model."),
)

#: The tiny test model's config.json fields (on top of `tiny_models`' shared ones), as in the real checkpoints:
#: Gemma 3 (text): local layers with rope base 10000 and a sliding window, global layers
#: with theta 1e6 and linear scaling 8 (4B+), query_pre_attn_scalar = head_dim, +1 norms,
#: sqrt(hidden) embedding scale, tied embeddings. The window is shrunk with the model.
TINY_CONFIG = {
    "model_type": "gemma3_text",
    "architectures": ["Gemma3ForCausalLM"],
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "query_pre_attn_scalar": 16,
    "sliding_window": 4,
    "layer_types": ["sliding_attention", "full_attention"],
    "tie_word_embeddings": True,
    "hidden_activation": "gelu_pytorch_tanh",
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
}

FAMILY = FamilySpec(
    name=__name__.rpartition(".")[2],
    model_types=("gemma3_text", "gemma3"),
    architectures=("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
    auto_target_regex=r"layers/\d+/(attn/(q_einsum|kv_einsum/k_proj|kv_einsum/v_proj|attn_vec_einsum)|mlp/(gate_proj|up_proj|down_proj))",
    build=lazy_build(f"{__name__}.model"),
    weights=WEIGHTS,
    lora_targets=LORA_TARGETS,
    nested_text=NESTED_TEXT,
    tiny_config=TINY_CONFIG,
)
