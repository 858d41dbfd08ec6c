"""Llama 3.x (3, 3.1, 3.2) on Tunix's llama3 model, with rope taken from config.json.

Tunix's attention hard-codes theta 1e6 and has no Llama 3.1 `rope_scaling`; the subclass
below runs the forward pass under the model's own RopeSpec (see models/rope.py). Its
attention trains through `models.attention.causal_gqa_attention` (see there for why).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from tunix.models.llama3 import model as tunix_llama3

from lora_trainer.models import rope
from lora_trainer.models.attention import causal_gqa_attention
from lora_trainer.models.families.common import decoder_dims, require, use_attention, use_decoder_layer, use_deferred_head
from lora_trainer.models.layer_stack import ScansLayers

rope.install_seam(tunix_llama3)


class Attention(tunix_llama3.Attention):
    """Tunix's llama3 attention; without a KV cache (training, scoring) the core is `causal_gqa_attention`."""

    def block(self, x: jax.Array, segment_pos: jax.Array, cache: Any, attn_mask: jax.Array | None) -> tuple[Any, jax.Array]:
        if cache is not None:
            return super().block(x, segment_pos, cache, attn_mask)
        btnh, kv = self.shd_config.act_btnh, self.config.num_kv_heads
        q = tunix_llama3.apply_rope(tunix_llama3.shard(self.q_proj(x), btnh), segment_pos, head_dim=self.head_dim, kv_heads=kv)
        k = tunix_llama3.apply_rope(tunix_llama3.shard(self.k_proj(x), btnh), segment_pos, head_dim=self.head_dim, kv_heads=kv)
        v = tunix_llama3.shard(self.v_proj(x), btnh)
        out = self.o_proj(causal_gqa_attention(q, k, v, attn_mask, self.scale))
        return None, tunix_llama3.shard(out, self.shd_config.act_btd)


use_attention(tunix_llama3, Attention)
use_decoder_layer(tunix_llama3)
use_deferred_head(tunix_llama3)


class Llama3(rope.RopeFromConfig, ScansLayers, tunix_llama3.Llama3):
    """Tunix Llama3 whose attention uses the RopeSpec from config.json, and can scan its layers."""


def tunix_config(hf_config: Mapping[str, Any]) -> tunix_llama3.ModelConfig:
    """Tunix ModelConfig with every hyperparameter from config.json."""
    require(hf_config, "llama3", "hidden_act", ("silu",), "silu")
    require(hf_config, "llama3", "attention_bias", (False,), False)
    require(hf_config, "llama3", "mlp_bias", (False,), False)
    return tunix_llama3.ModelConfig(
        **decoder_dims(hf_config),
        rope_theta=rope.hf_rope(hf_config).theta,  # informational: Tunix ignores it, self.rope_spec is used
        norm_eps=float(hf_config.get("rms_norm_eps", 1e-5)),
        weight_tying=bool(hf_config.get("tie_word_embeddings", False)),
    )


def build(hf_config: Mapping[str, Any], dtype: jnp.dtype, rngs: nnx.Rngs) -> Llama3:
    """The NNX model for config.json (computes in the dtype of the weights it is given)."""
    del dtype  # Tunix llama3 computes in its parameters' dtype; the loader casts them.
    return Llama3(tunix_config(hf_config), rope_spec=rope.hf_rope(hf_config), rngs=rngs)
