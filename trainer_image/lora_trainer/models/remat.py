"""What the backward pass recomputes (`training.remat`), and which policy a run uses.

Why: without rematerialisation the backward pass keeps every activation of every layer; on a
v5e chip (15.7 GiB) a Llama-3.2-1B-shaped model then fits only one 2048-token row per
micro-batch, which leaves the chip's matrix units half idle. The policies, per decoder layer:
  - `dots` keeps the outputs of the weight products (no batch dimensions: the projections and
    the MLP) and the attention kernel's residuals, and recomputes the elementwise work between
    them (norms, rope, SiLU, residual adds): little extra compute, little memory back (the
    products are most of what a layer keeps);
  - `full` keeps only each layer's input and runs the layer's forward pass again in the
    backward pass: the least memory, about a third more compute;
  - `none` keeps everything: Tunix's own behaviour.
The values are the same under every policy: recomputing runs the same operations.
"""

from __future__ import annotations

import jax
from flax import nnx

from lora_trainer.config import Remat

_cp = jax.checkpoint_policies

#: Name under which the attention kernel tags its residuals (`models.splash`): `dots` keeps them,
#: so a backward pass never runs the attention forward again.
RESIDUALS = "attention_residuals"

#: Name under which a weight product whose dot JAX cannot see is tagged, so `dots` keeps it as it keeps
#: a plain dot's output: the trainer's products are custom_vjp functions (`accumulating_dot`,
#: `quantized_product`, `lora_provider.lora_delta`), which a policy sees only as an opaque call to
#: recompute. Untagged, `dots` kept none of a LoRA model's products and recomputed every layer's
#: forward matmuls, as `full` does (a LoRA step then cost as much per token as a full fine-tune).
PRODUCTS = "weight_products"

#: Policy name -> JAX rematerialisation policy (`none` is the absence of one).
POLICIES = {
    "dots": _cp.save_from_both_policies(
        _cp.dots_with_no_batch_dims_saveable, _cp.save_only_these_names(RESIDUALS, PRODUCTS)
    ),
    "full": _cp.nothing_saveable,
}


def resolve(setting: Remat, backend: str) -> str:
    """The policy a run uses: `auto` is `full` on TPU (memory bounds the batch) and `none` elsewhere.

    Not `dots` on TPU: it keeps a layer's products, which are most of what `none` keeps (on the
    chip, a 4-layer 1B at micro-batch 4: 6.61 GiB of temporaries against 6.59 for `none` and 4.15
    for `full`), so neither a 1B at micro-batch 4 (about 0.6 GiB more per layer) nor a 3B at
    micro-batch 2 (about 15.5 GiB, from 10.96 GiB at micro-batch 1) fits 15.7 GiB under it.
    """
    if setting == "auto":
        return "full" if backend == "tpu" else "none"
    return setting


def apply(model: nnx.Module, policy: str) -> int:
    """Set `policy` (a resolved name) on every decoder layer of `model`; returns how many layers took it.

    Layers come from the families' `common.use_decoder_layer` seam; `none` restores Tunix's behaviour.
    """
    layers = [m for _, m in nnx.iter_modules(model) if hasattr(type(m), "remat_policy")]
    for layer in layers:
        layer.remat_policy = None if policy == "none" else policy
    return len(layers)
