"""Spec -> child objects (ConfigMap, JobSet, export Jobs, conversion Job). Pure functions.

Nothing here talks to Kubernetes: handlers call these and create what they return, tests and
`lora-operator render -f CR.yaml` print them. Children get deterministic names (so a retried or
restarted operator finds what it already created), the CR's labels and a controller owner
reference (so deletion cascades without a finalizer).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from lora_operator.api import API_VERSION, JOBSET_API, AdapterConversionSpec, LoraFinetuneSpec, Resources
from lora_operator.labels import ADC_LABEL, COMPONENT_LABEL, LFT_LABEL, QUEUE_LABEL
from lora_operator.failure import TRAINER_CONTAINER, jobset_failure_policy, pod_failure_policy
from lora_operator.overlay import overlay_pod_template
from lora_operator.policy import Problems, adapter_conversion_problems, image_problems, lora_finetune_problems
from lora_operator.scheduling import Placement, capacity_placement, topology_annotations
from lora_operator.settings import OperatorSettings, SettingsError, load_settings
from lora_operator.tpu import TPU_RESOURCE, CATALOG, SliceShape, TopologyError, slice_shape
from lora_trainer.config import dump_train_config, validation_problems

Manifest = dict[str, Any]
M = TypeVar("M", bound=BaseModel)

REPLICATED_JOB = "slice"
COORDINATOR_PORT = 8476
CONFIG_DIR = "/etc/lora-operator"
CONFIG_KEY = "config.json"
MANAGED_BY = "lora-operator"
EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
#: On the JobSet and the Jobs the operator creates: their controllers (and TTL) may finish and delete
#: them, but the object stays until the operator has recorded in the CR's status what it did, as the
#: Job controller's `batch.kubernetes.io/job-tracking` does for pods. So a run whose JobSet finished
#: and was deleted while the operator was away is never taken for one whose JobSet went missing.
TRACKING_FINALIZER = "lora-operator.dev/tracking"
#: Longest CR name whose pod hostnames (`<name>-slice-<job>-<pod>`) stay within 63 characters.
MAX_NAME = 40


class InvalidSpec(ValueError):
    """The CR cannot be run as written; `field` is the offending path, the message says the fix."""

    reason = "InvalidSpec"  # the condition reason, as CannotCreate's

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True, slots=True)
class Owner:
    """The CR a child belongs to."""

    kind: str
    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Owner:
        meta = body.get("metadata", {})
        return cls(body["kind"], meta["name"], meta.get("namespace") or "default", meta.get("uid") or "")

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION,
            "kind": self.kind,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


@dataclass(frozen=True, slots=True)
class ChildNames:
    """Deterministic child names of a LoraFinetune."""

    jobset: str
    config_map: str
    export: str
    export_merged: str

    @classmethod
    def of(cls, name: str) -> ChildNames:
        return cls(name, f"{name}-config", f"{name}-export", f"{name}-export-merged")


def conversion_job_name(name: str) -> str:
    return f"{name}-convert"


def parse_spec(model: type[M], body: dict[str, Any]) -> M:
    """Validate a CR's spec with the API model; errors name every bad field."""
    try:
        return model.model_validate(body.get("spec") or {})
    except ValidationError as e:
        first = e.errors()[0]
        raise InvalidSpec(
            f"spec.{'.'.join(str(x) for x in first['loc'])}", f"invalid spec ({validation_problems(e, 'spec.')}); fix the manifest and re-apply"
        ) from e


def check_name(name: str) -> None:
    if len(name) > MAX_NAME:
        raise InvalidSpec("metadata.name", f"{name!r} is {len(name)} characters; use at most {MAX_NAME} (pod hostnames are limited to 63)")


def check_jobset_name(name: str) -> None:
    """JobSet's webhook requires DNS-1035 labels for the Job and pod names it derives from the JobSet's.

    Kubernetes accepts `llama3.1-8b` or `8b-run` as a CR name; the JobSet would be refused, so
    the run fails here, at once, naming the field.
    """
    check_name(name)
    if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name):
        fixed = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
        fixed = fixed if fixed[:1].isalpha() else f"run-{fixed}"
        raise InvalidSpec(
            "metadata.name",
            f"{name!r} cannot name a JobSet: JobSet requires DNS-1035 labels (lower-case letters, digits and '-', "
            f"starting with a letter); re-create the LoraFinetune under a name such as {fixed!r}",
        )


def refuse(problems: Problems) -> None:
    """Raise one InvalidSpec naming every problem (the first one's field is the exception's)."""
    if problems:
        (field, message), *more = problems
        raise InvalidSpec(field, message + "".join(f"; {f}: {m}" for f, m in more))


def resolve_image(image: str | None, settings: OperatorSettings) -> str:
    """The image to run; a CR image outside the allowlist is refused."""
    if image is None:
        return settings.trainer_image
    refuse(image_problems("spec.image", image, settings))
    return image


