"""Level-triggered reconcile, as pure decisions: (CR, plan, observed children) -> the next operations.

Every trigger (create, resume, an update, a child's event, the resync timer) runs the same
decision on fresh reads, so a lost event, an API fault or a kill at any point only delays the
next decision; nothing depends on having seen a change happen. What cannot be read off the
cluster is kept in the CR's status, written before the operator acts on it:

- the run was admitted (`jobSetName`): from then on it must be followed to its end;
- what training ended with (phase Exporting, Succeeded or Failed): the JobSet carries the
  operator's tracking finalizer, so it cannot vanish (TTL, a hand deletion) before this is
  written, and a finished run never gets a new JobSet;
- the suspension requested and applied (`record.suspendRequested/Applied`): a resume made while
  the operator was away, after it had suspended the JobSet, is applied when it returns;
- the children it created (`record.children`, by uid): a child under a new uid was created again,
  so `Created` and `...Recreated` events are told apart, and each is keyed by that uid;
- events are named from a key (`PostEvent.key`), so posting one again is a no-op.

The controller (`lora_operator.controller`) observes, calls these functions, and executes the
operations in order, round after round until nothing is left to do. A `WriteStatus` is a typed
partial status: the controller merges a reconcile's changes and writes them once, at the end,
except that what is decided before an operation on a child is written before it (the write-aheads
above: admission before the children, the suspension requested before the patch, the end of
training before the JobSet is let go).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any

from lora_operator import status as st
from lora_operator.api import AdapterConversionStatus, LoraFinetuneStatus, Phase, StatusModel
from lora_operator.plan import ConversionPlan, Plan
from lora_operator.render import TRACKING_FINALIZER, Manifest, output_uris

Status = dict[str, Any]


# --- operations --------------------------------------------------------------------------------


@dataclass(frozen=True)
class WriteStatus:
    """A status change: the controller merges it into the reconcile's one status write (written
    before the round's next child operation, or at the end; see lora_operator.controller)."""

    status: StatusModel
    """The partial status (only the fields it sets)."""

    @property
    def fields(self) -> Status:
        """The change by wire names, as the merge patch carries it."""
        return self.status.to_patch()


#: The status model of each kind: a change is typed, and so checked, where it is decided.
STATUS_MODELS: dict[str, type[StatusModel]] = {"LoraFinetune": LoraFinetuneStatus, "AdapterConversion": AdapterConversionStatus}


def status_change(cr: Manifest, fields: Status) -> WriteStatus:
    """The change that sets these status fields (wire names) on `cr`, typed by its kind."""
    return WriteStatus(STATUS_MODELS[cr["kind"]].model_validate(fields))


@dataclass(frozen=True)
class PostEvent:
    """An Event on the CR, posted at most once per `key`."""

    type: str
    reason: str
    message: str
    key: str


@dataclass(frozen=True)
class Create:
    """Create (or adopt) a child; if the server or a webhook refuses it, the CR fails with `reason`
    (None: the refusal's own, InvalidSpec or NameConflict) and `prefix` before the refusal."""

    manifest: Manifest
    prefix: str = ""
    reason: str | None = None


@dataclass(frozen=True)
class PatchSuspend:
    """Set the JobSet's spec.suspend."""

    name: str
    suspend: bool


@dataclass(frozen=True)
class SetFinalizers:
    """Replace a child's finalizers, if it has not changed since it was observed."""

    child: Manifest
    finalizers: list[str]


Op = WriteStatus | PostEvent | Create | PatchSuspend | SetFinalizers


@dataclass(frozen=True)
class Observed:
    """What the controller read for one decision. A child another owner controls is not observed
    (None): creating it then fails with NameConflict."""

    jobset: Manifest | None = None
    jobs: dict[str, Manifest | None] = field(default_factory=dict)
    secret: str | None = None
    """`found`, `missing` or `no-key` for spec.hfTokenSecretRef; None when not read."""
    progress: Status = field(default_factory=dict)
    """Status fields from the trainer's last progress record, read when training has just ended."""


# --- shared steps ------------------------------------------------------------------------------


