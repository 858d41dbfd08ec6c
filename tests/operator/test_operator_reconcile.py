"""The level-triggered decisions as pure functions: (CR with its durable record, plan, observed
children) -> operations. The states here are the ones issue 22's fault campaign reached with the
real operator; tests/operator/test_operator_chaos.py drives the real process through them."""

from __future__ import annotations

import copy
from typing import Any

from lora_operator.plan import plan_adapter_conversion, plan_lora_finetune
from lora_operator.reconcile import (
    Create,
    Observed,
    PatchSuspend,
    PostEvent,
    SetFinalizers,
    WriteStatus,
    decide_adapter_conversion,
    decide_lora_finetune,
)
from lora_operator.render import TRACKING_FINALIZER
from lora_operator.settings import OperatorSettings

NOW = "2026-12-05T08:00:00Z"
SETTINGS = OperatorSettings()
UID = "cr-uid"


def run(status: dict[str, Any] | None = None, suspend: bool = False, **spec: Any) -> dict[str, Any]:
    body = {
        "apiVersion": "lora-operator.dev/v1alpha1", "kind": "LoraFinetune",
        "metadata": {"name": "run", "namespace": "ml", "uid": UID, "generation": 2, "resourceVersion": "7"},
        "spec": {"model": {"source": "gs://m-bucket/m"}, "dataset": {"train": "gs://d-bucket/t.jsonl"},
                 "output": {"uri": "gs://r-bucket/run"}, "suspend": suspend, **spec},
    }
    if status is not None:
        body["status"] = status
    return body


def admitted(phase: str, *, requested: bool = False, applied: bool = False, jobset_uid: str | None = "js-1") -> dict[str, Any]:
    children = [{"kind": "JobSet", "name": "run", "uid": jobset_uid}] if jobset_uid else []
    return {"phase": phase, "jobSetName": "run", "conditions": [],
            "record": {"suspendRequested": requested, "suspendApplied": applied, "children": children}}


def jobset(*, suspend: bool = False, uid: str = "js-1", status: dict[str, Any] | None = None, deleting: bool = False,
           finalizers: tuple[str, ...] = (TRACKING_FINALIZER,), queue: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "run", "namespace": "ml", "uid": uid, "resourceVersion": "3", "finalizers": list(finalizers),
                            "labels": {"kueue.x-k8s.io/queue-name": queue} if queue else {},
                            "ownerReferences": [{"uid": UID, "controller": True}]}
    if deleting:
        meta["deletionTimestamp"] = NOW
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": meta, "spec": {"suspend": suspend},
            "status": status or {}}


COMPLETED = {"conditions": [{"type": "Completed", "status": "True", "lastTransitionTime": NOW}], "terminalState": "Completed"}
RUNNING = {"replicatedJobsStatus": [{"name": "slice", "active": 1, "ready": 1}]}


def decide(cr: dict[str, Any], seen: Observed) -> list[Any]:
    return decide_lora_finetune(cr, plan_lora_finetune(cr, SETTINGS), seen, NOW)


def kinds(ops: list[Any]) -> list[str]:
    return [type(op).__name__ for op in ops]


def test_a_finished_jobset_deleted_by_its_ttl_is_recorded_before_it_goes_and_never_created_again():
    """The TTL deleted the completed JobSet while the operator was away: the tracking finalizer kept
    it, so the run records Exporting first; once Exporting, the JobSet is let go, and its absence
    creates nothing (the issue's 9 extra JobSets came from reading absence as 'deleted by hand')."""
    cr = run(admitted("Running"))
    ops = decide(cr, Observed(jobset=jobset(status=COMPLETED, deleting=True)))
    assert not [op for op in ops if isinstance(op, (Create, SetFinalizers))]
    write = next(op for op in ops if isinstance(op, WriteStatus))
    assert write.fields["phase"] == "Exporting"
    exporting = run({**admitted("Running"), **write.fields})
    ops = decide(exporting, Observed(jobset=jobset(status=COMPLETED, deleting=True), jobs={"run-export": None}))
    assert [op.finalizers for op in ops if isinstance(op, SetFinalizers)] == [[]]
    assert [op.manifest["kind"] for op in ops if isinstance(op, Create)] == ["Job"]
    gone = decide(exporting, Observed(jobset=None, jobs={"run-export": None}))
    assert [op.manifest["kind"] for op in gone if isinstance(op, Create)] == ["Job"]


def test_a_jobset_deleted_while_training_is_let_go_then_created_again_with_one_event():
    cr = run(admitted("Running"))
    ops = decide(cr, Observed(jobset=jobset(status=RUNNING, deleting=True)))
    assert kinds(ops) == ["SetFinalizers"] and ops[0].finalizers == []
    ops = decide(cr, Observed(jobset=None))
    assert [op.manifest["kind"] for op in ops if isinstance(op, Create)] == ["ConfigMap", "JobSet"]
    ops = decide(cr, Observed(jobset=jobset(uid="js-2", status=RUNNING)))
    events = [op for op in ops if isinstance(op, PostEvent)]
    assert [(e.reason, e.key) for e in events] == [("JobSetRecreated", "child/js-2")]
    record = next(op for op in ops if isinstance(op, WriteStatus)).fields["record"]
    assert record["children"] == [{"kind": "JobSet", "name": "run", "uid": "js-2"}]


