"""Plan, then act: what a CR should have, from its spec and the operator's settings alone. Pure.

A plan is the desired half of a reconcile: the children (rendered), the names they go by, and
the partial status (typed) that describes the run before anything happened. `lora_operator.reconcile`
compares it with what the cluster holds and the CR's durable record. A spec the settings refuse
still gives a plan (with `problem` set), because a run admitted before the settings changed must
still be followed to its end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lora_operator.api import AdapterConversionSpec, LoraFinetuneSpec, LoraFinetuneStatus
from lora_operator.render import (
    ChildNames,
    InvalidSpec,
    Manifest,
    Owner,
    check_jobset_name,
    conversion_job_name,
    output_uris,
    parse_spec,
    render_conversion_job,
    render_export_jobs,
    render_training,
    resolve_tpu,
    tpu_summary,
)
from lora_operator.settings import OperatorSettings


@dataclass(frozen=True)
class Plan:
    """What a LoraFinetune should have."""

    names: ChildNames
    spec: LoraFinetuneSpec | None = None
    """None only when the spec does not parse (the CRD should have refused it)."""
    problem: InvalidSpec | None = None
    """Why the children cannot be rendered now (a field, a setting); None when they can."""
    training: list[Manifest] = field(default_factory=list)
    """The ConfigMap and the JobSet."""
    exports: list[Manifest] = field(default_factory=list)
    """The export Jobs (none when output.export asks for nothing)."""
    export_names: list[str] = field(default_factory=list)
    """Names of the export Jobs the spec asks for, even when they cannot be rendered."""
    admission: LoraFinetuneStatus = field(default_factory=LoraFinetuneStatus)
    """The partial status that describes the run before it starts: JobSet name, TPU shape, step counter."""

    @property
    def suspend(self) -> bool:
        return bool(self.spec and self.spec.suspend)


def plan_lora_finetune(body: dict[str, Any], settings: OperatorSettings) -> Plan:
    """The plan of a LoraFinetune `body` under `settings`."""
    names = ChildNames.of(body["metadata"]["name"])
    try:
        spec = parse_spec(LoraFinetuneSpec, body)
    except InvalidSpec as e:
        return Plan(names, problem=e)
    uris = output_uris(spec)
    export_names = [n for key, n in (("adapter", names.export), ("merged", names.export_merged)) if key in uris]
    steps = spec.training.steps
    admission = LoraFinetuneStatus(job_set_name=names.jobset, total_steps=steps, progress=f"0/{steps}")
    try:
        check_jobset_name(names.jobset)
        admission = admission.merged(LoraFinetuneStatus(tpu=tpu_summary(resolve_tpu(spec, settings), spec.tpu.slices)))
        owner = Owner.from_body(body)
        return Plan(names, spec, None, render_training(owner, spec, settings), render_export_jobs(owner, spec, settings),
                    export_names, admission)
    except InvalidSpec as e:
        return Plan(names, spec, e, export_names=export_names, admission=admission)


@dataclass(frozen=True)
class ConversionPlan:
    """What an AdapterConversion should have: one Job."""

    job_name: str
    spec: AdapterConversionSpec | None = None
    problem: InvalidSpec | None = None
    job: Manifest | None = None


def plan_adapter_conversion(body: dict[str, Any], settings: OperatorSettings) -> ConversionPlan:
    """The plan of an AdapterConversion `body` under `settings`."""
    name = conversion_job_name(body["metadata"]["name"])
    try:
        spec = parse_spec(AdapterConversionSpec, body)
    except InvalidSpec as e:
        return ConversionPlan(name, problem=e)
    try:
        return ConversionPlan(name, spec, None, render_conversion_job(Owner.from_body(body), spec, settings))
    except InvalidSpec as e:
        return ConversionPlan(name, spec, e)
