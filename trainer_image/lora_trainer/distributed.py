"""Multi-host start-up from the pod's environment, the (data, fsdp, tp) device mesh, and
the processes' exchange of host data (`allgather_bytes`).

Two environments are understood, the explicit one first:
  - Explicit, what the operator renders on every pod of its JobSets (TPU or not;
    `lora_operator.render.distributed_env`): `JAX_COORDINATOR_ADDRESS` (host:port of process
    0), `JAX_PROCESS_COUNT`, and `JAX_PROCESS_ID`, or instead of the latter `LORA_JOB_INDEX` *
    `LORA_HOSTS_PER_SLICE` + `JOB_COMPLETION_INDEX` (the JobSet's job index and the Indexed
    Job's completion index, mapped by the downward API); `MEGASCALE_*` for several slices.
  - GKE's own, for a pod the operator did not render: GKE injects `TPU_WORKER_ID` /
    `TPU_WORKER_HOSTNAMES`; JAX's cluster detection reads them, so
    `jax.distributed.initialize()` is called without arguments.
A pod with neither is a single process and nothing is initialised.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

import jax
import numpy as np
from jax.experimental import multihost_utils

from lora_trainer.config import MeshSpec
from lora_trainer.errors import UserError

log = logging.getLogger(__name__)

#: Environment variables read here (the operator renders them; see module docstring).
COORDINATOR = "JAX_COORDINATOR_ADDRESS"
PROCESS_COUNT = "JAX_PROCESS_COUNT"
PROCESS_ID = "JAX_PROCESS_ID"
JOB_INDEX = "LORA_JOB_INDEX"
HOSTS_PER_SLICE = "LORA_HOSTS_PER_SLICE"
COMPLETION_INDEX = "JOB_COMPLETION_INDEX"
TPU_WORKER_ID = "TPU_WORKER_ID"
TPU_WORKER_HOSTNAMES = "TPU_WORKER_HOSTNAMES"
MEGASCALE_NUM_SLICES = "MEGASCALE_NUM_SLICES"

MESH_AXES = ("data", "fsdp", "tp")


@dataclass(frozen=True)
class ClusterEnv:
    """How this process joins the run: `kind` is "single", "explicit" or "tpu"."""

    kind: str
    coordinator: str | None = None
    process_count: int = 1
    process_id: int = 0


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError as e:
        raise UserError(f"environment variable {name}={env[name]!r} is not an integer; fix the pod template") from e


def cluster_env(env: Mapping[str, str]) -> ClusterEnv:
    """Decide from the environment how (and whether) to call `jax.distributed.initialize`. Pure."""
    if env.get(COORDINATOR):
        if PROCESS_COUNT not in env:
            raise UserError(f"{COORDINATOR} is set but {PROCESS_COUNT} is not; set both (and {PROCESS_ID})")
        if PROCESS_ID in env:
            pid = _int(env, PROCESS_ID)
        elif COMPLETION_INDEX in env:
            pid = _int(env, JOB_INDEX) * _int(env, HOSTS_PER_SLICE) if JOB_INDEX in env else 0
            pid += _int(env, COMPLETION_INDEX)
        else:
            raise UserError(f"{COORDINATOR} is set but neither {PROCESS_ID} nor {COMPLETION_INDEX} gives this process's id")
        count = _int(env, PROCESS_COUNT)
        if not 0 <= pid < count:
            raise UserError(f"process id {pid} is outside 0..{count - 1} ({PROCESS_COUNT}={count}); fix the pod template")
        return ClusterEnv("explicit", env[COORDINATOR], count, pid)
    hosts = [h for h in env.get(TPU_WORKER_HOSTNAMES, "").split(",") if h]
    slices = _int(env, MEGASCALE_NUM_SLICES) if env.get(MEGASCALE_NUM_SLICES) else 1
    if len(hosts) > 1 or slices > 1:
        return ClusterEnv("tpu", process_count=len(hosts) * slices, process_id=_int(env, TPU_WORKER_ID) if TPU_WORKER_ID in env else 0)
    return ClusterEnv("single")


def initialize(env: Mapping[str, str] | None = None) -> ClusterEnv:
    """Join the multi-host run described by the environment (idempotent; nothing for one process)."""
    c = cluster_env(os.environ if env is None else env)
    if c.kind == "single" or jax.distributed.is_initialized():
        return c
    log.info("joining a %d-process run as process %d (%s)", c.process_count, c.process_id, c.kind)
    if c.kind == "explicit":
        jax.distributed.initialize(coordinator_address=c.coordinator, num_processes=c.process_count, process_id=c.process_id)
    else:
        jax.distributed.initialize()
    return c


def mesh_shape(spec: MeshSpec, n_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tp): tp as given, fsdp as given or all devices left, data = the rest. Pure."""
    if n_devices % spec.tp:
        raise UserError(f"training.mesh.tp={spec.tp} does not divide the {n_devices} devices; use a divisor of {n_devices}")
    fsdp = spec.fsdp if spec.fsdp is not None else n_devices // spec.tp
    if n_devices % (fsdp * spec.tp):
        raise UserError(
            f"training.mesh.fsdp * tp = {fsdp * spec.tp} does not divide the {n_devices} devices; "
            f"choose fsdp and tp whose product divides {n_devices}"
        )
    return n_devices // (fsdp * spec.tp), fsdp, spec.tp


def make_mesh(spec: MeshSpec) -> jax.sharding.Mesh:
    """The (data, fsdp, tp) mesh over every device of every process, with Auto axes (see reference notes)."""
    shape = mesh_shape(spec, jax.device_count())
    return jax.make_mesh(shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


#: Bytes of one round of `allgather_bytes`, every process's piece together: each device receives
#: the whole round, and by the time data is loaded the model fills most of its memory.
ROUND_BYTES = 256 << 20


def allgather_bytes(blob: bytes, *, round_bytes: int = ROUND_BYTES) -> list[bytes]:
    """Every process's `blob`, in process order (`[blob]` when the run is one process).

    Why through JAX's collectives: they already connect the hosts (ICI/DCN on TPU, gloo on
    CPU), so pooling data needs no shared filesystem or other service. The blobs may differ
    in size: the sizes go first, then rounds of equal-shaped pieces, padded, of at most
    `round_bytes / process count` bytes each.
    """
    count = jax.process_count()
    if count == 1:
        return [blob]
    sizes = [int(n) for n in multihost_utils.process_allgather(np.asarray(len(blob), np.int64))]
    piece, longest = max(1, round_bytes // count), max(sizes)
    mine = np.frombuffer(blob, np.uint8)
    rounds = []
    for start in range(0, longest, piece):
        out = np.zeros(min(piece, longest - start), np.uint8)
        chunk = mine[start : start + len(out)]
        out[: len(chunk)] = chunk
        rounds.append(multihost_utils.process_allgather(out))  # [count, len(out)]
    gathered = np.concatenate(rounds, axis=1) if rounds else np.zeros((count, 0), np.uint8)
    return [gathered[k, :n].tobytes() for k, n in enumerate(sizes)]