def resolve_tpu(spec: LoraFinetuneSpec, settings: OperatorSettings) -> SliceShape:
    """Type (default from settings) and topology (default: the type's smallest slice) -> slice shape."""
    tpu_type = spec.tpu.type or settings.default_tpu_type
    topology = spec.tpu.topology or CATALOG[tpu_type].topologies[0]
    try:
        return slice_shape(tpu_type, topology)
    except TopologyError as e:
        raise InvalidSpec("spec.tpu.topology", str(e)) from e


def tpu_summary(shape: SliceShape, slices: int) -> str:
    """`v5p 2x2x2 x2`: what the TPU printer column shows."""
    return f"{shape.type} {shape.topology} x{slices}"


def _labels(owner: Owner, component: str) -> dict[str, str]:
    key = LFT_LABEL if owner.kind == "LoraFinetune" else ADC_LABEL
    return {"app.kubernetes.io/managed-by": MANAGED_BY, key: owner.name, COMPONENT_LABEL: component}


def _metadata(owner: Owner, name: str, component: str, **extra_labels: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": {**_labels(owner, component), **extra_labels},
        "ownerReferences": [owner.reference()],
    }


def _resources(res: Resources | None, extra_limits: dict[str, str] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if res is not None:
        for part in ("requests", "limits"):
            values = getattr(res, part)
            if values is not None:
                out[part] = values.to_wire()
    if extra_limits:
        out.setdefault("limits", {}).update(extra_limits)
        out.setdefault("requests", {}).update(extra_limits)
    return out


def _pod_security() -> dict[str, Any]:
    """Pod-level restricted Pod Security Standard settings."""
    return {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000, "seccompProfile": {"type": "RuntimeDefault"}}


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _hf_token_env(spec: LoraFinetuneSpec) -> list[dict[str, Any]]:
    ref = spec.hf_token_secret_ref
    if ref is None:
        return []
    return [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]


def _field_ref(path: str) -> dict[str, Any]:
    return {"fieldRef": {"fieldPath": path}}


def distributed_env(jobset: str, shape: SliceShape, slices: int) -> list[dict[str, Any]]:
    """What `lora_trainer.distributed` reads to call `jax.distributed.initialize` (process id =
    LORA_JOB_INDEX * LORA_HOSTS_PER_SLICE + JOB_COMPLETION_INDEX) and, for several slices, MEGASCALE_*."""
    coordinator_host = f"{jobset}-{REPLICATED_JOB}-0-0.{jobset}"
    env: list[dict[str, Any]] = [
        {"name": "JAX_COORDINATOR_ADDRESS", "value": f"{coordinator_host}:{COORDINATOR_PORT}"},
        {"name": "JAX_PROCESS_COUNT", "value": str(shape.hosts * slices)},
        {"name": "LORA_HOSTS_PER_SLICE", "value": str(shape.hosts)},
        {"name": "LORA_JOB_INDEX", "valueFrom": _field_ref("metadata.labels['jobset.sigs.k8s.io/job-index']")},
        {"name": "JOB_COMPLETION_INDEX", "valueFrom": _field_ref("metadata.annotations['batch.kubernetes.io/job-completion-index']")},
    ]
    if slices > 1:
        env += [
            {"name": "MEGASCALE_NUM_SLICES", "valueFrom": _field_ref("metadata.labels['jobset.sigs.k8s.io/replicatedjob-replicas']")},
            {"name": "MEGASCALE_SLICE_ID", "valueFrom": _field_ref("metadata.labels['jobset.sigs.k8s.io/job-index']")},
            {"name": "MEGASCALE_COORDINATOR_ADDRESS", "value": coordinator_host},
        ]
    return env


def render_config_map(owner: Owner, spec: LoraFinetuneSpec) -> Manifest:
    """The trainer's half of the spec as `config.json` (no secrets: the HF token is only a reference)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(owner, ChildNames.of(owner.name).config_map, "config"),
        "data": {CONFIG_KEY: dump_train_config(spec.train_config())},
    }


def render_jobset(owner: Owner, spec: LoraFinetuneSpec, settings: OperatorSettings) -> Manifest:
    """One replicatedJob of `slices` Indexed Jobs, each `hosts` pods with `chips_per_host` TPU chips."""
    check_jobset_name(owner.name)
    shape = resolve_tpu(spec, settings)
    image = resolve_image(spec.image, settings)
    names = ChildNames.of(owner.name)
    slices = spec.tpu.slices
    placement = capacity_placement(spec.tpu.capacity)
    queue = _trainer_queue(spec, settings, placement)
    extra = {QUEUE_LABEL: queue} if queue else {}
    meta = _metadata(owner, names.jobset, "trainer", **extra)
    meta["annotations"] = {EXCLUSIVE_TOPOLOGY: "cloud.google.com/gke-nodepool", **placement.jobset_annotations}
    meta["finalizers"] = [TRACKING_FINALIZER]
    pod_labels = _labels(owner, "trainer")
    container = _trainer_container(spec, image, names, shape)
    pod_spec = _trainer_pod_spec(spec, settings, shape, placement, names, container)
    job_spec = _trainer_job_spec(shape, pod_labels, pod_spec, settings)
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": meta,
        "spec": {
            "suspend": spec.suspend,
            "ttlSecondsAfterFinished": settings.job_ttl_seconds_after_finished,
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "failurePolicy": jobset_failure_policy(spec.max_restarts),
            "replicatedJobs": [
                {"name": REPLICATED_JOB, "replicas": slices, "template": {"metadata": {"labels": pod_labels}, "spec": job_spec}}
            ],
        },
    }


def _trainer_queue(spec: LoraFinetuneSpec, settings: OperatorSettings, placement: Placement) -> str | None:
    """The Kueue queue of the JobSet; a capacity type provisioned through Kueue requires one."""
    queue = spec.queue_name or settings.default_queue_name
    if placement.needs_queue and not queue:
        raise InvalidSpec(
            "spec.queueName",
            f"capacity type {spec.tpu.capacity.type} gets its nodes through Kueue's ProvisioningRequest (Dynamic Workload "
            "Scheduler): set spec.queueName to a LocalQueue whose ClusterQueue has the provisioning admission check "
            "(or ask the platform admin for a defaultQueueName)",
        )
    return queue


def _trainer_container(spec: LoraFinetuneSpec, image: str, names: ChildNames, shape: SliceShape) -> dict[str, Any]:
    """The trainer container: `lora-trainer train` on the ConfigMap's config, this host's TPU chips."""
    return {
        "name": TRAINER_CONTAINER,
        "image": image,
        "command": ["lora-trainer", "train", "--config", f"{CONFIG_DIR}/{CONFIG_KEY}"],
        "env": [
            *distributed_env(names.jobset, shape, spec.tpu.slices),
            *_hf_token_env(spec),
            *({"name": e.name, "value": e.value} for e in spec.env),
        ],
        "resources": _resources(spec.resources, {TPU_RESOURCE: str(shape.chips_per_host)}),
        "securityContext": _container_security(),
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }


def _trainer_pod_spec(
    spec: LoraFinetuneSpec, settings: OperatorSettings, shape: SliceShape, placement: Placement, names: ChildNames,
    container: dict[str, Any],
) -> dict[str, Any]:
    """A trainer pod: on the slice's nodes, no API token, the restricted security profile."""
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "nodeSelector": {**shape.node_selector, **placement.node_selector},
        "tolerations": [{"key": TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}, *placement.tolerations],
        "securityContext": _pod_security(),
        "containers": [container],
        "volumes": [
            {"name": "config", "configMap": {"name": names.config_map}},
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        ],
    }
    if settings.allow_host_network:
        pod_spec["hostNetwork"] = True
        pod_spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    if spec.service_account_name:
        pod_spec["serviceAccountName"] = spec.service_account_name
    if spec.priority_class_name:
        pod_spec["priorityClassName"] = spec.priority_class_name
    return pod_spec


