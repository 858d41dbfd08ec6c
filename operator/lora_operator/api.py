"""The Kubernetes API of lora-operator: `LoraFinetune` and `AdapterConversion` (lora-operator.dev/v1alpha1).

A LoraFinetune spec *is* the trainer's `TrainConfig` plus the fields that say where and how it
runs on a cluster (TPU slice, image, queue, service account, restarts). The CRD YAML in `crds/`
is generated from these models (`lora-operator crds`), so the schema, the operator and the
trainer cannot drift apart.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, Literal, Self

from pydantic import Field

from lora_trainer.config import (
    ApiModel,
    DatasetSpec,
    Family,
    InputUri,
    LoraSpec,
    ModelSpec,
    OutputSpec,
    TrainConfig,
    TrainingSpec,
)
from lora_trainer.rules import Rule
from lora_operator.images import IMAGE_PATTERN, MAX_IMAGE
from lora_operator.tpu import CATALOG, TpuGeneration

GROUP = "lora-operator.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
#: The JobSet API the operator renders and watches (the one place it is written).
JOBSET_GROUP, JOBSET_VERSION = "jobset.x-k8s.io", "v1alpha2"
JOBSET_API = f"{JOBSET_GROUP}/{JOBSET_VERSION}"

#: TPU generations a CR may name: the keys of `tpu.CATALOG` (one list; the CRD enum derives from it).
TpuType = Literal[tuple(CATALOG)]  # type: ignore[valid-type]


# A resource's phase: the one spelling of each (members compare equal to their strings). No
# docstring: the field's own description goes into the CRD.
class Phase(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUSPENDED = "Suspended"
    EXPORTING = "Exporting"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


#: Resource names a CR may request or limit; TPU chips come from `tpu`, never from `resources`.
ALLOWED_RESOURCES = ("cpu", "memory", "ephemeral-storage")
#: Env var name prefixes a CR may not set, compared case-insensitively (Python's urllib and
#: requests read `https_proxy` as well as `HTTPS_PROXY`). Each either belongs to the operator
#: (distributed start-up, topology, the trainer's own knobs), or decides where credentials and
#: data go (hub endpoint and token, Google credentials and metadata server, storage endpoints,
#: proxies, trusted CAs), or what code runs (Python and the dynamic loader). See
#: docs/operator-guarantees.md for why each is here.
RESERVED_ENV_PREFIXES = (
    "JAX_", "MEGASCALE_", "TPU_", "LIBTPU_", "XLA_", "LORA_", "KUBERNETES_",
    "HF_", "HUGGINGFACE_", "HUGGING_FACE_", "GOOGLE_", "GCE_", "GCLOUD_", "CLOUDSDK_", "GRPC_",
    "TENSORSTORE_", "FSSPEC_", "GCSFS_", "SSL_", "REQUESTS_", "CURL_", "PYTHON", "LD_",
)
#: Whole names a CR may not set (case-insensitive): the pod's completion index (process ids), the
#: storage emulator endpoint, the proxies, the metadata-server check, and the shell's search and
#: start-up variables.
RESERVED_ENV_NAMES = (
    "JOB_COMPLETION_INDEX", "STORAGE_EMULATOR_HOST", "NO_GCE_CHECK", "METADATA_SERVER_DETECTION",
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY", "FTP_PROXY",
    "PATH", "HOME", "BASH_ENV", "ENV", "SHELL",
)
#: One case-insensitive RE2 pattern of every reserved name: pydantic and the CRD's CEL rule use it alike.
RESERVED_ENV_PATTERN = (
    f"(?i)^(({'|'.join(RESERVED_ENV_PREFIXES)}).*|({'|'.join(RESERVED_ENV_NAMES)}))$"
)
#: Why a reserved env name is refused, and the fix (pydantic and the CRD's CEL rule say the same).
RESERVED_ENV_MESSAGE = (
    "names that steer the distributed start-up, credentials, endpoints, proxies or code loading belong to the "
    "operator and the platform admin (the hub token comes from hfTokenSecretRef; see docs/operator-guarantees.md "
    "for the list); rename the variable or drop it"
)
_ENV_NAME_DOC = (
    f"Variable name. Reserved, in any letter case: {', '.join(RESERVED_ENV_NAMES)}, and names starting with "
    f"{', '.join(RESERVED_ENV_PREFIXES)}."
)

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
#: A Compute Engine resource name (a reservation's), as `gcloud compute reservations create` takes it.
GCE_NAME = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
QUANTITY = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
#: Longest resource quantity (`8000m`, `64Gi`): far longer than any real one.
MAX_QUANTITY = 64
#: Most extra environment variables per CR.
MAX_ENV = 64

Image = Annotated[str, Field(pattern=IMAGE_PATTERN, min_length=1, max_length=MAX_IMAGE)]
Quantity = Annotated[str, Field(pattern=QUANTITY, max_length=MAX_QUANTITY)]
ObjectName = Annotated[str, Field(pattern=DNS_SUBDOMAIN, max_length=253)]


CapacityType = Literal["onDemand", "spot", "reservation", "flexStart"]
#: The longest run Dynamic Workload Scheduler (flex-start) provisions nodes for: 7 days.
MAX_FLEX_START_SECONDS = 7 * 24 * 3600


class ReservationSpec(ApiModel):
    name: Annotated[str, Field(pattern=GCE_NAME, max_length=63)]
    """Name of the Compute Engine reservation (in the cluster's project) whose TPU VMs the node pool consumes, as `gcloud compute reservations list` shows it."""


class FlexStartSpec(ApiModel):
    max_run_duration_seconds: Annotated[int, Field(ge=1, le=MAX_FLEX_START_SECONDS)] = MAX_FLEX_START_SECONDS
    """How long the provisioned slice may run, in seconds (at most 604800, 7 days, the Dynamic Workload Scheduler's limit); GKE reclaims the nodes after it. Default: 7 days."""


class CapacitySpec(ApiModel):
    """Which kind of GKE TPU capacity the slice runs on (as XPK's `--on-demand`, `--spot`, `--reservation`, `--flex`)."""

    type: CapacityType = "onDemand"
    """`onDemand`, `spot` (preemptible Spot VMs), `reservation` (a specific reservation, see `reservation`) or `flexStart` (Dynamic Workload Scheduler queued provisioning through Kueue; needs a queue). Default: onDemand, no capacity selector."""
    reservation: ReservationSpec | None = None
    """The reservation to consume; required when `type` is reservation, not allowed otherwise."""
    flex_start: FlexStartSpec | None = None
    """Flex-start settings; only when `type` is flexStart (default: the longest run duration)."""

    __rules__ = (
        Rule("reservation", "(self.type == 'reservation') == has(self.reservation)",
             lambda c: (c.type == "reservation") == (c.reservation is not None),
             "reservation names the reservation to use: set it exactly when type is reservation"),
        Rule("flexStart", "!has(self.flexStart) || self.type == 'flexStart'",
             lambda c: c.flex_start is None or c.type == "flexStart",
             "flexStart only applies to type: flexStart; drop it or set the type"),
    )


def _offered_topology(tpu: TpuGeneration) -> Rule:
    """The topologies GKE offers for one TPU type (a rule per type: CEL has no map of lists to index)."""
    return Rule(
        "topology",
        f"!has(self.type) || !has(self.topology) || self.type != '{tpu.name}' || self.topology in {list(tpu.topologies)}",
        lambda s: s.type != tpu.name or s.topology is None or s.topology in tpu.topologies,
        f"topology is not offered by GKE for {tpu.name}; use one of {', '.join(tpu.topologies)}",
    )


class TpuSpec(ApiModel):
    type: TpuType | None = None
    """TPU generation: v4, v5e, v5p, v6e or tpu7x (Ironwood). Default: the operator's `defaultTpuType` (v5p unless the admin changed it)."""
    topology: Annotated[str, Field(pattern=r"^[1-9][0-9]*x[1-9][0-9]*(x[1-9][0-9]*)?$", max_length=16)] | None = None
    """Slice topology as GKE names it, e.g. `2x2x2` (v4, v5p, tpu7x) or `4x4` (v5e, v6e); must be offered by GKE for the type. Default: the type's smallest slice."""
    slices: Annotated[int, Field(ge=1, le=64)] = 1
    """Number of slices (multislice over DCN); each slice is one replica of the JobSet's replicatedJob."""
    capacity: CapacitySpec = Field(default_factory=CapacitySpec)
    """Capacity kind of the TPU nodes: on-demand, spot, a reservation or flex-start."""

    __rules__ = tuple(_offered_topology(t) for t in CATALOG.values())


class ResourceList(ApiModel):
    cpu: Quantity | None = None
    """CPU quantity, e.g. `8` or `8000m`."""
    memory: Quantity | None = None
    """Memory quantity, e.g. `64Gi`."""
    ephemeral_storage: Quantity | None = Field(default=None, alias="ephemeral-storage")
    """Local ephemeral storage, e.g. `100Gi`."""


class Resources(ApiModel):
    requests: ResourceList | None = None
    """Requests for the container (cpu, memory, ephemeral-storage; a LoraFinetune's TPU chips come from `spec.tpu`)."""
    limits: ResourceList | None = None
    """Limits for the container (cpu, memory, ephemeral-storage)."""


class EnvVar(ApiModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=128, description=_ENV_NAME_DOC)]
    value: Annotated[str, Field(max_length=4096)] = ""
    """Literal value. Secrets are passed by reference only (hfTokenSecretRef), never as env values."""

    __rules__ = (
        Rule("name", f"!self.name.matches('{RESERVED_ENV_PATTERN}')", lambda e: not re.match(RESERVED_ENV_PATTERN, e.name),
             f"name is reserved: {RESERVED_ENV_MESSAGE}"),
    )


