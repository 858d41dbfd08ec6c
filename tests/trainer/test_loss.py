"""`lm_loss` is next-token cross-entropy over exactly the targets the masks allow."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from lora_trainer.train import lm_loss, model_inputs


def test_lm_loss_matches_a_per_token_reference() -> None:
    rng = np.random.default_rng(0)
    b, t, v = 2, 7, 11
    logits = rng.standard_normal((b, t, v)).astype(np.float32) * 3
    tokens = rng.integers(0, v, (b, t)).astype(np.int32)
    loss_mask = np.array([[0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 0]], dtype=np.int32)
    segments = np.array([[1, 1, 1, 2, 2, 2, 2], [1, 1, 1, 1, 1, 0, 0]], dtype=np.int32)  # packed; padded
    positions = np.tile(np.arange(t, dtype=np.int32), (b, 1))

    def model(*_: object) -> tuple[jnp.ndarray, None]:
        return jnp.asarray(logits), None

    batch = {"input_tokens": tokens, "input_mask": loss_mask, "segment_ids": segments, "positions": positions}
    loss, aux = lm_loss(model, **model_inputs({k: jnp.asarray(x) for k, x in batch.items()}))

    nll = []
    for i in range(b):
        for j in range(t - 1):
            if loss_mask[i, j + 1] and segments[i, j + 1] == segments[i, j] and segments[i, j + 1] > 0:
                z = logits[i, j].astype(np.float64)
                nll.append(np.log(np.exp(z - z.max()).sum()) + z.max() - z[tokens[i, j + 1]])
    assert float(aux["target_tokens"]) == len(nll) == 8
    assert float(loss) == pytest.approx(np.mean(nll), rel=1e-6)
    assert int(aux["tokens"]) == int((segments > 0).sum())
