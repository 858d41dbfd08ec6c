"""Preemption that does not end the run, with the real operator over HTTP against KMock: the Job
and JobSet controllers are emulated from the failure policies the operator rendered into the JobSet
(tests/jobset_controller.py), so each way a trainer pod ends moves the JobSet's `restarts` and
`restartsCountTowardsMax` as the controllers would, and the CR shows `restarts` and `preemptions`."""

from __future__ import annotations

import json
from typing import Any

import pytest
from jobset_controller import PodEnd
from k8s_harness import Harness, harness_settings
from test_operator_e2e import _cond, _phase, h, lft  # noqa: F401  (h: the operator fixture)

from lora_trainer import exit_codes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


async def _events(h: Harness, name: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in await h.events_for(name) if e["reason"] == reason]


async def _running(h: Harness, name: str, restarts: int = 0, counted: int = 0) -> None:
    await h.jobset_running(name, restarts=restarts, counted=counted)
    await h.wait_for_status("LoraFinetune", name, _phase("Running"))


async def test_each_way_a_trainer_pod_ends(h):
    """Preempted (DisruptionTarget, any exit code) or saved on SIGTERM (43): a restart that does not
    count; killed without a disruption (137) or a retriable fault (42): a counted restart; a user
    error (3): the run fails at once."""
    await h.create(lft("run-p"))
    await _running(h, "run-p")
    await h.pod_ended("run-p", PodEnd(137, disrupted=True))
    st = await h.wait_for_status("LoraFinetune", "run-p", lambda s: s.get("preemptions") == 1)
    assert st["status"]["restarts"] == 0 and st["status"]["phase"] == "Pending"
    await h.wait_for(lambda: _events(h, "run-p", "Preempted"), what="Preempted event")
    await _running(h, "run-p", restarts=1)
    await h.pod_ended("run-p", PodEnd(exit_codes.PREEMPTED))
    await h.wait_for_status("LoraFinetune", "run-p", lambda s: s.get("preemptions") == 2 and s.get("restarts") == 0)
    await _running(h, "run-p", restarts=2)
    await h.pod_ended("run-p", PodEnd(137))
    st = await h.wait_for_status("LoraFinetune", "run-p", lambda s: s.get("restarts") == 1)
    assert st["status"]["preemptions"] == 2
    await h.wait_for(lambda: _events(h, "run-p", "Restarted"), what="Restarted event")
    await _running(h, "run-p", restarts=3, counted=1)
    await h.pod_ended("run-p", PodEnd(exit_codes.RETRIABLE))
    await h.wait_for_status("LoraFinetune", "run-p", lambda s: s.get("restarts") == 2)
    assert len(await _events(h, "run-p", "Preempted")) == 2
    await _running(h, "run-p", restarts=4, counted=2)
    await h.pod_ended("run-p", PodEnd(exit_codes.USER_ERROR))
    st = await h.wait_for_status("LoraFinetune", "run-p", _phase("Failed"))
    failed = _cond(st["status"], "Failed")
    assert failed["reason"] == "TrainingFailed" and "FailJobSetFailurePolicyAction" in failed["message"]
    assert st["status"]["restarts"] == 2 and st["status"]["preemptions"] == 2


async def test_counted_restarts_still_end_the_run_and_say_so(h):
    await h.create(lft("run-c", maxRestarts=1))
    await _running(h, "run-c")
    await h.pod_ended("run-c", PodEnd(137, disrupted=True))
    await _running(h, "run-c", restarts=1)
    await h.pod_ended("run-c", PodEnd(exit_codes.RETRIABLE))
    await _running(h, "run-c", restarts=2, counted=1)
    patch = await h.pod_ended("run-c", PodEnd(exit_codes.RETRIABLE))
    assert patch["conditions"][0]["reason"] == "ReachedMaxRestarts"
    st = await h.wait_for_status("LoraFinetune", "run-c", _phase("Failed"))
    message = _cond(st["status"], "Failed")["message"]
    assert "restarted 1 times after retriable faults" in message and "the 1 preemptions did not count" in message


async def test_a_72_hour_spot_run_survives_20_preemptions(tmp_path):
    """72 hours of spot capacity compressed: the trainer reports progress, 20 preemptions (pods
    marked DisruptionTarget, half of them after the trainer saved on SIGTERM) each restart the JobSet,
    and the run still finishes: restarts never move, the adapter is exported."""
    out = tmp_path / "spot"
    out.mkdir()
    async with Harness() as h:
        await h.start_operator(harness_settings())
        await h.create(lft("spot-72h", output=str(out), tpu={"type": "v5p", "topology": "2x2x2", "slices": 2,
                                                              "capacity": {"type": "spot"}},
                           training={"steps": 7200}))
        js = await h.wait_for(lambda: h.get("JobSet", "spot-72h"), what="JobSet")
        assert js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["nodeSelector"]["cloud.google.com/gke-spot"] == "true"
        for n in range(20):  # one preemption every ~3.4 hours of training
            await _running(h, "spot-72h", restarts=n)
            step = (n + 1) * 340
            (out / "progress.json").write_text(json.dumps({"step": step, "totalSteps": 7200, "loss": 2.0 - n * 0.05,
                                                           "tokensPerSecond": 51200.0, "mfu": 0.45}))
            await h.wait_for_status("LoraFinetune", "spot-72h", lambda s, step=step: s.get("step") == step)
            pod = PodEnd(exit_codes.PREEMPTED if n % 2 else 143, disrupted=True)
            assert await h.pod_ended("spot-72h", pod) == {
                "restarts": n + 1, "restartsCountTowardsMax": 0,
                "replicatedJobsStatus": [{"name": "slice", "active": 0, "ready": 0, "succeeded": 0, "failed": 0, "suspended": 0}],
            }
            await h.wait_for_status("LoraFinetune", "spot-72h", lambda s, n=n: s.get("preemptions") == n + 1)
        await _running(h, "spot-72h", restarts=20)
        (out / "progress.json").write_text(json.dumps({"step": 7200, "totalSteps": 7200, "loss": 0.9}))
        await h.jobset_condition("spot-72h", "Completed", "AllJobsCompleted", "jobset completed successfully")
        await h.wait_for_status("LoraFinetune", "spot-72h", _phase("Exporting"))
        await h.job_finished("spot-72h-export")
        st = await h.wait_for_status("LoraFinetune", "spot-72h", _phase("Succeeded"))
        status = st["status"]
        assert status["restarts"] == 0 and status["preemptions"] == 20
        assert status["adapterUri"] == f"{out}/hf-adapter" and status["progress"] == "7200/7200"
        await h.wait_for(lambda: _has_n_events(h, "spot-72h", "Preempted", 20), what="20 Preempted events")
        assert await _events(h, "spot-72h", "Restarted") == []
        assert [o["metadata"]["name"] for o in await h.list("JobSet")] == ["spot-72h"]
        assert h.server_errors() == []


async def _has_n_events(h: Harness, name: str, reason: str, n: int) -> bool:
    return len(await _events(h, name, reason)) == n
