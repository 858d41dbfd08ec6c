"""TPU catalog: what GKE offers per TPU type and what that means for a JobSet.

Facts from GKE's TPU docs and XPK: the node label values, 4 chips per host (1 for
single-chip topologies), hosts per slice = chips in the topology / chips per host. The
CRD's CEL rules and the renderer both read this table, so they cannot disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
TPU_RESOURCE = "google.com/tpu"


@dataclass(frozen=True, slots=True)
class TpuGeneration:
    """One TPU generation as GKE exposes it."""

    name: str
    accelerator: str
    topologies: tuple[str, ...]


CATALOG: dict[str, TpuGeneration] = {
    t.name: t
    for t in (
        TpuGeneration(
            "v4",
            "tpu-v4-podslice",
            ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x12", "8x8x16", "8x16x16", "16x16x16"),
        ),
        TpuGeneration("v5e", "tpu-v5-lite-podslice", ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")),
        TpuGeneration(
            "v5p",
            "tpu-v5p-slice",
            ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16", "8x16x16", "16x16x16", "16x16x24"),
        ),
        TpuGeneration("v6e", "tpu-v6e-slice", ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")),
        TpuGeneration(
            "tpu7x",
            "tpu7x",
            ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16", "8x16x16"),
        ),
    )
}


class TopologyError(ValueError):
    """A TPU type or topology GKE does not offer; the message lists the valid ones."""


@dataclass(frozen=True, slots=True)
class SliceShape:
    """What one slice of `type`/`topology` needs: node labels, chips per host, hosts."""

    type: str
    topology: str
    accelerator: str
    chips: int
    chips_per_host: int
    hosts: int

    @property
    def node_selector(self) -> dict[str, str]:
        """Node selector that lands a pod on a node pool of this slice shape."""
        return {ACCELERATOR_LABEL: self.accelerator, TOPOLOGY_LABEL: self.topology}


def slice_shape(tpu_type: str, topology: str) -> SliceShape:
    """Resolve a type/topology pair; raises TopologyError naming the valid choices."""
    t = CATALOG.get(tpu_type)
    if t is None:
        raise TopologyError(f"spec.tpu.type {tpu_type!r} is not a TPU type; use one of {', '.join(CATALOG)}")
    if topology not in t.topologies:
        raise TopologyError(
            f"spec.tpu.topology {topology!r} is not offered by GKE for {tpu_type}; use one of {', '.join(t.topologies)}"
        )
    chips = math.prod(int(d) for d in topology.split("x"))
    per_host = 1 if chips == 1 else 4
    return SliceShape(tpu_type, topology, t.accelerator, chips, per_host, chips // per_host)
