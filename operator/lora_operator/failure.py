"""What ends a trainer pod, and what the Job and JobSet controllers then do: one table. Pure.

Each rule is a Job `podFailurePolicy` rule (action `FailJob`) paired with the JobSet
`failurePolicy` rule that acts on the Job failure it causes. The Job controller fails the Job
with reason `PodFailurePolicy` and the message "... matching FailJob rule at index N"
(kubernetes pkg/controller/job/pod_failure_policy.go); JobSet v0.12 matches that reason and,
with `onJobFailureMessagePatterns`, the rule's index (jobset KEP 262, "distinguish retriable
from non-retriable Pod failure policies"). A failure no rule matches fails the Job with
`BackoffLimitExceeded` (backoffLimit 0) and JobSet's default action, `RestartJobSet`, restarts
the run and counts it toward `maxRestarts`.

Preemption costs nothing: a pod with the `DisruptionTarget` condition (preempted, evicted by a
drain or node maintenance, its node shut down) or a trainer that saved on SIGTERM and exited
PREEMPTED restarts the JobSet with `RestartJobSetAndIgnoreMaxRestarts`, so a long spot run
survives any number of preemptions. User errors fail at once; other faults count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lora_trainer import exit_codes

TRAINER_CONTAINER = "trainer"
#: The Job failure reason the Job controller sets when a podFailurePolicy rule failed the Job.
POD_FAILURE_POLICY_REASON = "PodFailurePolicy"
#: The pod condition Kubernetes adds to a pod it is about to end for a disruption.
DISRUPTION_TARGET = "DisruptionTarget"
RESTART_UNCOUNTED = "RestartJobSetAndIgnoreMaxRestarts"
FAIL = "FailJobSet"


@dataclass(frozen=True, slots=True)
class FailureRule:
    """A pod failure the trainer's Job fails on, and the JobSet's answer to it."""

    name: str
    """The JobSet rule's name (also what its rows in docs/reference/exit-codes.md say)."""
    pod_rule: dict[str, Any]
    """The Job podFailurePolicy rule (always `FailJob`, so the JobSet decides)."""
    action: str
    """The JobSet failurePolicy action."""


def _exit_codes(operator: str, values: list[int]) -> dict[str, Any]:
    return {"action": "FailJob", "onExitCodes": {"containerName": TRAINER_CONTAINER, "operator": operator, "values": values}}


#: In order: the Job controller and JobSet both take the first rule that matches.
RULES: tuple[FailureRule, ...] = (
    FailureRule("RestartAfterDisruption", {"action": "FailJob", "onPodConditions": [{"type": DISRUPTION_TARGET, "status": "True"}]},
                RESTART_UNCOUNTED),
    FailureRule("RestartAfterPreemptionSave", _exit_codes("In", [exit_codes.PREEMPTED]), RESTART_UNCOUNTED),
    FailureRule("FailOnUserError", _exit_codes("NotIn", exit_codes.retriable_exit_codes()), FAIL),
)


def pod_failure_policy() -> dict[str, Any]:
    """The trainer Job's podFailurePolicy."""
    return {"rules": [rule.pod_rule for rule in RULES]}


def jobset_failure_policy(max_restarts: int) -> dict[str, Any]:
    """The JobSet's failurePolicy: each rule catches the Job failure its pod rule causes, by index."""
    return {
        "maxRestarts": max_restarts,
        # Every old pod is gone before new ones start: two generations never write one checkpoint directory.
        "restartStrategy": "BlockingRecreate",
        "rules": [
            {
                "name": rule.name,
                "action": rule.action,
                "onJobFailureReasons": [POD_FAILURE_POLICY_REASON],
                "onJobFailureMessagePatterns": [f"matching FailJob rule at index {index}$"],
            }
            for index, rule in enumerate(RULES)
        ],
    }


def exit_code_rule(code: int) -> FailureRule | None:
    """The first rule an exit `code` of the trainer matches (a pod without DisruptionTarget), or None."""
    for rule in RULES:
        requirement = rule.pod_rule.get("onExitCodes")
        if requirement is not None and (code in requirement["values"]) == (requirement["operator"] == "In"):
            return rule
    return None
