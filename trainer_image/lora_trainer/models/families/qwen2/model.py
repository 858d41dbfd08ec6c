"""Qwen2 / Qwen2.5 on Tunix's qwen2 model.

Tunix's qwen2 takes `rope_theta` from its config (no seam needed) but has no rope
scaling and no sliding window: configs that use either are refused rather than run wrong.
Its attention trains through `models.attention.causal_gqa_attention` (see there for why).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from tunix.models.qwen2 import model as tunix_qwen2

from lora_trainer.errors import UserError
from lora_trainer.models import rope
from lora_trainer.models.attention import SegmentMask, causal_gqa_attention
from lora_trainer.models.families.common import decoder_dims, einsum_taking_quantized_weights, require, use_attention, use_decoder_layer, use_deferred_head
from lora_trainer.models.layer_stack import ScansLayers


class Attention(tunix_qwen2.Attention):
    """Tunix's qwen2 attention; without a KV cache or splash kernel the core is `causal_gqa_attention`."""

    def block(
        self,
        x: jax.Array,
        cache: Any,
        attn_mask: jax.Array | None,
        sin: jax.Array,
        cos: jax.Array,
        segment_ids: jax.Array | None = None,
    ) -> tuple[Any, jax.Array]:
        if cache is not None or self.config.use_flash_attention:
            return super().block(x, cache, attn_mask, sin, cos, segment_ids)
        btnh = self.shd_config.act_btnh
        q = tunix_qwen2.shard(self._biased(self.q_proj(x), self.q_bias), btnh)
        k = tunix_qwen2.shard(self._biased(self.k_proj(x), self.k_bias), btnh)
        v = tunix_qwen2.shard(self._biased(self.v_proj(x), self.v_bias), btnh)
        q = tunix_qwen2.apply_rotary_embedding(q, sin, cos)
        k = tunix_qwen2.apply_rotary_embedding(k, sin, cos)
        if segment_ids is not None and not isinstance(attn_mask, SegmentMask):  # as Tunix: attend within one's own segment only
            same = segment_ids[:, :, None] == segment_ids[:, None, :]
            attn_mask = same if attn_mask is None else attn_mask & same
        out = self.o_proj(causal_gqa_attention(q, k, v, attn_mask, self.scale))
        return None, tunix_qwen2.shard(out, self.shd_config.act_btd)

    def _biased(self, proj: jax.Array, bias: nnx.Param) -> jax.Array:
        """[b, t, heads, head_dim] projection plus its flat [heads * head_dim] bias, as Tunix adds it."""
        b, t, n, h = proj.shape
        return (proj.reshape(b, t, n * h) + bias.astype(self.config.dtype)).reshape(b, t, n, h)


use_attention(tunix_qwen2, Attention)
use_decoder_layer(tunix_qwen2)
einsum_taking_quantized_weights(tunix_qwen2)
use_deferred_head(tunix_qwen2)


def tunix_config(hf_config: Mapping[str, Any], dtype: jnp.dtype = jnp.float32) -> tunix_qwen2.ModelConfig:
    """Tunix ModelConfig with every hyperparameter from config.json."""
    require(hf_config, "qwen2", "hidden_act", ("silu",), "silu")
    require(hf_config, "qwen2", "use_sliding_window", (False, None), False)
    spec = rope.hf_rope(hf_config)
    if spec.rope_type != "default":
        raise UserError(
            f"config.json: rope type {spec.rope_type!r} is not supported for qwen2 (Tunix's qwen2 has plain rope "
            "only); use a checkpoint without rope_scaling"
        )
    return tunix_qwen2.ModelConfig(
        **decoder_dims(hf_config),
        rope_theta=spec.theta,
        norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        use_tied_embedding=bool(hf_config.get("tie_word_embeddings", False)),
        dtype=dtype,
        param_dtype=dtype,
    )


class Qwen2(ScansLayers, tunix_qwen2.Qwen2):
    """Tunix Qwen2, able to scan its layers."""


def build(hf_config: Mapping[str, Any], dtype: jnp.dtype, rngs: nnx.Rngs) -> Qwen2:
    """The NNX model for config.json, computing in `dtype`."""
    return Qwen2(tunix_config(hf_config, dtype), rngs=rngs)
