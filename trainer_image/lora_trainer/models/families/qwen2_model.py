"""Qwen2 / Qwen2.5 on Tunix's qwen2 model.

Tunix's qwen2 takes `rope_theta` from its config (no seam needed) but has no rope
scaling and no sliding window: configs that use either are refused rather than run wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
from flax import nnx
from tunix.models.qwen2 import model as tunix_qwen2

from lora_trainer.errors import UserError
from lora_trainer.models import rope
from lora_trainer.models.families.common import decoder_dims, require


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


def build(hf_config: Mapping[str, Any], dtype: jnp.dtype, rngs: nnx.Rngs) -> tunix_qwen2.Qwen2:
    """The NNX model for config.json, computing in `dtype`."""
    return tunix_qwen2.Qwen2(tunix_config(hf_config, dtype), rngs=rngs)
