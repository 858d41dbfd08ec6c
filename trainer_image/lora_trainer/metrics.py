"""FLOPs and MFU estimates: what fraction of the chips' peak the LoRA step uses.

LoRA training FLOPs per token are counted as 4 x (base matmul parameters): a forward pass
(2N) plus a backward pass that needs only activation gradients (2N), since the frozen
weights get no weight gradients; the LoRA matmuls (rank << hidden) and attention scores
are added explicitly. A full fine-tune would be 6N, the usual MFU convention.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

#: Dense bf16 peak FLOP/s per chip (per device JAX reports), by a substring of `device.device_kind`.
#: Public figures: Cloud TPU docs (v4 275T, v5e 197T, v5p 459T, v6e 918T), NVIDIA datasheets (dense, no sparsity).
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("TPU v6", 918e12),  # v6e (Trillium), device_kind "TPU v6 lite"
    ("TPU v5p", 459e12),
    ("TPU v5 lite", 197e12),  # v5e
    ("TPU v5e", 197e12),
    ("TPU v5", 459e12),  # "TPU v5" is v5p
    ("TPU v4", 275e12),
    ("H200", 989e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
)


def peak_flops_per_device(device_kind: str) -> float | None:
    """Peak bf16 FLOP/s of one device, or None when unknown (e.g. CPU), so MFU is reported as null.

    A key matches whole words only ("L4" is not "NVIDIA L40S").
    """
    for key, flops in PEAK_FLOPS:
        if re.search(rf"\b{re.escape(key)}\b", device_kind, re.IGNORECASE):
            return flops
    return None


def lora_train_flops_per_token(
    *, matmul_params: int, lora_params: int, num_layers: int, attn_width: int, seq_len: int
) -> float:
    """FLOPs to train on one token with frozen base weights (see module docstring).

    `matmul_params`: base weights used in matmuls (projections and the LM head; not the
    embedding lookup). `attn_width`: num_heads * head_dim. Attention's two products (scores,
    values) cost 2 * 2 * seq * width per layer forward, halved by causality; the backward forms
    four (the gradients of q, k and v all reach adapted projections): twice the forward.
    """
    base = 4.0 * matmul_params
    lora = 6.0 * lora_params  # LoRA weights do get weight gradients
    attention = 3 * 2.0 * num_layers * seq_len * attn_width  # (fwd + 2 x fwd) x causal forward 2*L*T*W
    return base + lora + attention


def mfu(tokens_per_second: float, flops_per_token: float, device_kinds: Sequence[str]) -> float | None:
    """Model FLOPs utilisation across all devices, or None if any device's peak is unknown."""
    peaks = [peak_flops_per_device(k) for k in device_kinds]
    if not peaks or any(p is None for p in peaks):
        return None
    return tokens_per_second * flops_per_token / sum(p for p in peaks if p is not None)