def deleting(obj: Manifest | None) -> bool:
    return bool(obj and obj.get("metadata", {}).get("deletionTimestamp"))


def _finalizers(obj: Manifest) -> list[str]:
    return list(obj.get("metadata", {}).get("finalizers") or [])


def release(*children: Manifest | None) -> list[Op]:
    """Take the tracking finalizer off children that carry it: the CR needs them no more."""
    return [SetFinalizers(c, [f for f in _finalizers(c) if f != TRACKING_FINALIZER])
            for c in children if c is not None and TRACKING_FINALIZER in _finalizers(c)]


def track(child: Manifest) -> list[Op]:
    """Put the tracking finalizer on a child that lacks it (adopted from an older operator)."""
    if deleting(child) or TRACKING_FINALIZER in _finalizers(child):
        return []
    return [SetFinalizers(child, [*_finalizers(child), TRACKING_FINALIZER])]


def _record(status: Status) -> Status:
    return dict(status.get("record") or {})


def recorded_uid(status: Status, kind: str, name: str) -> str | None:
    """The uid the operator last saw for this child, or None if it never saw one."""
    return next((c["uid"] for c in _record(status).get("children") or [] if c["kind"] == kind and c["name"] == name), None)


def _with_child(record: Status, kind: str, name: str, uid: str) -> Status:
    others = [c for c in record.get("children") or [] if (c["kind"], c["name"]) != (kind, name)]
    return {**record, "children": [*others, {"kind": kind, "name": name, "uid": uid}]}


def adopt(cr: Manifest, child: Manifest, record: Status, created: tuple[str, str, str],
          recreated: tuple[str, str, str]) -> tuple[Status, list[Op]]:
    """Record a child's uid; when it is new, the event saying so, keyed by that uid: `created`
    (reason, message, type) for the first one, `recreated` for one under a uid seen before."""
    meta = child["metadata"]
    previous = recorded_uid({"record": record}, child["kind"], meta["name"])
    if previous == meta["uid"]:
        return record, []
    reason, message, type = created if previous is None else recreated
    return _with_child(record, child["kind"], meta["name"], meta["uid"]), [PostEvent(type, reason, message, f"child/{meta['uid']}")]


def status_ops(cr: Manifest, obs: st.Observation, now: str, *, events: bool = True, **fields: Any) -> list[Op]:
    """The one way a decision changes a CR's status: the patch that moves it to `obs` (and
    `fields`), when it changes anything, after the events that say so (a phase change, a restart,
    each preemption), each keyed so that a repeated decision posts it once."""
    current = cr.get("status") or {}
    gen = cr["metadata"].get("generation")
    patch = st.status_patch(current, obs, gen, now, **fields)
    if all(current.get(k) == v for k, v in patch.items()):
        return []
    ops: list[Op] = []
    if events and current.get("phase") != obs.phase:
        ops.append(PostEvent("Warning" if obs.phase == Phase.FAILED else "Normal", obs.reason, obs.message,
                             f"phase/{obs.phase}/{obs.reason}/{obs.restarts or 0}/{obs.preemptions or 0}/{gen}"))
    if events and (obs.restarts or 0) > (current.get("restarts") or 0):
        ops.append(PostEvent("Warning", "Restarted", f"the JobSet restarted (restart {obs.restarts} of spec.maxRestarts "
                                                     f"{(cr.get('spec') or {}).get('maxRestarts')}); training resumes from "
                                                     "the last checkpoint", f"restart/{obs.restarts}"))
    if events:
        ops += [PostEvent("Normal", "Preempted", f"preemption {n}: a trainer pod was preempted, evicted or its node shut down "
                                                 "(or it saved on SIGTERM); the JobSet restarted without counting toward "
                                                 "spec.maxRestarts and training resumes from the last committed checkpoint",
                          f"preemption/{n}")
                for n in range((current.get("preemptions") or 0) + 1, (obs.preemptions or 0) + 1)]
    return [*ops, status_change(cr, patch)]