class SecretKeyRef(ApiModel):
    name: ObjectName
    """Name of a Secret in the CR's namespace; must be one of the operator's `allowedTokenSecrets`."""
    key: Annotated[str, Field(pattern=r"^[-._a-zA-Z0-9]+$", max_length=253)] = "token"
    """Key in the Secret holding the Hugging Face token."""


class LoraFinetuneSpec(TrainConfig):
    """A LoRA fine-tune of an open LLM on a multi-host TPU slice."""

    tpu: TpuSpec = Field(default_factory=TpuSpec)
    """TPU slice shape the trainer runs on."""
    image: Image | None = None
    """Trainer image, `REGISTRY/REPOSITORY:TAG` or `...@sha256:DIGEST`; its registry and repository must be in the operator's `allowedImages`. Default: the operator's configured trainer image."""
    service_account_name: ObjectName | None = None
    """Kubernetes service account of the trainer pods (Workload Identity for the bucket); must be one of the operator's `allowedServiceAccounts`."""
    queue_name: Annotated[str, Field(pattern=DNS_SUBDOMAIN, max_length=63)] | None = None
    """Kueue LocalQueue; sets the `kueue.x-k8s.io/queue-name` label on the JobSet (so at most 63 characters, a label value's limit)."""
    priority_class_name: ObjectName | None = None
    """PriorityClass of the trainer pods; must be one of the operator's `allowedPriorityClasses`."""
    max_restarts: Annotated[int, Field(ge=0, le=1000)] = 3
    """JobSet restarts allowed after retriable faults (exit 42, crashes killed by a signal) before the run fails. Preemptions (a pod's DisruptionTarget condition, or the trainer's exit 43 after saving on SIGTERM) restart the run without counting."""
    suspend: bool = False
    """Suspend the JobSet (pods are deleted; the run resumes from its last checkpoint when unsuspended). The only field that may change after creation."""
    hf_token_secret_ref: SecretKeyRef | None = None
    """Secret holding a Hugging Face token, for `hf://` models; mounted as HF_TOKEN, never copied."""
    resources: Resources | None = None
    """Extra CPU/memory requests and limits for the trainer container."""
    env: Annotated[list[EnvVar], Field(max_length=MAX_ENV)] = Field(default_factory=list)
    """Extra environment variables for the trainer container (literal values only)."""

    def train_config(self) -> TrainConfig:
        """The trainer's half of the spec: what goes into the ConfigMap."""
        return TrainConfig.model_validate(self.model_dump(include=set(TrainConfig.model_fields)))


