"""The Job and JobSet controllers' failure handling, emulated the way their code does it, so the
tests can drive a rendered JobSet through a pod failure without a cluster.

Job controller (kubernetes pkg/controller/job/pod_failure_policy.go): the first podFailurePolicy
rule that matches a failed pod decides; `onExitCodes` matches a terminated container of that
name with a non-zero exit code in (or not in) the values, `onPodConditions` a pod condition of
that type and status. `FailJob` fails the Job with reason `PodFailurePolicy` and the message
"Container C for pod NS/P failed with exit code N matching FailJob rule at index I" (or
"Pod NS/P has condition T matching FailJob rule at index I"). A pod no rule matches counts
against `backoffLimit`; the trainer's is 0, so the Job fails with `BackoffLimitExceeded`.

JobSet controller (jobset pkg/controllers/failure_policy.go, v0.12): the first
`failurePolicy.rules[]` entry whose `onJobFailureReasons` contain the Job's failure reason and
one of whose `onJobFailureMessagePatterns` (Go regexp, unanchored) matches its message decides
(an empty list matches anything); without a match the action is `RestartJobSet`.
`RestartJobSet` fails the JobSet with `ReachedMaxRestarts` once `restartsCountTowardsMax`
reached `maxRestarts`, else adds one to `restarts` and to `restartsCountTowardsMax`;
`RestartJobSetAndIgnoreMaxRestarts` adds one to `restarts` only; `FailJobSet` fails it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

JOB_FAILED_REASON = "PodFailurePolicy"


@dataclass(frozen=True, slots=True)
class PodEnd:
    """How a trainer pod ended: its container's exit code and whether Kubernetes marked it disrupted."""

    exit_code: int
    disrupted: bool = False
    container: str = "trainer"


def job_failure(job_spec: dict[str, Any], pod: PodEnd, pod_name: str = "ns/run-slice-0-0-abcde") -> tuple[str, str]:
    """(reason, message) of the Job's Failed condition after `pod` failed."""
    for index, rule in enumerate(job_spec.get("podFailurePolicy", {}).get("rules", [])):
        requirement = rule.get("onExitCodes")
        if requirement is not None:
            name = requirement.get("containerName")
            hit = pod.exit_code != 0 and (name is None or name == pod.container) and (
                (pod.exit_code in requirement["values"]) == (requirement["operator"] == "In"))
            what = f"Container {pod.container} for pod {pod_name} failed with exit code {pod.exit_code}"
        else:
            hit = pod.disrupted and any(c["type"] == "DisruptionTarget" and c.get("status", "True") == "True"
                                        for c in rule["onPodConditions"])
            what = f"Pod {pod_name} has condition DisruptionTarget"
        if hit:
            assert rule["action"] == "FailJob", rule  # the only action the trainer's Jobs use
            return JOB_FAILED_REASON, f"{what} matching FailJob rule at index {index}"
    assert job_spec["backoffLimit"] == 0
    return "BackoffLimitExceeded", "Job has reached the specified backoff limit"


def jobset_action(failure_policy: dict[str, Any], reason: str, message: str) -> str:
    """The action the JobSet controller takes for a Job that failed with (reason, message)."""
    for rule in failure_policy.get("rules", []):
        reasons, patterns = rule.get("onJobFailureReasons") or [], rule.get("onJobFailureMessagePatterns") or []
        if (not reasons or reason in reasons) and (not patterns or any(re.search(p, message) for p in patterns)):
            return rule["action"]
    return "RestartJobSet"


def after_pod_failure(jobset: dict[str, Any], pod: PodEnd, job_name: str = "run-slice-0") -> dict[str, Any]:
    """The JobSet status after one trainer pod ended as `pod` (the status patch the controller writes)."""
    spec = jobset["spec"]
    status = jobset.get("status") or {}
    restarts, counted = int(status.get("restarts") or 0), int(status.get("restartsCountTowardsMax") or 0)
    reason, message = job_failure(spec["replicatedJobs"][0]["template"]["spec"], pod)
    action = jobset_action(spec["failurePolicy"], reason, message)
    if action == "FailJobSet":
        return failed_status("FailJobSetFailurePolicyAction", "jobset failed due to FailJobSet failure policy action", job_name)
    if action == "RestartJobSet":
        if counted >= spec["failurePolicy"]["maxRestarts"]:
            return failed_status("ReachedMaxRestarts", "jobset failed due to reaching max number of restarts", job_name)
        return {"restarts": restarts + 1, "restartsCountTowardsMax": counted + 1}
    assert action == "RestartJobSetAndIgnoreMaxRestarts", action
    return {"restarts": restarts + 1, "restartsCountTowardsMax": counted}


def failed_status(reason: str, message: str, job_name: str) -> dict[str, Any]:
    return {
        "conditions": [{"type": "Failed", "status": "True", "reason": reason,
                        "message": f"{message} (first failed job: {job_name})", "lastTransitionTime": "2026-12-04T08:00:00Z"}],
        "terminalState": "Failed",
    }
