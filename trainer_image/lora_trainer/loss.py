"""What the adapter is trained on: the next-token loss and the model inputs it is computed from.

Tunix's PeftTrainer calls `model_inputs` on each batch and differentiates `lm_loss`; the
benchmark and the tests call the same two, so every path trains one objective.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from lora_trainer import fused_head
from lora_trainer.models.attention import SegmentMask


def model_inputs(batch: dict[str, jax.Array], *, splash: bool = False, interpret: bool = False) -> dict[str, Any]:
    """Batch -> loss-fn kwargs: a causal mask that never crosses packed examples or padding (segment 0).

    With `splash` the mask is passed as the segment ids themselves (`SegmentMask`), the form the
    splash kernel takes; `interpret` runs that kernel on the CPU (tests).
    """
    seg = batch["segment_ids"]
    if splash:
        mask: Any = SegmentMask(seg, interpret=interpret)
    else:
        length = seg.shape[1]
        causal = jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))
        mask = causal[None] & (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)
    return {
        "input_tokens": batch["input_tokens"],
        "input_mask": batch["input_mask"],
        "segment_ids": seg,
        "positions": batch["positions"],
        "attention_mask": mask,
        **({"loss_norm": batch["loss_norm"]} if "loss_norm" in batch else {}),
    }


def lm_loss(
    model: nnx.Module,
    input_tokens: jax.Array,
    input_mask: jax.Array,
    segment_ids: jax.Array,
    positions: jax.Array,
    attention_mask: jax.Array | SegmentMask,
    loss_norm: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean next-token cross-entropy over loss-masked targets (float32), plus token counts for progress.

    The value differentiated is the summed loss over `loss_norm` (each row holds the same value;
    see `data.BatchStream`) when the batch has one, so that accumulated micro-batches weigh every
    token of the optimizer step alike; the aux `loss` is always this batch's own mean.

    A target counts only if it is in the loss mask and in the same packed example as the
    token predicting it. A model whose head defers (`fused_head`) never forms the whole logits;
    one that returns them is scored from them. Every position is scored (the last position,
    which predicts nothing, gets weight 0): slicing `logits[:, :-1]` would copy the
    [batch, seq, vocab] tensor forward and pad its gradient back, the two largest
    non-matmul costs of a step on the benchmark model.
    """
    with fused_head.deferred() as head:
        logits, _ = model(input_tokens, positions, None, attention_mask)  # empty if the head deferred
    targets = jnp.roll(input_tokens, -1, axis=1)
    weight = (input_mask[:, 1:] > 0) & (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] > 0)
    weight = jnp.pad(weight, ((0, 0), (0, 1))).astype(jnp.float32)
    nll = head.token_nll(logits, targets)  # float32, from the logits in their own dtype (see cross_entropy)
    n = weight.sum()
    total = (nll * weight).sum()
    loss = total / jnp.maximum(n, 1.0)
    objective = loss if loss_norm is None else total / jnp.max(loss_norm)
    return objective, {"loss": loss, "target_tokens": n, "tokens": (segment_ids > 0).sum()}
