"""The operator's own configuration: one YAML file (`lora-operator run --settings FILE`).

The Helm chart renders this file from its values, so the field names below are the contract
with the chart (camelCase on the wire). Everything a platform admin controls lives here; a
CR can never widen it: images outside `allowedImages`, service accounts, priority classes and
token Secrets outside their allowlists, and local paths outside `allowedLocalPaths` are refused
(`lora_operator.policy`), and `hostNetwork` is only rendered when `allowHostNetwork` is true.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from lora_operator.api import DNS_LABEL, DNS_SUBDOMAIN, Image, ObjectName, Resources, TpuType
from lora_operator.images import BadImage, ImageRule, image_allowed
from lora_operator.overlay import PodTemplateOverlay
from lora_operator.scheduling import TopologyAwareScheduling
from lora_trainer.config import ApiModel, OutputUri, validation_problems

DEFAULT_TRAINER_IMAGE = "ghcr.io/lora-operator/lora-trainer:0.1.0"
DEFAULT_IMAGE_REPOSITORY = "ghcr.io/lora-operator/lora-trainer"


class LeaderElection(ApiModel):
    """Several operator replicas, one reconciling: who leads is recorded in a Lease."""

    enabled: bool = False
    """Elect a leader (the chart turns it on with `replicaCount` above 1); off, the operator reconciles alone."""
    lease_name: Annotated[str, Field(pattern=DNS_SUBDOMAIN, max_length=253)] = "lora-operator"
    """Name of the Lease."""
    lease_namespace: Annotated[str, Field(pattern=DNS_LABEL, max_length=63)] = "default"
    """Namespace of the Lease (the chart sets the release namespace)."""
    lease_duration_seconds: Annotated[float, Field(gt=0, le=300)] = 15
    """How long a candidate waits after the Lease last changed before it takes over."""
    renew_deadline_seconds: Annotated[float, Field(gt=0, le=300)] = 10
    """How long the leader keeps reconciling without a successful renewal."""
    retry_period_seconds: Annotated[float, Field(gt=0, le=60)] = 2
    """How often the leader renews and a candidate retries."""

    @model_validator(mode="after")
    def _ordered(self) -> LeaderElection:
        if not self.retry_period_seconds < self.renew_deadline_seconds < self.lease_duration_seconds:
            raise ValueError(
                "leaderElection needs retryPeriodSeconds < renewDeadlineSeconds < leaseDurationSeconds, so a leader "
                "stops before another can take over"
            )
        return self


class OperatorSettings(ApiModel):
    """What the platform admin sets for every CR the operator runs."""

    trainer_image: Image = DEFAULT_TRAINER_IMAGE
    """Image used when a CR leaves `spec.image` empty; must itself match `allowedImages`."""
    allowed_images: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=lambda: [DEFAULT_IMAGE_REPOSITORY])
    """Images a CR may name in `spec.image`, matched by registry and repository as a registry parses
    them (never as a string prefix): `REGISTRY/REPOSITORY` (any tag or digest of that repository),
    `REGISTRY/PATH/` (every repository under PATH; `REGISTRY/` for a whole registry) or
    `REGISTRY/REPOSITORY@sha256:DIGEST` (that one image). Anything else is refused with a Failed condition."""
    require_image_digest: bool = False
    """Refuse images not pinned by digest (`...@sha256:...`), the default `trainerImage` included."""
    allowed_service_accounts: list[ObjectName] = Field(default_factory=lambda: ["lora-trainer"])
    """Service accounts a CR may name in `spec.serviceAccountName` (their Workload Identity reaches the
    buckets); a CR that names none runs as its namespace's `default` account."""
    allowed_priority_classes: list[ObjectName] = Field(default_factory=list)
    """PriorityClasses a CR may name in `spec.priorityClassName`; empty: none (the cluster default applies)."""
    allowed_token_secrets: list[ObjectName] = Field(default_factory=lambda: ["hf-token"])
    """Secrets (in the CR's own namespace) a CR may name in `spec.hfTokenSecretRef`; any other Secret
    of the namespace stays out of the trainer pods."""
    shared_compilation_caches: list[OutputUri] = Field(default_factory=list, max_length=64)
    """Locations a CR may name in `spec.training.compilationCache.uri` besides its own `spec.output.uri`:
    caches that runs of the same model and shapes share, so even their first start skips compiling.
    A compilation cache is trusted code (whoever writes to it chooses what the trainer runs), so list
    only locations that the runs allowed to use them alone can write."""
    allowed_local_paths: list[Annotated[str, Field(pattern=r"^/", min_length=1)]] = Field(default_factory=list)
    """Directories of the trainer pods (e.g. a volume the platform mounts) under which a CR's URIs may
    be local paths; empty: every URI must be `gs://` (or `hf://` for models). Relative paths and `..`
    are always refused in the cluster."""
    default_tpu_type: TpuType = "v5p"
    """TPU type assumed when a CR omits `spec.tpu.type`."""
    default_queue_name: Annotated[str, Field(pattern=DNS_SUBDOMAIN, max_length=63)] | None = None  # a label value
    """Kueue LocalQueue used when a CR omits `spec.queueName`; no Kueue label when both are empty."""
    allow_host_network: bool = True
    """Render `hostNetwork: true` on trainer pods: the documented exception to the restricted Pod
    Security Standard that multi-host TPU slices need for fast DCN/ICI networking."""
    watch_namespaces: list[Annotated[str, Field(pattern=DNS_LABEL, max_length=63)]] = Field(default_factory=list)
    """Namespaces to watch; empty means the whole cluster."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Operator log level."""
    progress_poll_seconds: Annotated[float, Field(gt=0, le=3600)] = 20
    """How often the operator reads `<output.uri>/progress.json` of each Running CR."""
    job_ttl_seconds_after_finished: Annotated[int, Field(ge=0)] = 86400
    """`ttlSecondsAfterFinished` of the JobSets and Jobs the operator creates."""
    export_resources: Resources = Field(
        default_factory=lambda: Resources.model_validate(
            {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"cpu": "4", "memory": "32Gi"}}
        )
    )
    """Requests/limits of the export and conversion Jobs (CPU pods: they read a checkpoint and write safetensors)."""
    topology_aware_scheduling: TopologyAwareScheduling | None = None
    """Kueue topology-aware scheduling of every run's pods (`mode` required or preferred, `level` a node label); none when empty."""
    pod_template_overlay: PodTemplateOverlay = Field(default_factory=PodTemplateOverlay)
    """Node selectors, tolerations, volumes, volume mounts, annotations and labels added to every trainer pod (never to a CR's say)."""
    leader_election: LeaderElection = Field(default_factory=LeaderElection)
    """Lease-based leader election, for several operator replicas of which exactly one reconciles."""

    @field_validator("allowed_images")
    @classmethod
    def _rules(cls, entries: list[str]) -> list[str]:
        for entry in entries:
            try:
                ImageRule.parse(entry)
            except BadImage as e:
                raise ValueError(str(e)) from e
        return entries

    def image_rules(self) -> list[ImageRule]:
        """`allowedImages` parsed (each entry was checked when the settings were read)."""
        return [ImageRule.parse(entry) for entry in self.allowed_images]

    def image_refusal(self, image: str) -> str | None:
        """None when a pod may run `image`; otherwise why not (malformed, not pinned, not listed)."""
        return image_allowed(image, self.image_rules(), require_digest=self.require_image_digest)

    def image_allowed(self, image: str) -> bool:
        """True when `image` matches `allowedImages` (and carries a digest if that is required)."""
        return self.image_refusal(image) is None


class SettingsError(ValueError):
    """The settings file is missing or invalid; the message names the file and the field."""


def load_settings(path: str | Path | None) -> OperatorSettings:
    """Parse the settings YAML; None means the defaults. Errors name the file and the field."""
    if path is None:
        return OperatorSettings()
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except OSError as e:
        raise SettingsError(f"{p}: cannot read operator settings ({e.strerror}); pass an existing file to --settings") from e
    except yaml.YAMLError as e:
        raise SettingsError(f"{p}: not valid YAML ({e})") from e
    if not isinstance(data, dict):
        raise SettingsError(f"{p}: expected a mapping of settings, got {type(data).__name__}")
    try:
        settings = OperatorSettings.model_validate(data)
    except ValidationError as e:
        problems = validation_problems(e)
        raise SettingsError(f"{p}: invalid operator settings: {problems}") from e
    if (refusal := settings.image_refusal(settings.trainer_image)) is not None:
        raise SettingsError(
            f"{p}: trainerImage: {refusal} {settings.allowed_images}; add its repository to allowedImages"
        )
    return settings