def _trainer_job_spec(shape: SliceShape, pod_labels: dict[str, str], pod_spec: dict[str, Any], settings: OperatorSettings) -> dict[str, Any]:
    """One slice's Indexed Job: a pod per host, the pod failure policy, the admin's overlay."""
    pod_meta: dict[str, Any] = {"labels": pod_labels}
    if tas := topology_annotations(settings.topology_aware_scheduling):
        pod_meta["annotations"] = tas
    return {
        "parallelism": shape.hosts,
        "completions": shape.hosts,
        "completionMode": "Indexed",
        "backoffLimit": 0,
        "podFailurePolicy": pod_failure_policy(),
        "template": overlay_pod_template({"metadata": pod_meta, "spec": pod_spec}, TRAINER_CONTAINER, settings.pod_template_overlay),
    }


def _cpu_job(
    owner: Owner,
    name: str,
    component: str,
    command: list[str],
    image: str,
    settings: OperatorSettings,
    *,
    service_account: str | None,
    resources: Resources | None,
    env: list[dict[str, Any]],
) -> Manifest:
    """A single-pod Job (export, conversion): fail on the first error, no retries that would rewrite outputs."""
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "securityContext": _pod_security(),
        "containers": [
            {
                "name": component,
                "image": image,
                "command": command,
                "env": env,
                "resources": _resources(resources or settings.export_resources),
                "securityContext": _container_security(),
            }
        ],
    }
    if service_account:
        pod_spec["serviceAccountName"] = service_account
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {**_metadata(owner, name, component), "finalizers": [TRACKING_FINALIZER]},
        "spec": {
            "backoffLimit": 0,
            "ttlSecondsAfterFinished": settings.job_ttl_seconds_after_finished,
            "template": {"metadata": {"labels": _labels(owner, component)}, "spec": pod_spec},
        },
    }