def _fail(cr: Manifest, reason: str, message: str, now: str, **fields: Any) -> list[Op]:
    return status_ops(cr, st.Observation(Phase.FAILED, reason, message), now, **fields)


def _key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# --- LoraFinetune ------------------------------------------------------------------------------


def decide_lora_finetune(cr: Manifest, plan: Plan, seen: Observed, now: str) -> list[Op]:
    """The next operations for a LoraFinetune (none: it is where it should be)."""
    status = cr.get("status") or {}
    phase: Phase | None = status.get("phase")
    if deleting(cr) or phase in st.TERMINAL:
        return release(seen.jobset, *seen.jobs.values())
    if not status.get("jobSetName"):
        return _admit(cr, plan, seen, now)
    if phase == Phase.EXPORTING:
        return _export(cr, plan, seen, now)
    return _train(cr, plan, seen, now)


def _admit(cr: Manifest, plan: Plan, seen: Observed, now: str) -> list[Op]:
    """Before any child exists: refuse the spec, wait for its Secret, or record the admission (the
    JobSet name, the suspension it is created with), then create the children."""
    if plan.problem is not None or plan.spec is None:
        assert plan.problem is not None
        return _fail(cr, plan.problem.reason, str(plan.problem), now)
    status, gen = cr.get("status") or {}, cr["metadata"].get("generation")
    ref = plan.spec.hf_token_secret_ref
    conditions = list(status.get("conditions") or [])
    if ref is not None and seen.secret != "found":
        what = f"Secret {ref.name!r}" if seen.secret == "missing" else f"key {ref.key!r} in Secret {ref.name!r}"
        ns = cr["metadata"]["namespace"]
        message = (f"spec.hfTokenSecretRef: {what} not found in namespace {ns}; create it (kubectl -n {ns} create secret generic "
                   f"{ref.name} --from-literal={ref.key}=<HF token>) or fix hfTokenSecretRef; the run starts once it exists")
        conditions = st.set_condition(conditions, "SecretsResolved", "False", "SecretNotFound", message, gen, now)
        if conditions == status.get("conditions") and status.get("phase") == Phase.PENDING:
            return []
        return [PostEvent("Warning", "SecretNotFound", message, f"secret/{gen}"),
                status_change(cr, {"phase": Phase.PENDING, "conditions": conditions})]
    if ref is not None:
        conditions = st.set_condition(conditions, "SecretsResolved", "True", "SecretFound", "hfTokenSecretRef resolved", gen, now)
    obs = (st.Observation(Phase.SUSPENDED, "Suspended", "created suspended; set spec.suspend to false to start") if plan.suspend
           else st.Observation(Phase.PENDING, "JobSetCreated", f"created JobSet {plan.names.jobset}; waiting for TPU pods"))
    admitted = {**cr, "status": {**status, "conditions": conditions}}
    record = {"suspendRequested": plan.suspend, "suspendApplied": plan.suspend, "children": []}
    # Written before the children exist (the controller writes it ahead of the first Create), so
    # every JobSet-driven decision finds the run admitted.
    return [*status_ops(admitted, obs, now, events=False, **plan.admission.to_patch(), record=record),
            *map(Create, plan.training)]


