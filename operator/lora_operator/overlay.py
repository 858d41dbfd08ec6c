"""The platform admin's pod-template overlay: what every trainer pod gets on top of what the
operator renders (a GCS FUSE cache, a local SSD, a node pool selector, cost-centre labels).

It lives in the operator settings, never in a CR, so a CR author cannot use it. It can only add
node selectors, tolerations, volumes, volume mounts, annotations and labels, and nothing in it
may weaken the pod's security context: fields such as `privileged`, `hostPath` volumes,
`capabilities`, `hostPID`/`hostIPC`/`hostNetwork` or `runAsUser` are refused when the settings
load, each named with its path, and so are keys the operator itself renders (TPU and capacity
node labels, its own volumes, labels and annotations), which the overlay could otherwise
silently override.
"""

from __future__ import annotations

import copy
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from lora_operator.api import DNS_LABEL
from lora_operator.scheduling import CAPACITY_LABELS
from lora_operator.tpu import ACCELERATOR_LABEL, TOPOLOGY_LABEL
from lora_trainer.config import ApiModel

#: Fields that would weaken the trainer pod's isolation, wherever they appear in the overlay.
DENIED_FIELDS = {
    "privileged": "a privileged container",
    "allowPrivilegeEscalation": "privilege escalation",
    "capabilities": "Linux capabilities",
    "securityContext": "the security context (the operator's restricted one stays)",
    "runAsUser": "the user the trainer runs as (it must never be root)",
    "runAsGroup": "the trainer's group",
    "runAsNonRoot": "the non-root requirement",
    "procMount": "an unmasked /proc",
    "seLinuxOptions": "the SELinux context",
    "seccompProfile": "the seccomp profile",
    "appArmorProfile": "the AppArmor profile",
    "hostPID": "the node's process namespace",
    "hostIPC": "the node's IPC namespace",
    "hostNetwork": "host networking (the allowHostNetwork setting decides it)",
    "hostUsers": "the node's user namespace",
    "hostPath": "a directory of the node's filesystem",
    "serviceAccountName": "the pod's identity (spec.serviceAccountName decides it)",
    "automountServiceAccountToken": "an API token in the trainer pod",
}
#: Annotation key prefixes that set a pod's or container's confinement.
DENIED_ANNOTATION_PREFIXES = ("container.apparmor.security.beta.kubernetes.io/", "seccomp.security.alpha.kubernetes.io/")
#: Label and annotation key prefixes the operator, JobSet, the Job controller and Kueue own.
RESERVED_KEY_PREFIXES = ("lora-operator.dev/", "jobset.sigs.k8s.io/", "batch.kubernetes.io/", "kueue.x-k8s.io/",
                         "app.kubernetes.io/managed-by")
#: Node labels the operator selects on from spec.tpu.
RESERVED_NODE_LABELS = (ACCELERATOR_LABEL, TOPOLOGY_LABEL, *CAPACITY_LABELS)
#: The trainer pod's own volumes and where they are mounted.
RESERVED_VOLUMES = {"config": "/etc/lora-operator", "dshm": "/dev/shm"}


class Toleration(ApiModel):
    key: Annotated[str, Field(min_length=1, max_length=316)] | None = None
    """Taint key; empty with operator Exists tolerates every taint."""
    operator: Literal["Exists", "Equal"] = "Equal"
    """Exists or Equal."""
    value: Annotated[str, Field(max_length=63)] | None = None
    """Taint value (with Equal)."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect; empty matches every effect."""
    toleration_seconds: Annotated[int, Field(ge=0)] | None = None
    """How long a NoExecute taint is tolerated."""


class VolumeMount(ApiModel):
    name: Annotated[str, Field(pattern=DNS_LABEL, max_length=63)]
    """Name of a volume of the overlay."""
    mount_path: Annotated[str, Field(pattern=r"^/", max_length=1024)]
    """Absolute path in the trainer container."""
    read_only: bool | None = None
    """Mount read-only."""
    sub_path: Annotated[str, Field(max_length=1024)] | None = None
    """Path within the volume."""
    mount_propagation: Literal["None", "HostToContainer"] | None = None
    """None or HostToContainer (Bidirectional needs a privileged container)."""


