"""Gemma 3 (text) on Tunix's gemma3 model, with the layer pattern, rope and K/V split from config.json.

Three fixes over a plain Tunix Gemma3 built from presets:
- Tunix cycles a fixed 5-local:1-global pattern; config.json's `layer_types` (or
  `sliding_window_pattern`) decides here, with each layer's rope base and scale set to match.
- Tunix fuses K and V into one `kv_einsum` (and Q/K/V into `qkv_einsum` without GQA), so one
  LoRA would share its A matrix between K and V and could not be exported to or imported
  from HF PEFT, which has separate `k_proj` / `v_proj`. `SplitKV` keeps them separate:
  `attn/kv_einsum/k_proj` and `attn/kv_einsum/v_proj`.
- Settings Tunix hard-codes (RMSNorm eps 1e-6, no logit soft-capping, tanh GELU, tied
  embeddings) are checked against config.json and refused when they differ.
Its attention trains through `models.attention.causal_gqa_attention` (see there for why).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from tunix.models.gemma3 import model as tunix_gemma3

from lora_trainer.errors import UserError
from lora_trainer.models import rope
from lora_trainer.models.attention import causal_gqa_attention
from lora_trainer.models.families.common import head_dim, require, use_attention, use_decoder_layer, use_deferred_head

Norm = tunix_gemma3.QueryPreAttentionNormalisation
LOCAL, GLOBAL = tunix_gemma3.AttentionType.LOCAL_SLIDING, tunix_gemma3.AttentionType.GLOBAL
shard = tunix_gemma3.sharding_utils.shard


class Attention(tunix_gemma3.Attention):
    """Tunix's gemma3 attention; without a KV cache the core is `causal_gqa_attention`.

    As Tunix: q/k RMSNorm, per-layer rope, the query scaled before the scores, and a local
    layer attending to keys less than `sliding_window_size` positions away.
    """

    def block(self, x: jax.Array, segment_pos: jax.Array, cache: Any, attn_mask: jax.Array) -> tuple[Any, jax.Array]:
        if cache is not None or self.use_qkv_einsum:  # sampling, or a plain Tunix MHA model's fused Q/K/V
            return super().block(x, segment_pos, cache, attn_mask)
        btnh = self.shd_config.act_btnh
        k, v = self.kv_einsum(x)
        q = self._query_norm(shard(self.q_einsum(x), btnh))
        k, v = self._key_norm(shard(k, btnh)), shard(v, btnh)
        q, k = (
            tunix_gemma3.apply_rope(
                y, segment_pos, head_dim=self.head_dim, base_frequency=self.rope_base_frequency, scale_factor=self.rope_scale_factor
            )
            for y in (q, k)
        )
        window = self.sliding_window_size if self.attn_type == LOCAL else None
        out = causal_gqa_attention(q * self.query_pre_attn_scalar, k, v, attn_mask, 1.0, window=window)
        return None, shard(self.attn_vec_einsum(out), self.shd_config.act_btd)


use_attention(tunix_gemma3, Attention)
use_decoder_layer(tunix_gemma3)
use_deferred_head(tunix_gemma3)


class SplitKV(nnx.Module):
    """K and V projections as two einsums, called like Tunix's fused `kv_einsum` (returns (k, v))."""

    def __init__(
        self, num_kv_heads: int, features: int, head_dim: int, *, sharding: tuple, param_dtype: jnp.dtype, rngs: nnx.Rngs
    ):
        shape = (num_kv_heads, features, head_dim)
        self.k_proj = tunix_gemma3.Einsum("BSD,KDH->BSKH", shape, rngs=rngs, sharding=sharding, param_dtype=param_dtype)
        self.v_proj = tunix_gemma3.Einsum("BSD,KDH->BSKH", shape, rngs=rngs, sharding=sharding, param_dtype=param_dtype)
        self.shape = (2, *shape)  # what Tunix's Attention.num_kv_heads reads

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return self.k_proj(x), self.v_proj(x)


def layer_types(hf_config: Mapping[str, Any]) -> list[str]:
    """`sliding_attention` / `full_attention` per layer, from layer_types or the sliding-window pattern."""
    n = int(hf_config["num_hidden_layers"])
    if hf_config.get("layer_types"):
        types = list(hf_config["layer_types"])
        if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
            raise UserError(f"config.json: layer_types must list {n} entries of sliding_attention/full_attention")
        return types
    pattern = int(hf_config.get("sliding_window_pattern") or hf_config.get("_sliding_window_pattern") or 6)
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]


