"""Small helpers the family modules share: reading config.json and refusing what Tunix cannot run."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from lora_trainer.errors import UserError
from lora_trainer.models import remat
from lora_trainer.models.mapping import LoraTarget, WeightRule


def head_dim(hf_config: Mapping[str, Any]) -> int:
    """config.json `head_dim`, or hidden_size / num_attention_heads when absent (older configs)."""
    value = hf_config.get("head_dim")
    return int(value) if value else int(hf_config["hidden_size"]) // int(hf_config["num_attention_heads"])


def decoder_dims(hf_config: Mapping[str, Any]) -> dict[str, int]:
    """The shape arguments every Tunix decoder ModelConfig (llama3, qwen2, qwen3) takes, from config.json."""
    return {
        "num_layers": int(hf_config["num_hidden_layers"]),
        "vocab_size": int(hf_config["vocab_size"]),
        "embed_dim": int(hf_config["hidden_size"]),
        "hidden_dim": int(hf_config["intermediate_size"]),
        "num_heads": int(hf_config["num_attention_heads"]),
        "head_dim": head_dim(hf_config),
        "num_kv_heads": int(hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]),
    }


def axis_sizes(hf_config: Mapping[str, Any]) -> dict[str, int]:
    """Sizes of the weight tables' axis letters (d embed, n query heads, k kv heads, h head_dim, f MLP, v vocab)."""
    heads = int(hf_config["num_attention_heads"])
    return {
        "d": int(hf_config["hidden_size"]),
        "n": heads,
        "k": int(hf_config.get("num_key_value_heads") or heads),
        "h": head_dim(hf_config),
        "f": int(hf_config["intermediate_size"]),
        "v": int(hf_config["vocab_size"]),
    }


def require(hf_config: Mapping[str, Any], family: str, key: str, allowed: tuple[Any, ...], default: Any) -> None:
    """Refuse a config.json setting the family's NNX model does not implement, naming it."""
    value = hf_config.get(key, default)
    if value not in allowed:
        raise UserError(
            f"config.json: {key}={value!r} is not supported for family {family} "
            f"(supported: {', '.join(repr(a) for a in allowed)}); use a checkpoint with a standard {family} config"
        )


def untied(hf_config: Mapping[str, Any]) -> bool:
    """True when config.json has a separate lm_head (tie_word_embeddings false)."""
    return not hf_config.get("tie_word_embeddings", False)


#: HF layer prefix shared by the Llama-style families (Llama 3, Qwen3, Qwen2).
LAYER = "model.layers.{i}"

#: The seven projections of a Llama-style decoder layer: (HF module, NNX module, weight, HF axes, NNX axes).
_PROJECTIONS = (
    ("self_attn.q_proj", "attn/q_proj", "w", "(n h) d", "d n h"),
    ("self_attn.k_proj", "attn/k_proj", "w", "(k h) d", "d k h"),
    ("self_attn.v_proj", "attn/v_proj", "w", "(k h) d", "d k h"),
    ("self_attn.o_proj", "attn/o_proj", "w", "d (n h)", "n h d"),
    ("mlp.gate_proj", "mlp/gate_proj", "kernel", "f d", "d f"),
    ("mlp.up_proj", "mlp/up_proj", "kernel", "f d", "d f"),
    ("mlp.down_proj", "mlp/down_proj", "kernel", "d f", "f d"),
)