class PodTemplateOverlay(ApiModel):
    """Added to every trainer pod: node selectors, tolerations, volumes (+ mounts in the trainer container), annotations, labels."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    """Extra node selector terms, e.g. a node pool."""
    tolerations: list[Toleration] = Field(default_factory=list)
    """Extra tolerations (the TPU and capacity ones are rendered)."""
    volumes: list[dict[str, Any]] = Field(default_factory=list)
    """Extra pod volumes (Kubernetes Volume objects: a name and one source, e.g. `csi` for GCS FUSE or `ephemeral`); no hostPath."""
    volume_mounts: list[VolumeMount] = Field(default_factory=list)
    """Mounts of those volumes in the trainer container."""
    annotations: dict[str, str] = Field(default_factory=dict)
    """Extra pod annotations (e.g. `gke-gcsfuse/volumes: "true"`)."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Extra pod labels."""

    @model_validator(mode="before")
    @classmethod
    def _nothing_weakens_the_pod(cls, data: Any) -> Any:
        if isinstance(data, dict) and (problems := overlay_problems(data)):
            raise ValueError("; ".join(problems))
        return data

    @model_validator(mode="after")
    def _mounts_name_overlay_volumes(self) -> PodTemplateOverlay:
        names = {v["name"] for v in self.volumes}
        if missing := [m.name for m in self.volume_mounts if m.name not in names]:
            raise ValueError(f"volumeMounts name volumes {missing} that the overlay does not define; add them to volumes")
        return self


#: String maps whose keys are label keys, not fields.
_KEY_MAPS = ("labels", "annotations", "nodeSelector", "volumeAttributes")


def _denied(node: Any, path: str) -> list[str]:
    """Every denied field under `node` (a parsed YAML value), with its path."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _KEY_MAPS:
                continue
            if key in DENIED_FIELDS:
                found.append(f"{path}.{key} is not allowed: it would change {DENIED_FIELDS[key]}")
            found += _denied(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, item in enumerate(node):
            found += _denied(item, f"{path}[{i}]")
    return found


def _reserved_keys(data: dict[str, Any], path: str) -> list[str]:
    found = []
    for part in ("labels", "annotations"):
        for key in data.get(part) or {}:
            if isinstance(key, str) and key.startswith(RESERVED_KEY_PREFIXES):
                found.append(f"{path}.{part}.{key} is reserved for the operator, JobSet and Kueue")
            elif part == "annotations" and isinstance(key, str) and key.startswith(DENIED_ANNOTATION_PREFIXES):
                found.append(f"{path}.annotations.{key} is not allowed: it would change the pod's confinement")
    for key in data.get("nodeSelector") or {}:
        if key in RESERVED_NODE_LABELS:
            found.append(f"{path}.nodeSelector.{key} is set by the operator from spec.tpu (type, topology, capacity)")
    for i, volume in enumerate(data.get("volumes") or []):
        if not isinstance(volume, dict):
            found.append(f"{path}.volumes[{i}] must be a Volume object (a name and one source)")
            continue
        sources = [k for k in volume if k != "name"]
        if not isinstance(volume.get("name"), str) or len(sources) != 1:
            found.append(f"{path}.volumes[{i}] must have a name and exactly one source (e.g. csi, ephemeral, persistentVolumeClaim)")
        if volume.get("name") in RESERVED_VOLUMES:
            found.append(f"{path}.volumes[{i}].name {volume['name']!r} is the trainer pod's own volume; pick another name")
    for i, mount in enumerate(data.get("volumeMounts") or []):
        if isinstance(mount, dict) and mount.get("mountPath") in RESERVED_VOLUMES.values():
            found.append(f"{path}.volumeMounts[{i}].mountPath {mount['mountPath']!r} is where the operator mounts its own volume")
    return found


def overlay_problems(data: dict[str, Any], path: str = "podTemplateOverlay") -> list[str]:
    """Every field of a raw overlay that is denied or collides with what the operator renders."""
    return _denied(data, path) + _reserved_keys(data, path)


def overlay_pod_template(template: dict[str, Any], container: str, overlay: PodTemplateOverlay) -> dict[str, Any]:
    """`template` (a pod template the operator rendered) with the overlay added; the input is not changed."""
    out = copy.deepcopy(template)
    meta, spec = out.setdefault("metadata", {}), out["spec"]
    for part in ("labels", "annotations"):
        if extra := getattr(overlay, part):
            meta[part] = {**extra, **meta.get(part, {})}
    if overlay.node_selector:
        spec["nodeSelector"] = {**overlay.node_selector, **spec.get("nodeSelector", {})}
    if overlay.tolerations:
        spec["tolerations"] = [*spec.get("tolerations", []), *(t.to_wire() for t in overlay.tolerations)]
    if overlay.volumes:
        spec["volumes"] = [*spec.get("volumes", []), *copy.deepcopy(overlay.volumes)]
    if overlay.volume_mounts:
        target = next(c for c in spec["containers"] if c["name"] == container)
        target["volumeMounts"] = [*target.get("volumeMounts", []), *(m.to_wire() for m in overlay.volume_mounts)]
    return out