#: Longest condition message (metav1.Condition's limit); the operator cuts longer ones.
MAX_MESSAGE = 32768
#: Longest short status string (times, printer-column values) and URI in a status.
MAX_SHORT, MAX_STATUS_URI = 64, 2048
ShortText = Annotated[str, Field(max_length=MAX_SHORT)]
StatusUri = Annotated[str, Field(max_length=MAX_STATUS_URI)]
ChildName = Annotated[str, Field(max_length=253)]


class Condition(ApiModel):
    type: ShortText
    """Condition type: Running, Suspended, Exporting, Succeeded, Failed (one True per phase) or SecretsResolved."""
    status: Literal["True", "False", "Unknown"]
    """Status of the condition."""
    reason: Annotated[str, Field(max_length=128)]
    """CamelCase reason."""
    message: Annotated[str, Field(max_length=MAX_MESSAGE)] = ""
    """What happened and, for failures, what to change."""
    last_transition_time: ShortText
    """When the status last changed (RFC 3339)."""
    observed_generation: int | None = None
    """The .metadata.generation the condition was set for."""


Conditions = Annotated[list[Condition], Field(max_length=16)]


class ChildRecord(ApiModel):
    kind: Literal["JobSet", "Job"]
    """Kind of the child."""
    name: ChildName
    """Its name."""
    uid: Annotated[str, Field(max_length=128)]
    """The uid of the one the operator last saw: another uid under the same name means it was deleted and created again."""