def output_uris(spec: LoraFinetuneSpec) -> dict[str, str]:
    """Where the export writes: `adapter` (HF PEFT) and/or `merged`."""
    root = spec.output.uri.rstrip("/")
    out = {}
    if spec.output.export.hf_peft:
        out["adapter"] = f"{root}/hf-adapter"
    if spec.output.export.merged:
        out["merged"] = f"{root}/merged"
    return out


def render_export_jobs(owner: Owner, spec: LoraFinetuneSpec, settings: OperatorSettings) -> list[Manifest]:
    """The post-training export: latest checkpoint -> HF PEFT adapter, and a merged model when asked."""
    image = resolve_image(spec.image, settings)
    names = ChildNames.of(owner.name)
    checkpoints = f"{spec.output.uri.rstrip('/')}/checkpoints"
    uris = output_uris(spec)
    jobs = []
    for key, name, flags in (("adapter", names.export, []), ("merged", names.export_merged, ["--merged"])):
        if key in uris:
            command = ["lora-trainer", "export", "--checkpoint", checkpoints, *flags, "--out", uris[key]]
            jobs.append(
                _cpu_job(
                    owner, name, "export", command, image, settings,
                    service_account=spec.service_account_name, resources=None, env=_hf_token_env(spec),
                )
            )
    return jobs


def render_conversion_job(owner: Owner, spec: AdapterConversionSpec, settings: OperatorSettings) -> Manifest:
    """`lora-trainer convert` as a Job."""
    check_name(owner.name)
    refuse(adapter_conversion_problems(spec, settings))
    image = resolve_image(spec.image, settings)
    command = [
        "lora-trainer", "convert",
        "--from", spec.source.format, "--to", spec.target.format,
        "--source", spec.source.uri, "--out", spec.target.uri,
        "--base", spec.model.source,
    ]
    if spec.model.family:
        command += ["--family", spec.model.family]
    if spec.merged:
        command.append("--merged")
    return _cpu_job(
        owner, conversion_job_name(owner.name), "convert", command, image, settings,
        service_account=spec.service_account_name, resources=spec.resources, env=[],
    )


def render_training(owner: Owner, spec: LoraFinetuneSpec, settings: OperatorSettings) -> list[Manifest]:
    """What a LoraFinetune trains with: the ConfigMap, then the JobSet; InvalidSpec naming every
    field the admin's settings refuse."""
    refuse(lora_finetune_problems(spec, settings))
    return [render_config_map(owner, spec), render_jobset(owner, spec, settings)]


def render_lora_finetune(body: dict[str, Any], settings: OperatorSettings) -> list[Manifest]:
    """Everything a LoraFinetune creates up front: the ConfigMap, then the JobSet."""
    return render_training(Owner.from_body(body), parse_spec(LoraFinetuneSpec, body), settings)


def render_all(body: dict[str, Any], settings: OperatorSettings) -> list[Manifest]:
    """Every child of a CR, including the export Jobs created later (for `lora-operator render`)."""
    kind = body.get("kind")
    if kind == "LoraFinetune":
        owner = Owner.from_body(body)
        spec = parse_spec(LoraFinetuneSpec, body)
        return [*render_lora_finetune(body, settings), *render_export_jobs(owner, spec, settings)]
    if kind == "AdapterConversion":
        return [render_conversion_job(Owner.from_body(body), parse_spec(AdapterConversionSpec, body), settings)]
    raise InvalidSpec("kind", f"expected LoraFinetune or AdapterConversion, got {kind!r}")


class _ManifestDumper(yaml.SafeDumper):
    """YAML like kubectl writes it: no anchors/aliases, multi-line strings as literal blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str_presenter(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_ManifestDumper.add_representer(str, _str_presenter)


def to_yaml(manifests: list[Manifest]) -> str:
    """A YAML stream of manifests, as `kubectl apply -f -` reads it."""
    return yaml.dump_all(manifests, Dumper=_ManifestDumper, sort_keys=False, width=120)


def render_file(path: Path, *, settings_path: str | None = None) -> int:
    """`lora-operator render -f CR.yaml`: print every child as one YAML stream; 2 on a bad manifest."""
    try:
        settings = load_settings(settings_path)
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        out = []
        for doc in docs:
            doc.setdefault("metadata", {}).setdefault("uid", "00000000-0000-0000-0000-000000000000")
            out += render_all(doc, settings)
    except (OSError, yaml.YAMLError, SettingsError, InvalidSpec, KeyError) as e:
        print(f"lora-operator render: {path}: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(to_yaml(out))
    return 0
