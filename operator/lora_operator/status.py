"""JobSet/Job status -> CR phase, conditions, restarts, preemptions and times. Pure functions.

The JobSet controller reports `conditions` (Completed, Failed, Suspended), `restarts` (all
of them), `restartsCountTowardsMax` (those its `RestartJobSet` action made, i.e. not the
preemptions that `lora_operator.failure` restarts with `RestartJobSetAndIgnoreMaxRestarts`) and
per-replicatedJob counts; the Job controller reports `conditions` (Complete, Failed), `active`,
`startTime`, `completionTime`. These functions turn them into what a person reads in
`kubectl get lft`: one phase and metav1.Conditions whose reason is CamelCase and whose
message says what to do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lora_operator.api import MAX_MESSAGE, Phase
from lora_operator.labels import LFT_LABEL, QUEUE_LABEL

#: Phases after which nothing changes any more.
TERMINAL = (Phase.SUCCEEDED, Phase.FAILED)
#: Phases in which a LoraFinetune needs its JobSet.
TRAINING = (Phase.PENDING, Phase.RUNNING, Phase.SUSPENDED)


@dataclass(frozen=True, slots=True)
class Observation:
    """What a child's status means for its CR."""

    phase: str
    reason: str
    message: str
    restarts: int | None = None
    """Restarts counted toward spec.maxRestarts (None: unknown here, the status keeps its value)."""
    preemptions: int | None = None
    """Restarts after a preemption, not counted (None: unknown here)."""
    start_time: str | None = None
    completion_time: str | None = None


def restart_counts(status: dict[str, Any]) -> tuple[int, int]:
    """(counted restarts, preemptions) from a JobSet status. A JobSet controller older than v0.10
    reports no `restartsCountTowardsMax`: then every restart counted."""
    total = int(status.get("restarts") or 0)
    counted = int(status.get("restartsCountTowardsMax", total) or 0)
    return counted, max(0, total - counted)