class RunRecord(ApiModel):
    """What the operator has done to a resource's children, written to the status before it acts, so
    that a restarted operator (or one that lost an answer) finishes the job instead of guessing."""

    suspend_requested: bool | None = None
    """spec.suspend the operator is applying to the JobSet (written before it patches the JobSet)."""
    suspend_applied: bool | None = None
    """spec.suspend the JobSet was last created or patched with (written after)."""
    children: Annotated[list[ChildRecord], Field(max_length=8)] = Field(default_factory=list)
    """The children (JobSet, Jobs) the operator created or adopted."""


class StatusModel(ApiModel):
    """A resource's status, whole or partial: a reconcile's decisions are partial statuses (only
    the fields they set), merged and written as one merge patch (lora_operator.controller)."""

    def to_patch(self) -> dict[str, Any]:
        """The fields set on this (partial) status, by their wire names: a merge patch's body."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)

    def merged(self, later: StatusModel) -> Self:
        """This partial status with `later`'s fields over it (a field decided twice keeps the later value)."""
        return self.model_validate(self.to_patch() | later.to_patch())


class LoraFinetuneStatus(StatusModel):
    phase: Phase | None = None
    """Pending, Running, Suspended, Exporting, Succeeded or Failed."""
    conditions: Conditions = Field(default_factory=list)
    """Latest observations of the run's state."""
    observed_generation: int | None = None
    """The .metadata.generation the operator last acted on."""
    job_set_name: ChildName | None = None
    """Name of the JobSet running the trainer."""
    restarts: int | None = None
    """JobSet restarts so far that count toward spec.maxRestarts (retriable faults)."""
    preemptions: int | None = None
    """JobSet restarts so far after a preemption (not counted toward spec.maxRestarts)."""
    step: int | None = None
    """Last optimizer step reported by the trainer."""
    total_steps: int | None = None
    """training.steps."""
    progress: ShortText | None = None
    """`step/totalSteps`, for the printer column."""
    loss: ShortText | None = None
    """Last training loss (a string so that kubectl prints it verbatim)."""
    tokens_per_second: ShortText | None = None
    """Training throughput over the last log interval."""
    mfu: ShortText | None = None
    """Model FLOPs utilisation over the last log interval (0-1), when the trainer knows the chip's peak."""
    eta: ShortText | None = None
    """Estimated time to finish training, e.g. `1h02m`."""
    last_checkpoint: StatusUri | None = None
    """URI of the last committed checkpoint."""
    adapter_uri: StatusUri | None = None
    """URI of the exported HF PEFT adapter."""
    merged_uri: StatusUri | None = None
    """URI of the merged model, when requested."""
    tpu: ShortText | None = None
    """TPU shape, e.g. `v5p 2x2x2 x2`, for the printer column."""
    start_time: ShortText | None = None
    """When the JobSet started."""
    completion_time: ShortText | None = None
    """When the run reached Succeeded or Failed."""
    record: RunRecord | None = None
    """The operator's durable record (see RunRecord); for the operator, not for people."""


class AdapterEndpoint(ApiModel):
    uri: InputUri
    """Adapter location: local path or `gs://`."""
    format: Literal["hf-peft", "orbax"]
    """`hf-peft` (adapter_config.json + adapter_model.safetensors) or `orbax` (a LoRA checkpoint the trainer's restoreFrom accepts)."""


