"""One forward pass as Tunix's models expect it: positions and a [B, T, T] boolean mask."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lora_trainer.errors import UserError


def positions_and_mask(tokens: jax.Array, attention_mask: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Positions (counting only real tokens, so left padding works) and causal & padding mask [B, T, T]."""
    b, t = tokens.shape
    valid = jnp.ones((b, t), dtype=jnp.bool_) if attention_mask is None else attention_mask.astype(jnp.bool_)
    positions = jnp.maximum(jnp.cumsum(valid.astype(jnp.int32), axis=-1) - 1, 0)
    causal = jnp.tril(jnp.ones((t, t), dtype=jnp.bool_))
    return positions, causal[None, :, :] & valid[:, None, :]


@nnx.jit
def _forward(model: nnx.Module, tokens: jax.Array, attention_mask: jax.Array | None) -> jax.Array:
    positions, mask = positions_and_mask(tokens, attention_mask)
    logits, _ = model(tokens, positions, None, mask)
    return logits.astype(jnp.float32)


def forward_logits(model: nnx.Module, tokens: np.ndarray, *, attention_mask: np.ndarray | None = None) -> jax.Array:
    """Logits [B, T, V] float32 for int tokens [B, T] (attention_mask [B, T]: 1 real, 0 padding).

    Token ids outside the vocabulary are a UserError: JAX would silently clamp the lookup.
    """
    tokens = np.asarray(tokens)
    vocab = model.embedder.input_embedding.get_value().shape[0]
    if tokens.ndim != 2 or tokens.size == 0:
        raise UserError(f"tokens must be a non-empty [batch, length] array, got shape {list(tokens.shape)}")
    if tokens.min() < 0 or tokens.max() >= vocab:
        raise UserError(f"token ids must be in [0, {vocab - 1}] (the model's vocabulary), got {tokens.min()}..{tokens.max()}")
    tokens = jnp.asarray(tokens, dtype=jnp.int32)
    mask = None if attention_mask is None else jnp.asarray(attention_mask, dtype=jnp.bool_)
    return _forward(model, tokens, mask)
