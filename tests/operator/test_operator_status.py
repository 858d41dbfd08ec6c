"""Pure status mapping (JobSet/Job -> phase and conditions) and the progress record reader."""

from __future__ import annotations

import json

from lora_operator import status as st
from lora_operator.run_progress import progress_status, read_progress

NOW = "2026-12-03T08:00:00Z"
LATER = "2026-12-03T09:00:00Z"


def jobset(status=None, suspend=False):
    return {"metadata": {"name": "run"}, "spec": {"suspend": suspend}, "status": status or {}}


def test_jobset_phases():
    assert st.observe_jobset(jobset()).phase == "Pending"
    running = st.observe_jobset(jobset({"replicatedJobsStatus": [{"name": "slice", "active": 2}], "restarts": 2}))
    assert (running.phase, running.restarts) == ("Running", 2)
    suspended = jobset({"replicatedJobsStatus": [{"active": 0, "suspended": 2}]}, suspend=True)
    assert st.observe_jobset(suspended, requested_suspend=True).phase == "Suspended"
    # Suspended by Kueue until admission, not by the user: still Pending, and the message says why.
    suspended["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "tpu-q"}
    queued = st.observe_jobset(suspended)
    assert (queued.phase, queued.reason) == ("Pending", "WaitingForAdmission") and "LocalQueue tpu-q" in queued.message
    done = st.observe_jobset(jobset({"conditions": [{"type": "Completed", "status": "True", "lastTransitionTime": NOW}]}))
    assert (done.phase, done.completion_time) == ("Exporting", NOW)
    failed = st.observe_jobset(jobset({"conditions": [{"type": "Failed", "status": "True", "reason": "ReachedMaxRestarts",
                                                        "message": "jobset failed"}], "restarts": 3}))
    assert failed.phase == "Failed" and failed.reason == "TrainingFailed"
    assert "maxRestarts" in failed.message and "restarted 3 times" in failed.message
    stale = st.observe_jobset(jobset({"conditions": [{"type": "Failed", "status": "False"}]}))
    assert stale.phase == "Pending"


def test_job_phases_and_combination():
    ok = st.observe_job({"metadata": {"name": "e"}, "status": {"conditions": [{"type": "Complete", "status": "True"}],
                                                                "completionTime": NOW, "startTime": NOW}}, "export")
    assert (ok.phase, ok.reason) == ("Succeeded", "ExportSucceeded")
    bad = st.observe_job({"metadata": {"name": "e2"}, "status": {"conditions": [
        {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": "pod exited 3"}]}}, "export")
    assert bad.phase == "Failed" and "pod exited 3" in bad.message and "kubectl logs job/e2" in bad.message
    running = st.observe_job({"metadata": {"name": "e"}, "status": {"active": 1}}, "conversion")
    assert running.phase == "Running" and running.reason == "ConversionRunning"
    assert st.combine_jobs([ok, bad]).phase == "Failed"
    assert st.combine_jobs([ok, running]).phase == "Running"
    assert st.combine_jobs([ok, ok]).phase == "Succeeded"


def test_conditions_keep_transition_time_until_status_changes():
    c = st.phase_conditions([], "Running", "TrainingRunning", "m", 1, NOW)
    assert c == [{"type": "Running", "status": "True", "reason": "TrainingRunning", "message": "m",
                  "lastTransitionTime": NOW, "observedGeneration": 1}]
    c2 = st.phase_conditions(c, "Running", "TrainingRunning", "m2", 1, LATER)
    assert c2[0]["lastTransitionTime"] == NOW and c2[0]["message"] == "m2"
    c3 = st.phase_conditions(c2, "Suspended", "Suspended", "s", 2, LATER)
    by_type = {x["type"]: x for x in c3}
    assert by_type["Running"]["status"] == "False" and by_type["Running"]["lastTransitionTime"] == LATER
    assert by_type["Suspended"]["status"] == "True"


def test_status_patch_sets_times_once():
    obs = st.Observation("Running", "TrainingRunning", "m", restarts=0)
    p = st.status_patch({}, obs, 3, NOW)
    assert p["startTime"] == NOW and p["observedGeneration"] == 3 and "completionTime" not in p
    p2 = st.status_patch({"startTime": NOW}, st.Observation("Failed", "TrainingFailed", "x"), 3, LATER, adapterUri=None)
    assert "startTime" not in p2 and p2["completionTime"] == LATER and "adapterUri" not in p2


def test_progress_record(tmp_path):
    assert read_progress(str(tmp_path)) is None
    (tmp_path / "progress.json").write_text("{not json")
    assert read_progress(str(tmp_path)) is None
    (tmp_path / "progress.json").write_text(json.dumps({"step": 7, "totalSteps": 10, "loss": 0.123456, "tokensPerSecond": 99.5,
                                                         "mfu": 0.41234, "eta": "3s", "lastCheckpoint": None}))
    record = read_progress(str(tmp_path))
    assert progress_status(record, 10) == {"step": 7, "totalSteps": 10, "progress": "7/10", "loss": "0.1235",
                                           "tokensPerSecond": "99.5", "mfu": "0.412", "eta": "3s"}
    assert "mfu" not in progress_status({"step": 7, "mfu": None}, 10)  # unknown peak: the trainer writes null
    assert progress_status({"step": "7", "loss": True}, 10) == {}