class ConversionModel(ApiModel):
    source: InputUri
    """Base model the adapter belongs to (HF safetensors checkpoint); needed for the mapping and for merged output."""
    family: Family | None = None
    """Model family; detected from the checkpoint's config.json when omitted."""


def as_directory(uri: str) -> str:
    """`uri` with one trailing `/`, so that `a/b` and `a/b/` compare equal and `a/bc` is not under `a/b`."""
    return uri if uri.endswith("/") else uri + "/"


def _cel_as_directory(uri: str) -> str:
    """`as_directory` in CEL, for the CRD's copy of a rule."""
    return f"({uri}.endsWith('/') ? {uri} : {uri} + '/')"


def _apart(source: str, target: str) -> bool:
    """Neither directory is the other or inside it."""
    source, target = as_directory(source), as_directory(target)
    return not target.startswith(source) and not source.startswith(target)


class AdapterConversionSpec(ApiModel):
    """Convert a LoRA adapter between HF PEFT and Orbax, optionally merging it into the base model."""

    source: AdapterEndpoint
    """The adapter to convert."""
    target: AdapterEndpoint
    """Where to write it and in which format: the other format than the source's, in a directory neither inside the source nor holding it."""
    model: ConversionModel
    """The base model."""
    merged: bool = False
    """Write the base model with the adapter merged (target format must be hf-peft)."""
    image: Image | None = None
    """Trainer image running the conversion; its registry and repository must be in the operator's `allowedImages`."""
    service_account_name: ObjectName | None = None
    """Service account of the conversion pod (bucket access); must be one of the operator's `allowedServiceAccounts`."""
    resources: Resources | None = None
    """CPU/memory requests and limits of the conversion pod."""

    __rules__ = (
        Rule("target.uri", "!self.target.uri.startsWith('hf://')", lambda s: not s.target.uri.startswith("hf://"),
             "target.uri: hf:// is read-only; write to gs://BUCKET/... or a path"),
        Rule("merged", "!has(self.merged) || !self.merged || self.target.format == 'hf-peft'",
             lambda s: not s.merged or s.target.format == "hf-peft",
             "merged writes an HF model: set target.format to hf-peft or drop merged"),
        Rule("target.format", "self.source.format != self.target.format", lambda s: s.source.format != s.target.format,
             "target.format is source.format: nothing to convert; set target.format to the other format"),
        Rule("target.uri",
             f"!{_cel_as_directory('self.target.uri')}.startsWith({_cel_as_directory('self.source.uri')}) && "
             f"!{_cel_as_directory('self.source.uri')}.startsWith({_cel_as_directory('self.target.uri')})",
             lambda s: _apart(s.source.uri, s.target.uri),
             "target.uri overlaps source.uri (the same directory, or one inside the other): the conversion replaces its "
             "target directory whole; write to a directory outside the source"),
    )


class AdapterConversionStatus(StatusModel):
    phase: Literal[Phase.PENDING, Phase.RUNNING, Phase.SUCCEEDED, Phase.FAILED] | None = None
    """Pending, Running, Succeeded or Failed."""
    conditions: Conditions = Field(default_factory=list)
    """Latest observations."""
    observed_generation: int | None = None
    """The .metadata.generation the operator last acted on."""
    job_name: ChildName | None = None
    """Name of the conversion Job."""
    output_uri: StatusUri | None = None
    """Where the converted adapter (or merged model) was written."""
    start_time: ShortText | None = None
    """When the Job started."""
    completion_time: ShortText | None = None
    """When the conversion finished."""
    record: RunRecord | None = None
    """The operator's durable record (its conversion Job); for the operator, not for people."""


__all__ = [
    "API_VERSION",
    "GROUP",
    "VERSION",
    "AdapterConversionSpec",
    "AdapterConversionStatus",
    "AdapterEndpoint",
    "CapacitySpec",
    "Condition",
    "DatasetSpec",
    "LoraFinetuneSpec",
    "LoraFinetuneStatus",
    "LoraSpec",
    "ModelSpec",
    "OutputSpec",
    "StatusModel",
    "TpuSpec",
    "TrainingSpec",
]
