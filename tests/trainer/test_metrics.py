"""MFU: the chip's peak comes from JAX's device_kind, matched by whole words."""

from __future__ import annotations

import pytest

from lora_trainer.metrics import lora_train_flops_per_token, mfu, peak_flops_per_device


@pytest.mark.parametrize(
    ("kind", "peak"),
    [
        ("TPU v6 lite", 918e12),
        ("TPU v5 lite", 197e12),
        ("TPU v5", 459e12),
        ("TPU v4", 275e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40S", 362e12),  # not the L4's peak
        ("NVIDIA L40", None),
        ("cpu", None),
    ],
)
def test_peak_flops_by_device_kind(kind, peak):
    assert peak_flops_per_device(kind) == peak


def test_mfu_is_null_when_any_peak_is_unknown():
    assert mfu(1000.0, 1e9, ["NVIDIA L4"]) == pytest.approx(1e12 / 121e12)
    assert mfu(1000.0, 1e9, ["cpu", "cpu"]) is None


def test_flops_per_token_counts_attentions_backward_as_two_forwards():
    """Causal attention forward: 2 * seq * width per layer (scores and values, half the square); its
    backward forms the gradients of q, k and v: twice that (it was counted as one forward)."""
    attention = lora_train_flops_per_token(matmul_params=0, lora_params=0, num_layers=4, attn_width=512, seq_len=256)
    assert attention == 3 * (2 * 256 * 512) * 4
    # Frozen weights: forward + activation gradients (4N); LoRA weights also get weight gradients (6N).
    assert lora_train_flops_per_token(matmul_params=1000, lora_params=10, num_layers=0, attn_width=0, seq_len=0) == 4060