def _true_condition(status: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    for c in status.get("conditions") or []:
        if c.get("type") == ctype and c.get("status") == "True":
            return c
    return None


def kueue_queue(jobset: dict[str, Any]) -> str | None:
    """The Kueue LocalQueue a JobSet is queued in (its label), or None when Kueue does not manage it."""
    return (jobset.get("metadata", {}).get("labels") or {}).get(QUEUE_LABEL) or None


RESUMED = "resumed; waiting for TPU pods (training continues from the last checkpoint)"


def observe_jobset(jobset: dict[str, Any], *, requested_suspend: bool = False) -> Observation:
    """Phase of a LoraFinetune from its JobSet (before export; `Completed` means training finished).

    A suspended JobSet whose LoraFinetune did not ask for it (`requested_suspend`) and that carries
    a Kueue queue label is waiting for Kueue, whose webhook keeps queued JobSets suspended until
    admission: that is Pending, not Suspended. Without the label no Kueue holds it, so it is
    about to be resumed (never reported as waiting for admission).
    Suspension is read from `spec.suspend` alone: the controller's `Suspended` condition lags a
    resume by a moment, and read as suspension it made every resumed run look queued by Kueue."""
    status = jobset.get("status") or {}
    name = jobset.get("metadata", {}).get("name", "")
    restarts, preemptions = restart_counts(status)
    counts = {"restarts": restarts, "preemptions": preemptions}
    logs = f"kubectl logs -l jobset.sigs.k8s.io/jobset-name={name} -c trainer"
    if c := _true_condition(status, "Failed"):
        reason = c.get("reason") or "JobSetFailed"
        detail = c.get("message") or "the JobSet failed"
        if reason == "ReachedMaxRestarts":
            hint = (f"the run was restarted {restarts} times after retriable faults (exit 42, or killed without a "
                    f"preemption; the {preemptions} preemptions did not count); inspect `{logs}` and recreate the "
                    "LoraFinetune with a larger spec.maxRestarts if the faults were transient")
        else:
            hint = (f"a trainer pod exited with a non-retriable code (3 = bad config, model or data); "
                    f"read `{logs}`, fix the spec and create a new LoraFinetune")
        return Observation(Phase.FAILED, "TrainingFailed", f"{detail} ({reason}): {hint}", **counts,
                           completion_time=c.get("lastTransitionTime"))
    if c := _true_condition(status, "Completed"):
        return Observation(Phase.EXPORTING, "TrainingCompleted", "training finished; exporting the adapter", **counts,
                           completion_time=c.get("lastTransitionTime"))
    if (jobset.get("spec") or {}).get("suspend"):
        if requested_suspend:
            return Observation(Phase.SUSPENDED, "Suspended", "the JobSet is suspended; set spec.suspend to false to resume from the last checkpoint", **counts)
        queue = kueue_queue(jobset)
        if queue is None:  # no Kueue holds it: the operator is resuming it (spec.suspend is false)
            return Observation(Phase.PENDING, "Resumed", RESUMED, **counts)
        return Observation(Phase.PENDING, "WaitingForAdmission",
                           f"the JobSet is suspended until Kueue admits it from LocalQueue {queue}; check `kubectl get workloads` for quota", **counts)
    jobs = status.get("replicatedJobsStatus") or []
    if any((j.get("active") or 0) + (j.get("ready") or 0) > 0 for j in jobs):
        return Observation(Phase.RUNNING, "TrainingRunning", "trainer pods are running", **counts)
    return Observation(
        Phase.PENDING, "WaitingForPods",
        "waiting for TPU nodes and pods to start (check Kueue admission and node pool capacity if this lasts)", **counts,
    )


def observe_job(job: dict[str, Any], what: str) -> Observation:
    """Phase of an export or conversion Job; `what` names it in messages (e.g. `export`)."""
    status = job.get("status") or {}
    name = job.get("metadata", {}).get("name", "")
    if c := _true_condition(status, "Failed"):
        detail = c.get("message") or c.get("reason") or "the Job failed"
        return Observation(
            Phase.FAILED, f"{what.capitalize()}Failed",
            f"{what} Job {name} failed: {detail}; read `kubectl logs job/{name}`, fix the cause and recreate the resource",
            start_time=status.get("startTime"), completion_time=status.get("completionTime") or c.get("lastTransitionTime"),
        )
    if _true_condition(status, "Complete"):
        return Observation(Phase.SUCCEEDED, f"{what.capitalize()}Succeeded", f"{what} Job {name} finished",
                           start_time=status.get("startTime"), completion_time=status.get("completionTime"))
    if (status.get("active") or 0) > 0:
        return Observation(Phase.RUNNING, f"{what.capitalize()}Running", f"{what} Job {name} is running", start_time=status.get("startTime"))
    return Observation(Phase.PENDING, f"{what.capitalize()}Pending", f"{what} Job {name} is waiting for its pod")


def job_finished(job: dict[str, Any]) -> bool:
    """True once the Job controller has said Complete or Failed."""
    status = job.get("status") or {}
    return _true_condition(status, "Complete") is not None or _true_condition(status, "Failed") is not None


def combine_jobs(observations: list[Observation]) -> Observation:
    """Several export Jobs (adapter, merged) as one: any failure fails, all must succeed."""
    for o in observations:
        if o.phase == Phase.FAILED:
            return o
    if observations and all(o.phase == Phase.SUCCEEDED for o in observations):
        ends = [o.completion_time for o in observations if o.completion_time]
        return Observation(Phase.SUCCEEDED, observations[0].reason, "; ".join(o.message for o in observations),
                           completion_time=max(ends) if ends else None)
    running = [o for o in observations if o.phase != Phase.SUCCEEDED]
    return running[0] if running else Observation(Phase.PENDING, "ExportPending", "waiting for the export Job")


#: Condition type that is True in each phase (the others become False).
PHASE_CONDITION = {
    Phase.PENDING: "Running",
    Phase.RUNNING: "Running",
    Phase.SUSPENDED: "Suspended",
    Phase.EXPORTING: "Exporting",
    Phase.SUCCEEDED: "Succeeded",
    Phase.FAILED: "Failed",
}


def set_condition(
    conditions: list[dict[str, Any]], ctype: str, status: str, reason: str, message: str,
    generation: int | None, now: str,
) -> list[dict[str, Any]]:
    """metav1.Condition upsert: lastTransitionTime changes only when `status` does; a message over
    the schema's bound is cut (a webhook's refusal quoted whole could otherwise not be written)."""
    if len(message) > MAX_MESSAGE:
        message = message[: MAX_MESSAGE - 5] + " ..."
    out = []
    found = False
    for c in conditions:
        if c.get("type") == ctype:
            found = True
            changed = c.get("status") != status
            c = {**c, "status": status, "reason": reason, "message": message,
                 "lastTransitionTime": now if changed else c.get("lastTransitionTime", now)}
            if generation is not None:
                c["observedGeneration"] = generation
        out.append(c)
    if not found:
        c = {"type": ctype, "status": status, "reason": reason, "message": message, "lastTransitionTime": now}
        if generation is not None:
            c["observedGeneration"] = generation
        out.append(c)
    return out


def phase_conditions(
    conditions: list[dict[str, Any]], phase: str, reason: str, message: str, generation: int | None, now: str
) -> list[dict[str, Any]]:
    """Conditions for `phase`: its own condition True (Running is False while Pending), others False."""
    active = PHASE_CONDITION[phase]
    status = "False" if phase == Phase.PENDING else "True"
    out = set_condition(conditions, active, status, reason, message, generation, now)
    for c in list(out):
        if c["type"] != active and c["type"] in PHASE_CONDITION.values() and c["status"] == "True":
            out = set_condition(out, c["type"], "False", reason, message, generation, now)
    return out


def status_patch(
    current: dict[str, Any], obs: Observation, generation: int | None, now: str, **fields: Any
) -> dict[str, Any]:
    """The status merge patch that moves a CR to `obs` (None fields are left out)."""
    patch: dict[str, Any] = {
        "phase": obs.phase,
        "conditions": phase_conditions(list(current.get("conditions") or []), obs.phase, obs.reason, obs.message, generation, now),
    }
    if generation is not None:
        patch["observedGeneration"] = generation
    if obs.restarts is not None:
        patch["restarts"] = obs.restarts
    if obs.preemptions is not None:
        patch["preemptions"] = obs.preemptions
    if not current.get("startTime") and (obs.start_time or obs.phase == Phase.RUNNING):
        patch["startTime"] = obs.start_time or now
    if obs.phase in TERMINAL:
        patch["completionTime"] = current.get("completionTime") or obs.completion_time or now
    patch.update({k: v for k, v in fields.items() if v is not None})
    return patch


def owner_name(child: dict[str, Any], label: str = LFT_LABEL) -> str | None:
    """The CR a child belongs to, from its label."""
    return (child.get("metadata", {}).get("labels") or {}).get(label)
