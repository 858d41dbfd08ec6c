"""MFU: the chip's peak comes from JAX's device_kind, matched by whole words."""

from __future__ import annotations

import pytest

from lora_trainer.metrics import mfu, peak_flops_per_device


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
