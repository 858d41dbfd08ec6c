"""`lm_loss` is next-token cross-entropy over exactly the targets the masks allow."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lora_trainer.cross_entropy import token_nll
from lora_trainer.loss import lm_loss, model_inputs


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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_token_nll_has_the_generic_formulas_values_and_gradients(dtype) -> None:
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((3, 6, 13)) * 4, dtype)
    targets = jnp.asarray(rng.integers(0, 13, (3, 6)), jnp.int32)
    weight = jnp.asarray(rng.random((3, 6)), jnp.float32)

    def generic(x: jnp.ndarray) -> jnp.ndarray:
        x = x.astype(jnp.float32)
        return ((jax.nn.logsumexp(x, axis=-1) - jnp.take_along_axis(x, targets[..., None], axis=-1)[..., 0]) * weight).sum()

    def ours(x: jnp.ndarray) -> jnp.ndarray:
        return (token_nll(x, targets) * weight).sum()

    want, want_grad = jax.jit(jax.value_and_grad(generic))(logits)
    got, got_grad = jax.jit(jax.value_and_grad(ours))(logits)
    assert got_grad.dtype == dtype
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got_grad, np.float32), np.asarray(want_grad, np.float32), atol=2e-7 if dtype == jnp.float32 else 0)


def _entry_arrays_of(compiled_hlo: str, dims: str) -> list[str]:
    """Instructions of the compiled entry computation whose result has shape `dims` (e.g. "2,8,1024")."""
    entry = compiled_hlo[compiled_hlo.index("\nENTRY ") :]
    return [line.strip() for line in entry.splitlines() if re.search(rf"= \w+\[{dims}\]", line) and "parameter(" not in line]


def test_token_nll_writes_nothing_of_the_logits_size_but_their_gradient() -> None:
    """The point of the custom backward (fails with the generic formula, which writes four float32
    copies of the logits and scatters the target's gradient into one)."""
    logits = jnp.zeros((2, 8, 1024), jnp.bfloat16)
    targets = jnp.zeros((2, 8), jnp.int32)
    hlo = jax.jit(jax.value_and_grad(lambda x: token_nll(x, targets).sum())).lower(logits).compile().as_text()
    written = _entry_arrays_of(hlo, "2,8,1024")
    assert len(written) == 1 and written[0].split("= ")[1].startswith("bf16["), written
    assert "scatter" not in hlo