def _train(cr: Manifest, plan: Plan, seen: Observed, now: str) -> list[Op]:
    """Pending, Running or Suspended: keep the JobSet there and report it."""
    status = cr.get("status") or {}
    record = _record(status)
    js = seen.jobset
    if js is None:
        prefix = "the JobSet was deleted and cannot be created again: " if recorded_uid(status, "JobSet", plan.names.jobset) else ""
        if plan.problem is not None:
            return _fail(cr, plan.problem.reason, f"{prefix}{plan.problem}", now)
        return [Create(m, prefix=prefix) for m in plan.training]
    record, ops = adopt(
        cr, js, record,
        ("Created", f"created ConfigMap {plan.names.config_map} and JobSet {plan.names.jobset}", "Normal"),
        ("JobSetRecreated", f"the JobSet {plan.names.jobset} was deleted while the run was {status.get('phase')}; created it "
                            "again, training resumes from the last checkpoint (to stop a run, delete or suspend the LoraFinetune)",
         "Warning"),
    )
    if plan.problem is not None:
        ops.append(PostEvent("Warning", "SettingsChanged",
                             f"the operator's settings now refuse this spec ({plan.problem}); this run was admitted before and "
                             "keeps running, new runs like it are refused", f"settings/{_key(str(plan.problem))}"))
    obs = st.observe_jobset(js, requested_suspend=plan.suspend)
    if obs.phase in (Phase.EXPORTING, Phase.FAILED):
        # Training ended: write so before the JobSet may go (its finalizer is released once this is read back).
        if obs.phase == Phase.EXPORTING and not plan.export_names:
            obs = st.Observation(Phase.SUCCEEDED, "TrainingCompleted", "training finished; no export requested (output.export)",
                                 obs.restarts, completion_time=obs.completion_time)
        return [*ops, *status_ops(cr, obs, now, **seen.progress, record=record)]
    if deleting(js):  # deleted before it finished: let it go; it is created again once gone
        return [*ops, *_record_only(cr, record), *release(js)]
    ops += track(js)
    if record.get("suspendRequested") != plan.suspend or record.get("suspendApplied") != record.get("suspendRequested"):
        return ops + _apply_suspend(cr, js, plan, record, now)
    if st.kueue_queue(js) is None and bool((js.get("spec") or {}).get("suspend")) != plan.suspend:
        ops.append(PatchSuspend(js["metadata"]["name"], plan.suspend))  # no Kueue holds it: the spec decides
    if not js.get("status"):  # the JobSet controller has not reported yet: admission said what there is to say
        return [*ops, *_record_only(cr, record)]
    return [*ops, *status_ops(cr, obs, now, record=record)]


def _record_only(cr: Manifest, record: Status) -> list[Op]:
    return [] if record == _record(cr.get("status") or {}) else [status_change(cr, {"record": record})]


def _apply_suspend(cr: Manifest, js: Manifest, plan: Plan, record: Status, now: str) -> list[Op]:
    """Suspend or resume the JobSet: the request is written first, then the JobSet patched, then
    the request recorded as applied. Killed in between, the next decision sees them differ and
    applies the spec as it is then (a resume made meanwhile included)."""
    suspend, gen = plan.suspend, cr["metadata"].get("generation")
    ops: list[Op] = []
    status = dict(cr.get("status") or {})
    if record.get("suspendRequested") != suspend:
        record = {**record, "suspendRequested": suspend}
        ops.append(status_change(cr, {"record": record}))  # written before the JobSet is patched (a write-ahead)
        status["record"] = record
    ops.append(PatchSuspend(js["metadata"]["name"], suspend))
    ops.append(PostEvent("Normal", "Suspended" if suspend else "Resumed",
                         "suspended by spec.suspend; pods are deleted and the run resumes from its last checkpoint when unsuspended"
                         if suspend else "resumed by spec.suspend=false; training continues from the last checkpoint",
                         f"suspend/{suspend}/{gen}"))
    patched = {**js, "spec": {**(js.get("spec") or {}), "suspend": suspend}}
    obs = st.observe_jobset(patched, requested_suspend=suspend)
    if not suspend and obs.phase == Phase.PENDING and obs.reason != "WaitingForAdmission":
        obs = st.Observation(Phase.PENDING, "Resumed", st.RESUMED, obs.restarts)
    applied = {**record, "suspendApplied": suspend}
    return [*ops, *status_ops({**cr, "status": status}, obs, now, events=False, record=applied)]