def test_a_jobset_never_deleted_gets_created_not_recreated():
    cr = run(admitted("Pending", jobset_uid=None))
    events = [op for op in decide(cr, Observed(jobset=jobset(status=RUNNING))) if isinstance(op, PostEvent)]
    assert [e.reason for e in events] == ["Created", "TrainingRunning"]


def test_a_resume_made_while_the_operator_was_away_after_it_suspended_the_jobset_is_applied():
    """Killed after patching the JobSet suspended (the request was written, not yet applied); the
    user resumed meanwhile. The request and what was applied differ: apply the spec as it is now."""
    cr = run(admitted("Running", requested=True, applied=False), suspend=False)
    ops = decide(cr, Observed(jobset=jobset(suspend=True, status=RUNNING)))
    assert kinds(ops) == ["WriteStatus", "PatchSuspend", "PostEvent", "WriteStatus"]
    assert ops[0].fields["record"]["suspendRequested"] is False
    assert ops[1] == PatchSuspend("run", False)
    assert ops[2].reason == "Resumed"
    assert ops[3].fields["record"] == {"suspendRequested": False, "suspendApplied": False,
                                       "children": [{"kind": "JobSet", "name": "run", "uid": "js-1"}]}
    # The request is written before the JobSet is patched, so a kill between them repeats the patch.
    suspend = run(admitted("Running"), suspend=True)
    ops = decide(suspend, Observed(jobset=jobset(status=RUNNING)))
    assert kinds(ops)[:2] == ["WriteStatus", "PatchSuspend"] and ops[0].fields["record"]["suspendRequested"] is True


def test_a_suspended_jobset_without_a_queue_is_not_waiting_for_kueue():
    """Without the Kueue label nothing admits it: the spec decides (resume), never WaitingForAdmission."""
    cr = run(admitted("Running"), suspend=False)
    ops = decide(cr, Observed(jobset=jobset(suspend=True, status=RUNNING)))
    assert PatchSuspend("run", False) in ops
    assert not [op for op in ops if isinstance(op, WriteStatus) and "WaitingForAdmission" in str(op.fields)]
    # With the label, Kueue holds it: reported, never unsuspended behind Kueue's back.
    queued = run(admitted("Pending"), suspend=False, queueName="tpu-q")
    ops = decide(queued, Observed(jobset=jobset(suspend=True, queue="tpu-q", status={"replicatedJobsStatus": []})))
    assert not [op for op in ops if isinstance(op, PatchSuspend)]
    assert next(op for op in ops if isinstance(op, WriteStatus)).fields["conditions"][0]["reason"] == "WaitingForAdmission"


def test_a_settled_run_needs_nothing_and_a_finished_one_only_lets_its_children_go():
    cr = run(admitted("Running"))
    settled = decide(cr, Observed(jobset=jobset(status=RUNNING)))
    cr2 = copy.deepcopy(cr)
    for op in settled:
        if isinstance(op, WriteStatus):
            cr2["status"].update(op.fields)
    assert decide(cr2, Observed(jobset=jobset(status=RUNNING))) == []
    done = run(admitted("Succeeded"))
    job = {**jobset(), "apiVersion": "batch/v1", "kind": "Job"}
    assert kinds(decide(done, Observed(jobset=jobset(status=COMPLETED), jobs={"run-export": job}))) == ["SetFinalizers"] * 2


def test_an_adapter_conversion_records_its_job_before_it_may_go():
    cr = {"apiVersion": "lora-operator.dev/v1alpha1", "kind": "AdapterConversion",
          "metadata": {"name": "c", "namespace": "ml", "uid": UID, "generation": 1},
          "spec": {"source": {"uri": "gs://b-bucket/a", "format": "hf-peft"}, "target": {"uri": "gs://b-bucket/o", "format": "orbax"},
                   "model": {"source": "gs://b-bucket/m"}},
          "status": {"phase": "Running", "jobName": "c-convert", "record": {"children": [{"kind": "Job", "name": "c-convert", "uid": "j1"}]}}}
    plan = plan_adapter_conversion(cr, SETTINGS)
    job = {**jobset(uid="j1", deleting=True, status={"conditions": [{"type": "Complete", "status": "True"}]}),
           "apiVersion": "batch/v1", "kind": "Job"}
    ops = decide_adapter_conversion(cr, plan, Observed(jobs={"c-convert": job}), NOW)
    assert not [op for op in ops if isinstance(op, (Create, SetFinalizers))]
    assert next(op for op in ops if isinstance(op, WriteStatus)).fields["phase"] == "Succeeded"
    assert [op.manifest["kind"] for op in decide_adapter_conversion(cr, plan, Observed(jobs={"c-convert": None}), NOW)
            if isinstance(op, Create)] == ["Job"]
