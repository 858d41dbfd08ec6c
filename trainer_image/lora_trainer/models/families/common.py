"""Small helpers the family modules share: reading config.json and refusing what Tunix cannot run."""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from lora_trainer import fused_head
from lora_trainer.errors import UserError
from lora_trainer.models import layer_stack, remat
from lora_trainer.models.mapping import head_dim


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


def require(hf_config: Mapping[str, Any], family: str, key: str, allowed: tuple[Any, ...], default: Any) -> None:
    """Refuse a config.json setting the family's NNX model does not implement, naming it."""
    value = hf_config.get(key, default)
    if value not in allowed:
        raise UserError(
            f"config.json: {key}={value!r} is not supported for family {family} "
            f"(supported: {', '.join(repr(a) for a in allowed)}); use a checkpoint with a standard {family} config"
        )


def use_attention(module: ModuleType, attention: type) -> None:
    """Make the Tunix model `module` build `attention` (a subclass of its `Attention`) in every decoder layer.

    Tunix's decoder layers look `Attention` up in their module when they are built, so this is
    the one seam that swaps the attention's training path without copying the model classes
    (the same kind of seam as `rope.install_seam`). The subclass keeps Tunix's parameters and
    module paths and hands the KV-cache (sampling) path back to Tunix. Idempotent.
    """
    if not issubclass(module.Attention, attention):
        module.Attention = attention


def use_decoder_layer(module: ModuleType) -> None:
    """Make the Tunix model `module` build decoder layers that rematerialise by `models.remat`'s
    policies and take part in a scanned forward pass (`models.layer_stack`).

    Tunix's layers only know "remat the whole layer" (its `RematConfig`, fixed when the model is
    built); the subclass reads a policy name set on each layer after loading (`remat.apply`),
    so one loaded model serves training with any `training.remat` and the forward-only paths
    (export, scoring) never pay for it. Tunix's layer loop is kept: in a scanned pass the first
    layer runs the scan and the others pass through. The same kind of seam as `use_attention`.
    Idempotent.
    """
    if getattr(module.DecoderLayer, "remat_policy", False) is not False:
        return

    class DecoderLayer(module.DecoderLayer):  # type: ignore[name-defined,misc]
        remat_policy: str | None = None
        """A name in `remat.POLICIES`, or None: Tunix's own behaviour."""

        def __call__(self, x: jax.Array, *args: Any, **kwargs: Any) -> Any:
            scanned = layer_stack.scanned_call(self, x, args, kwargs)
            return self.unscanned_call(x, *args, **kwargs) if scanned is None else scanned

        def unscanned_call(self, *args: Any, **kwargs: Any) -> Any:
            """This one layer's forward pass (Tunix's), rematerialised by its policy."""
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


#: The einsum of Tunix's untied LM head (llama3, qwen2, qwen3); its projections use other subscripts.
HEAD_EINSUM = "BTD,DV->BTV"


def use_deferred_head(module: ModuleType) -> None:
    """Make the Tunix model `module` build an embedder and LM head that hand their operands to
    `fused_head.deferred()`, so the loss computes the logits chunk by chunk (see there).

    Both keep Tunix's computation outside that block. The same kind of seam as `use_attention`.
    Idempotent.
    """
    if getattr(module.Embedder, "defers_head", False):
        return

    class Embedder(module.Embedder):  # type: ignore[name-defined,misc]
        defers_head = True

        def decode(self, x: Any) -> Any:
            out = fused_head.defer(self, x, self.input_embedding.value, vocab_major=True)
            return super().decode(x) if out is None else out

    class Einsum(module.Einsum):  # type: ignore[name-defined,misc]
        def __call__(self, x: Any) -> Any:
            out = fused_head.defer(self, x, self.w.value, vocab_major=False) if self.einsum_str == HEAD_EINSUM else None
            return super().__call__(x) if out is None else out

    module.Embedder = Embedder
    module.Einsum = Einsum