def _export(cr: Manifest, plan: Plan, seen: Observed, now: str) -> list[Op]:
    """Training has finished (and said so): the JobSet may go; keep the export Jobs until they end."""
    status = cr.get("status") or {}
    gen = cr["metadata"].get("generation")
    record = _record(status)
    ops: list[Op] = [*release(seen.jobset)]
    if plan.suspend:
        ops.append(PostEvent("Normal", "SuspendIgnored", "training has finished and the adapter is being exported; "
                                                         "spec.suspend has no effect now", f"suspend-ignored/{gen}"))
    jobs = {name: seen.jobs.get(name) for name in plan.export_names}
    for job in jobs.values():
        if job is not None:
            record, adopted = adopt(cr, job, record, ("ExportStarted", f"created export Job {job['metadata']['name']}", "Normal"),
                                    ("ExportRecreated", "an export Job was deleted before it finished; created it again", "Warning"))
            ops += adopted
    observed = {name: job for name, job in jobs.items() if job is not None and not (deleting(job) and not st.job_finished(job))}
    for job in jobs.values():
        if job is not None and deleting(job) and not st.job_finished(job):
            ops += release(job)  # deleted before it finished: created again once gone
        elif job is not None:
            ops += track(job)
    missing = [name for name in plan.export_names if name not in observed]
    if missing:
        if any(jobs[name] is not None for name in missing):  # still going away
            return [*ops, *_record_only(cr, record)]
        was = any(recorded_uid(status, "Job", name) for name in missing)
        prefix = "an export Job was deleted and cannot be created again: " if was else "cannot start the export: "
        if plan.problem is not None:
            return [*ops, *_fail(cr, "ExportFailed", f"{prefix}{plan.problem}", now, record=record)]
        creates: list[Op] = [Create(m, prefix=prefix, reason="ExportFailed") for m in plan.exports if m["metadata"]["name"] in missing]
        return [*ops, *_record_only(cr, record), *creates]
    obs = st.combine_jobs([st.observe_job(observed[name], "export") for name in plan.export_names])
    fields: Status = {"record": record}
    if obs.phase == Phase.SUCCEEDED and plan.spec is not None:
        uris = output_uris(plan.spec)
        fields |= {"adapterUri": uris.get("adapter"), "mergedUri": uris.get("merged")}
    elif obs.phase == Phase.FAILED:
        obs = st.Observation(Phase.FAILED, "ExportFailed", obs.message, completion_time=obs.completion_time)
    else:  # still exporting: the condition says whether the export pod waits or runs
        obs = st.Observation(Phase.EXPORTING, obs.reason, obs.message)
    return [*ops, *status_ops(cr, obs, now, **fields)]


# --- AdapterConversion -------------------------------------------------------------------------


def decide_adapter_conversion(cr: Manifest, plan: ConversionPlan, seen: Observed, now: str) -> list[Op]:
    """The next operations for an AdapterConversion."""
    status = cr.get("status") or {}
    job = seen.jobs.get(plan.job_name)
    if deleting(cr) or status.get("phase") in st.TERMINAL:
        return release(job)
    if not status.get("jobName"):
        if plan.problem is not None:
            return _fail(cr, plan.problem.reason, str(plan.problem), now)
        obs = st.Observation(Phase.PENDING, "JobCreated", f"created conversion Job {plan.job_name}")
        creates = [Create(plan.job)] if plan.job is not None and job is None else []
        return [*status_ops(cr, obs, now, events=False, jobName=plan.job_name, record={"children": []}), *creates]
    record = _record(status)
    was = recorded_uid(status, "Job", plan.job_name)
    if job is None:
        prefix = "the conversion Job was deleted and cannot be created again: " if was else ""
        if plan.problem is not None or plan.job is None:
            assert plan.problem is not None
            return _fail(cr, plan.problem.reason, f"{prefix}{plan.problem}", now)
        return [Create(plan.job, prefix=prefix)]
    record, ops = adopt(cr, job, record, ("Created", f"created conversion Job {plan.job_name}", "Normal"),
                        ("ConversionRecreated", "the conversion Job was deleted before it finished; created it again", "Warning"))
    obs = st.observe_job(job, "conversion")
    if deleting(job) and obs.phase not in st.TERMINAL:
        return [*ops, *_record_only(cr, record), *release(job)]
    ops += track(job)
    if obs.phase == Phase.FAILED:
        obs = replace(obs, reason="ConversionFailed")
    output = plan.spec.target.uri if obs.phase == Phase.SUCCEEDED and plan.spec else None
    return [*ops, *status_ops(cr, obs, now, outputUri=output, record=record)]
