"""Where the trainer pods may run: GKE capacity kinds and Kueue topology-aware scheduling. Pure.

The shapes are the ones XPK renders for the same choices (google/xpk, now
AI-Hypercomputer/xpk: `src/xpk/core/capacity.py`, get_capacity_node_selectors_from_capacity_type,
and the queued-provisioning setup in `src/xpk/templates/kueue_config.yaml.j2`):

- on-demand: no selector.
- spot: node selector `cloud.google.com/gke-spot: "true"`; GKE taints Spot nodes with the same
  key, so the pods tolerate it.
- reservation: node selector `cloud.google.com/reservation-name: <name>` (the node pool was
  created with `--reservation-affinity=specific --reservation=<name>`).
- flex-start: node selector `cloud.google.com/gke-queued: "true"` and a toleration of the
  `cloud.google.com/gke-queued` taint of queued-provisioning nodes. Kueue's ProvisioningRequest
  admission check (provisioning class `queued-provisioning.gke.io`) asks the Dynamic Workload
  Scheduler for the whole slice; it copies `provreq.kueue.x-k8s.io/*` annotations of the
  workload, so the JobSet carries `provreq.kueue.x-k8s.io/maxRunDurationSeconds`. Without a
  Kueue queue nothing would ask for the nodes, so flex-start needs one.

Kueue topology-aware scheduling (when the platform admin enables it in the operator settings)
is one annotation on the pod template, `kueue.x-k8s.io/podset-required-topology` or
`kueue.x-k8s.io/podset-preferred-topology`, whose value is the node label of the topology level.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field

from lora_operator.api import CapacitySpec, FlexStartSpec
from lora_trainer.config import ApiModel

SPOT_LABEL = "cloud.google.com/gke-spot"
RESERVATION_LABEL = "cloud.google.com/reservation-name"
QUEUED_LABEL = "cloud.google.com/gke-queued"
MAX_RUN_DURATION_ANNOTATION = "provreq.kueue.x-k8s.io/maxRunDurationSeconds"
TOPOLOGY_ANNOTATIONS = {
    "required": "kueue.x-k8s.io/podset-required-topology",
    "preferred": "kueue.x-k8s.io/podset-preferred-topology",
}
#: Node labels a capacity kind may select on: the admin's pod overlay may not set them.
CAPACITY_LABELS = (SPOT_LABEL, RESERVATION_LABEL, QUEUED_LABEL)
#: A qualified label key (optional DNS-subdomain prefix), as a Kueue Topology level names its node label.
LABEL_KEY = r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"


class TopologyAwareScheduling(ApiModel):
    """Kueue topology-aware scheduling of every run's pods (needs a Kueue Topology and a ResourceFlavor naming it)."""

    mode: Literal["required", "preferred"] = "preferred"
    """`required`: all of a run's pods in one domain of `level` or not admitted; `preferred`: Kueue tries `level`, then the levels above it."""
    level: Annotated[str, Field(pattern=LABEL_KEY, max_length=316)]
    """Node label of the topology level, e.g. `cloud.google.com/gce-topology-block` (one of your Kueue Topology's levels)."""


@dataclass(frozen=True, slots=True)
class Placement:
    """What a capacity kind adds to the JobSet and its pods."""

    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    jobset_annotations: dict[str, str] = field(default_factory=dict)
    needs_queue: bool = False
    """True when only a Kueue queue can get the nodes (flex-start)."""


def _tolerate(key: str) -> dict[str, Any]:
    return {"key": key, "operator": "Equal", "value": "true", "effect": "NoSchedule"}


def capacity_placement(capacity: CapacitySpec) -> Placement:
    """Node selectors, tolerations and JobSet annotations of one capacity kind."""
    if capacity.type == "spot":
        return Placement({SPOT_LABEL: "true"}, [_tolerate(SPOT_LABEL)])
    if capacity.type == "reservation":
        assert capacity.reservation is not None  # the API model requires it for this type
        return Placement({RESERVATION_LABEL: capacity.reservation.name})
    if capacity.type == "flexStart":
        seconds = (capacity.flex_start or FlexStartSpec()).max_run_duration_seconds
        return Placement({QUEUED_LABEL: "true"}, [_tolerate(QUEUED_LABEL)], {MAX_RUN_DURATION_ANNOTATION: str(seconds)}, needs_queue=True)
    return Placement()


def topology_annotations(tas: TopologyAwareScheduling | None) -> dict[str, str]:
    """The Kueue TAS annotation of the trainer pods' PodSet, or none when TAS is off."""
    return {TOPOLOGY_ANNOTATIONS[tas.mode]: tas.level} if tas is not None else {}