def rope_specs(hf_config: Mapping[str, Any]) -> dict[str, rope.RopeSpec]:
    """Rope of local and global layers: transformers 5 `rope_parameters` per layer type, or 4.x fields."""
    params = hf_config.get("rope_parameters")
    if params and "sliding_attention" in params:
        specs = {t: rope.rope_from_params(params[t], theta=None, where="config.json") for t in params}
    else:
        specs = {
            "sliding_attention": rope.RopeSpec(theta=float(hf_config.get("rope_local_base_freq", 10_000.0))),
            "full_attention": rope.hf_rope(hf_config),
        }
    for layer_type, spec in specs.items():
        if spec.rope_type not in ("default", "linear"):
            raise UserError(
                f"config.json: gemma3 {layer_type} rope type {spec.rope_type!r} is not supported (default, linear)"
            )
    return specs


def _query_norm(hf_config: Mapping[str, Any]) -> Norm:
    scalar = hf_config.get("query_pre_attn_scalar", head_dim(hf_config))
    if scalar == head_dim(hf_config):
        return Norm.BY_ONE_OVER_SQRT_HEAD_DIM
    if scalar == int(hf_config["hidden_size"]) // int(hf_config["num_attention_heads"]):
        return Norm.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS
    raise UserError(
        f"config.json: query_pre_attn_scalar {scalar} is neither head_dim nor hidden_size / num_attention_heads; "
        "Tunix's gemma3 supports only those two"
    )


def tunix_config(hf_config: Mapping[str, Any], dtype: jnp.dtype = jnp.float32) -> tunix_gemma3.ModelConfig:
    """Tunix ModelConfig with every hyperparameter from config.json (per-layer rope is set in `build`)."""
    if hf_config.get("model_type") == "gemma3":
        raise AssertionError("a multimodal config.json: build the decoder from FamilySpec.for_checkpoint's text config")
    require(hf_config, "gemma3", "hidden_activation", ("gelu_pytorch_tanh",), "gelu_pytorch_tanh")
    require(hf_config, "gemma3", "rms_norm_eps", (1e-6,), 1e-6)
    require(hf_config, "gemma3", "final_logit_softcapping", (None,), None)
    require(hf_config, "gemma3", "attn_logit_softcapping", (None,), None)
    require(hf_config, "gemma3", "attention_bias", (False,), False)
    require(hf_config, "gemma3", "tie_word_embeddings", (True,), True)
    require(hf_config, "gemma3", "use_bidirectional_attention", (False, None), False)
    specs = rope_specs(hf_config)
    return tunix_gemma3.ModelConfig(
        num_layers=int(hf_config["num_hidden_layers"]),
        num_embed=int(hf_config["vocab_size"]),
        embed_dim=int(hf_config["hidden_size"]),
        hidden_dim=int(hf_config["intermediate_size"]),
        num_heads=int(hf_config["num_attention_heads"]),
        head_dim=head_dim(hf_config),
        num_kv_heads=int(hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]),
        sliding_window_size=int(hf_config["sliding_window"]),
        local_base_frequency=specs["sliding_attention"].theta,
        global_base_frequency=specs["full_attention"].theta,
        local_scale_factor=specs["sliding_attention"].factor,
        global_scale_factor=specs["full_attention"].factor,
        query_pre_attn_norm=_query_norm(hf_config),
        param_dtype=dtype,
    )


def build(hf_config: Mapping[str, Any], dtype: jnp.dtype, rngs: nnx.Rngs) -> tunix_gemma3.Gemma3:
    """The NNX model for config.json: Tunix Gemma3 with config.json's layer pattern and split K/V."""
    config = tunix_config(hf_config, dtype)
    specs = rope_specs(hf_config)
    model = tunix_gemma3.Gemma3(config, rngs=rngs)
    for layer, layer_type in zip(model.layers, layer_types(hf_config), strict=True):
        attn = layer.attn
        attn.attn_type = GLOBAL if layer_type == "full_attention" else LOCAL
        attn.rope_base_frequency = specs[layer_type].theta
        attn.rope_scale_factor = specs[layer_type].factor
        if attn.use_qkv_einsum:
            del attn.qkv_einsum
            attn.q_einsum = tunix_gemma3.Einsum(
                "BTD,NDH->BTNH",
                (config.num_heads, config.embed_dim, config.head_dim),
                rngs=rngs,
                sharding=config.shd_config.q_weight_ndh,
                param_dtype=dtype,
            )
        attn.kv_einsum = SplitKV(
            config.num_kv_heads,
            config.embed_dim,
            config.head_dim,
            sharding=config.shd_config.q_weight_ndh,
            param_dtype=dtype,
            rngs=rngs,
        )
    return model
