"""Qwen3 (dense) on Tunix's qwen3 model, with rope taken from config.json.

Tunix's qwen3 attention, like llama3's, ignores `config.rope_theta`; the subclass runs
the forward pass under the model's own RopeSpec (see models/rope.py), and its attention trains through `models.attention.causal_gqa_attention`. MoE Qwen3 models
(`qwen3_moe`) are a different model_type and not supported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from tunix.models.qwen3 import model as tunix_qwen3

from lora_trainer.models import rope
from lora_trainer.models.attention import causal_gqa_attention
from lora_trainer.models.families.common import decoder_dims, einsum_taking_quantized_weights, require, use_attention, use_decoder_layer, use_deferred_head
from lora_trainer.models.layer_stack import ScansLayers

rope.install_seam(tunix_qwen3)


class Attention(tunix_qwen3.Attention):
    """Tunix's qwen3 attention; without a KV cache or splash kernel the core is `causal_gqa_attention`."""

    def block(
        self, x: jax.Array, segment_pos: jax.Array, cache: Any, attn_mask: jax.Array | None, segment_ids: jax.Array | None = None
    ) -> tuple[Any, jax.Array]:
        if cache is not None or self.config.use_flash_attention:
            return super().block(x, segment_pos, cache, attn_mask, segment_ids)
        btnh = self.shd_config.act_btnh
        q = tunix_qwen3.shard(self.q_norm(self.q_proj(x)), btnh)
        k = tunix_qwen3.shard(self.k_norm(self.k_proj(x)), btnh)
        v = tunix_qwen3.shard(self.v_proj(x), btnh)
        q = tunix_qwen3.apply_rope(q, segment_pos, head_dim=self.head_dim, kv_heads=self.config.num_kv_heads)
        k = tunix_qwen3.apply_rope(k, segment_pos, head_dim=self.head_dim, kv_heads=self.config.num_kv_heads)
        out = self.o_proj(causal_gqa_attention(q, k, v, attn_mask, self.scale))
        return None, tunix_qwen3.shard(out, self.shd_config.act_btd)


use_attention(tunix_qwen3, Attention)
use_decoder_layer(tunix_qwen3)
einsum_taking_quantized_weights(tunix_qwen3)
use_deferred_head(tunix_qwen3)


class Qwen3(rope.RopeFromConfig, ScansLayers, tunix_qwen3.Qwen3):
    """Tunix Qwen3 whose attention uses the RopeSpec from config.json, and can scan its layers."""


def tunix_config(hf_config: Mapping[str, Any], dtype: jnp.dtype = jnp.float32) -> tunix_qwen3.ModelConfig:
    """Tunix ModelConfig with every hyperparameter from config.json."""
    require(hf_config, "qwen3", "hidden_act", ("silu",), "silu")
    require(hf_config, "qwen3", "attention_bias", (False,), False)
    require(hf_config, "qwen3", "use_sliding_window", (False, None), False)
    return tunix_qwen3.ModelConfig(
        **decoder_dims(hf_config),
        rope_theta=rope.hf_rope(hf_config).theta,  # informational: Tunix ignores it, self.rope_spec is used
        norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        use_tied_embedding=bool(hf_config.get("tie_word_embeddings", False)),
        dtype=dtype,
        param_dtype=dtype,
    )


def build(hf_config: Mapping[str, Any], dtype: jnp.dtype, rngs: nnx.Rngs) -> Qwen3:
    """The NNX model for config.json, computing in `dtype`."""
    return Qwen3(tunix_config(hf_config, dtype), rope_spec=rope.hf_rope(hf_config), rngs=rngs)