def llama_style_tables(extra: tuple[WeightRule, ...] = ()) -> tuple[tuple[WeightRule, ...], tuple[LoraTarget, ...]]:
    """(weight table, LoRA targets) of a Tunix Llama-style model (llama3, qwen3, qwen2 share the layout).

    `extra` adds family-specific tensors (Qwen3's q/k norms, Qwen2's q/k/v biases).
    """
    projections = {
        nnx_mod: WeightRule(f"{LAYER}.{hf_mod}.weight", f"layers/{{i}}/{nnx_mod}/{w}", hf_axes, nnx_axes)
        for hf_mod, nnx_mod, w, hf_axes, nnx_axes in _PROJECTIONS
    }
    weights = (
        WeightRule("model.embed_tokens.weight", "embedder/input_embedding", "v d", "v d"),
        WeightRule(f"{LAYER}.input_layernorm.weight", "layers/{i}/input_layernorm/w", "d", "d"),
        WeightRule(f"{LAYER}.post_attention_layernorm.weight", "layers/{i}/post_attention_layernorm/w", "d", "d"),
        *projections.values(),
        *extra,
        WeightRule("model.norm.weight", "final_norm/w", "d", "d"),
        WeightRule("lm_head.weight", "lm_head/w", "v d", "d v", when=untied),
    )
    targets = tuple(
        LoraTarget(f"layers/{{i}}/{nnx_mod}", f"{LAYER}.{hf_mod}", projections[nnx_mod])
        for hf_mod, nnx_mod, *_ in _PROJECTIONS
    )
    return weights, targets


def use_attention(module: ModuleType, attention: type) -> None:
    """Make the Tunix model `module` build `attention` (a subclass of its `Attention`) in every decoder layer.

    Tunix's decoder layers look `Attention` up in their module when they are built, so this is
    the one seam that swaps the attention's training path without copying the model classes
    (the same kind of seam as `rope.install_seam`). The subclass keeps Tunix's parameters and
    module paths and hands the KV-cache (sampling) path back to Tunix. Idempotent.
    """
    if not issubclass(module.Attention, attention):
        module.Attention = attention


def use_remat(module: ModuleType) -> None:
    """Make the Tunix model `module` build decoder layers that rematerialise by `models.remat`'s policies.

    Tunix's layers only know "remat the whole layer" (its `RematConfig`, fixed when the model is
    built); the subclass reads a policy name set on each layer after loading (`remat.apply`),
    so one loaded model serves training with any `training.remat` and the forward-only paths
    (export, scoring) never pay for it. The same kind of seam as `use_attention`. Idempotent.
    """
    if getattr(module.DecoderLayer, "remat_policy", False) is not False:
        return

    class DecoderLayer(module.DecoderLayer):  # type: ignore[name-defined,misc]
        remat_policy: str | None = None
        """A name in `remat.POLICIES`, or None: Tunix's own behaviour."""

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            if self.remat_policy is None:
                return super().__call__(*args, **kwargs)
            return nnx.remat(type(self).block, policy=remat.POLICIES[self.remat_policy])(self, *args, **kwargs)

    module.DecoderLayer = DecoderLayer


def einsum_taking_quantized_weights(module: ModuleType) -> None:
    """Make the Tunix model `module` (qwen2, qwen3) build an `Einsum` that passes a QLoRA weight on as is.

    Tunix's qwen Einsums cast their weight with `jnp.astype` before the einsum; under QLoRA the
    weight is Qwix's quantized value (not an array), which only Qwix's intercepted einsum takes,
    so every Qwen QLoRA run raised TypeError at its first step (llama3's and gemma3's Einsums pass
    the weight straight through). Arrays are cast as before. The same seam as `use_attention`.
    """
    if getattr(module.Einsum, "takes_quantized_weights", False):
        return

    class Einsum(module.Einsum):  # type: ignore[name-defined,misc]
        takes_quantized_weights = True

        @jax.named_scope("einsum")
        def __call__(self, x: Any) -> jax.Array:
            w = self.w.value
            if isinstance(w, jax.Array):
                w = jnp.astype(w, self.dtype)
            return jnp.einsum(self.einsum_str, jnp.astype(x, self.dtype), w)

    module.Einsum = Einsum


def lazy_build(module: str) -> Callable[[Mapping[str, Any], Any, Any], Any]:
    """The `build` of `module`, imported at its first call.

    Why: the family's model code imports Tunix, which pulls in torch, pandas and
    tensorboardX (~3 s). Export and conversion need only the weight and LoRA tables, so an
    AdapterConversion Job or the post-training export never pays for it.
    """

    def build(hf_config: Mapping[str, Any], dtype: Any, rngs: Any) -> Any:
        return importlib.import_module(module).build(hf_config, dtype, rngs)

    return build
