"""What the save thread hands Orbax: the snapshot on the host, copied in one batched transfer."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lora_trainer import async_saves


def test_a_snapshot_reaches_orbax_as_host_arrays_in_one_transfer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Given device arrays, Orbax's save slowed the step it overlapped by 0.4 s on the chip; given
    host arrays, by 0.02 s (docs/benchmarks.md, "TPU"). One `device_get` for all of them, not one each."""
    snapshot = {"step": 4, "lora": {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(4, jnp.bfloat16)},
                "optimizer": {"count": jnp.int32(7)}, "data": {"position": 12}, "metadata": {"family": "llama3"}}
    transfers: list[int] = []
    device_get = jax.device_get

    def counted(arrays: Any) -> Any:
        transfers.append(len(arrays))
        return device_get(arrays)

    monkeypatch.setattr(jax, "device_get", counted)
    host = async_saves._on_host(snapshot)
    assert transfers == [3]
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves({k: host[k] for k in ("lora", "optimizer")}))
    np.testing.assert_array_equal(host["lora"]["a"], np.arange(6.0).reshape(2, 3))
    assert host["lora"]["b"].dtype == jnp.bfloat16 and int(host["optimizer"]["count"]) == 7
    assert (host["step"], host["data"], host["metadata"]) == (4, {"position": 12}, {"family": "llama3"})
