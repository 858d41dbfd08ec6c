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


def test_a_device_copy_is_one_transfer_and_outlives_the_donated_originals(monkeypatch: pytest.MonkeyPatch) -> None:
    """The snapshot is copied on the device before the next step donates the state: one batched
    transfer with no program to compile (a jitted copy compiled for 3.2 s at each process's first save)."""
    state = {"a": jnp.arange(6.0), "b": jnp.ones(4, jnp.bfloat16), "count": 3}
    transfers: list[tuple[int, dict[str, Any]]] = []
    device_put = jax.device_put

    def counted(arrays: Any, shardings: Any, **kwargs: Any) -> Any:
        transfers.append((len(arrays), kwargs))
        return device_put(arrays, shardings, **kwargs)

    monkeypatch.setattr(jax, "device_put", counted)
    copy = async_saves._device_copy(state)
    assert transfers == [(2, {"may_alias": False})] and copy["count"] == 3
    assert copy["a"].sharding == state["a"].sharding
    assert copy["a"].unsafe_buffer_pointer() != state["a"].unsafe_buffer_pointer()
    stepped = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)({k: state[k] for k in ("a", "b")})
    assert state["a"].is_deleted()
    np.testing.assert_array_equal(np.asarray(copy["a"]), np.arange(6.0))
    np.testing.assert_array_equal(np.asarray(stepped["a"]), np.arange(6.0) + 1)
