"""The real kopf operator against KMock when things happen out of the happy order: a lost status
write, settings changed under a running run, a restart that also changes the phase, a suspend after
training, the last progress record, the JobSet controller's lagging conditions."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import kmock
import pytest
from k8s_harness import ApiServerEmulator, Harness, _now, harness_settings
from test_operator_e2e import _cond, _has_event, _phase, adc, lft

from lora_operator.api import AdapterConversionStatus
from lora_operator.controller import write_status
from lora_operator.kube import RETRY_WAITS
from lora_operator import status as st
from lora_trainer.progress_record import now_rfc3339

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


class _StatusHiccup(ApiServerEmulator):
    """500s (etcd timing out) on the operator's next status writes to `plural`: more in a row than
    its client retries (lora_operator.kube.RETRY_WAITS), so the write is lost to the handler."""

    plural: str | None = None
    failures = 0

    async def _handle(self, request: kmock.Request) -> Any:
        if (self.plural and request.resource is not None and request.resource.plural == self.plural
                and request.subresource == "status" and request.action == kmock.action.UPDATE
                and not request.headers.get("User-Agent", "").startswith("lora-harness")):
            self.failures += 1
            if self.failures > len(RETRY_WAITS):
                self.plural = None
            raise kmock.KubernetesError(status=500, reason="InternalError", message="etcdserver: request timed out")
        return await super()._handle(request)


async def test_a_lost_status_write_does_not_strand_a_conversion():
    """kopf does not retry event handlers: the conversion's resync timer reads the Job again (it
    stayed Running until the Job's TTL deleted it, and then converted a second time)."""
    emulator = _StatusHiccup(strict=False)
    async with Harness(emulator, expected_errors=(r"etcdserver: request timed out",)) as h:
        await h.start_operator()
        await h.create(adc("conv-h"))
        await h.wait_for_status("AdapterConversion", "conv-h", _phase("Pending"))
        await h.patch_status("Job", "conv-h-convert", {"active": 1, "startTime": "2026-12-04T08:00:00Z"})
        await h.wait_for_status("AdapterConversion", "conv-h", _phase("Running"))
        emulator.plural = "adapterconversions"
        await h.job_finished("conv-h-convert")
        await h.wait_for(lambda: asyncio.sleep(0, result=emulator.plural is None), what="the lost write")
        st = await h.wait_for_status("AdapterConversion", "conv-h", _phase("Succeeded"))
        assert st["status"]["outputUri"] == "gs://runs-bucket/conv-h/orbax"
        assert any("etcdserver" in m for m in h.handler_exceptions())  # the write was lost in a handler, as meant


async def test_a_status_write_for_a_resource_deleted_since_is_dropped():
    """A resync timer or child event holds a snapshot of its resource; deleted since (the finalizer
    gone), the status write's 404 means nothing is left to report on: no exception for kopf to log
    and retry, no event."""
    async with Harness() as h:
        await h.create(adc("conv-gone"))
        snapshot = await h.get("AdapterConversion", "conv-gone")
        await h.delete("AdapterConversion", "conv-gone")
        await h.gone("AdapterConversion", "conv-gone")
        patch = st.status_patch({}, st.Observation("Running", "JobRunning", "the Job is running"), 1, now_rfc3339())
        status = AdapterConversionStatus.model_validate(patch)
        assert await asyncio.to_thread(write_status, h.kube(), snapshot, status) is None
        assert await h.events_for("conv-gone") == []


async def test_settings_narrowed_under_an_admitted_run_leave_it_training():
    """The operator restarted with a narrower image allowlist: a run it admitted before keeps its
    JobSet and phase (it was marked Failed while its JobSet trained on), with a SettingsChanged
    event; its export, a new pod with that image, is refused with the field named."""
    image = "us-docker.pkg.dev/team/lora-trainer:custom"
    async with Harness() as h:
        await h.start_operator(harness_settings(allowed_images=["ghcr.io/lora-operator/lora-trainer", "us-docker.pkg.dev/team/"]))
        await h.create(lft("run-s", output="gs://runs-bucket/run-s", image=image))
        await h.jobset_running("run-s")
        await h.wait_for_status("LoraFinetune", "run-s", _phase("Running"))
        await h.stop_operator()
        await h.start_operator()
        await h.wait_for(lambda: _has_event(h, "run-s", "SettingsChanged"), what="SettingsChanged event")
        await asyncio.sleep(1)  # two resync intervals
        assert (await h.get("LoraFinetune", "run-s"))["status"]["phase"] == "Running"
        assert (await h.get("JobSet", "run-s"))["spec"]["suspend"] is False
        await h.jobset_condition("run-s", "Completed", "AllJobsCompleted", "jobset completed successfully")
        failed = _cond((await h.wait_for_status("LoraFinetune", "run-s", _phase("Failed")))["status"], "Failed")
        assert failed["reason"] == "ExportFailed" and "spec.image" in failed["message"]


async def test_a_restart_that_also_changes_the_phase_posts_restarted():
    """With one slice the restarted JobSet has no active Job for a moment, so the restart arrives
    with Running -> Pending: the Restarted event was dropped behind the phase's event."""
    async with Harness() as h:
        await h.start_operator()
        await h.create(lft("run-1", tpu={"type": "v5p", "topology": "2x2x2", "slices": 1}))
        await h.jobset_running("run-1")
        await h.wait_for_status("LoraFinetune", "run-1", _phase("Running"))
        await h.patch_status("JobSet", "run-1", {"restarts": 1, "restartsCountTowardsMax": 1, "replicatedJobsStatus": [
            {"name": "slice", "active": 0, "ready": 0, "succeeded": 0, "failed": 1, "suspended": 0}]})
        st = await h.wait_for_status("LoraFinetune", "run-1", lambda s: s.get("restarts") == 1)
        assert st["status"]["phase"] == "Pending"
        await h.wait_for(lambda: _has_event(h, "run-1", "Restarted"), what="Restarted event")


async def test_children_deleted_while_the_operator_was_away_come_back_with_an_event():
    """A JobSet or conversion Job deleted while the operator was down is created again when it
    resumes the resource, with the same event as a deletion it watched (it came back silently)."""
    async with Harness() as h:
        await h.start_operator()
        await h.create(lft("run-r"))
        await h.jobset_running("run-r")
        await h.wait_for_status("LoraFinetune", "run-r", _phase("Running"))
        await h.create(adc("conv-r"))
        await h.patch_status("Job", "conv-r-convert", {"active": 1, "startTime": "2026-12-04T08:00:00Z"})
        await h.wait_for_status("AdapterConversion", "conv-r", _phase("Running"))
        await h.stop_operator()
        uids = {}
        for kind, name in (("JobSet", "run-r"), ("Job", "conv-r-convert")):
            uids[kind] = (await h.get(kind, name))["metadata"]["uid"]
            await h.delete(kind, name)  # held by the operator's tracking finalizer until it returns
        await h.start_operator()
        await h.replaced("JobSet", "run-r", uids["JobSet"])
        await h.replaced("Job", "conv-r-convert", uids["Job"])
        await h.wait_for(lambda: _has_event(h, "run-r", "JobSetRecreated"), what="JobSetRecreated event")
        await h.wait_for(lambda: _has_event(h, "conv-r", "ConversionRecreated"), what="ConversionRecreated event")
        # Resuming children that are still there is silent, and "Created" is posted once per resource.
        await h.stop_operator()
        await h.start_operator()
        await h.jobset_running("run-r")
        await h.wait_for_status("LoraFinetune", "run-r", _phase("Running"))
        for name, reasons in (("run-r", ["Created", "JobSetRecreated"]), ("conv-r", ["Created", "ConversionRecreated"])):
            posted = sorted(e["reason"] for e in await h.events_for(name) if e["reason"] in reasons)
            assert posted == sorted(reasons), (name, posted)


async def test_suspend_after_training_is_ignored():
    """Exporting: the JobSet has finished, so suspending it means nothing; it was patched anyway
    with a Suspended event, or, with the JobSet gone by its TTL, retried every 5 s."""
    async with Harness() as h:
        await h.start_operator()
        for name, jobset_gone in (("run-e1", False), ("run-e2", True)):
            await h.create(lft(name, output=f"gs://runs-bucket/{name}"))
            await h.jobset_condition(name, "Completed", "AllJobsCompleted", "jobset completed successfully")
            await h.wait_for_status("LoraFinetune", name, _phase("Exporting"))
            if jobset_gone:
                await h.delete("JobSet", name)
                await h.gone("JobSet", name)
            await h.patch_spec("LoraFinetune", name, {"suspend": True})
            await h.wait_for(lambda n=name: _has_event(h, n, "SuspendIgnored"), what="SuspendIgnored event")
            assert not await _has_event(h, name, "Suspended")
            if not jobset_gone:
                assert not (await h.get("JobSet", name))["spec"]["suspend"]
            await h.job_finished(f"{name}-export")
            await h.wait_for_status("LoraFinetune", name, _phase("Succeeded"))


async def test_the_last_progress_record_reaches_the_status(tmp_path: Path):
    """The trainer writes its final record and exits before the next poll: the status read the
    record once more when training ended (it kept the previous poll's step, e.g. 50/100)."""
    out = tmp_path / "run-p"
    out.mkdir()

    def progress(step: int) -> None:
        (out / "progress.json").write_text(json.dumps({
            "step": step, "totalSteps": 100, "loss": 1.0 / step, "tokensPerSecond": 5000.0, "eta": "0s",
            "lastCheckpoint": f"{out}/checkpoints/{step}", "time": "2026-12-04T08:00:00Z",
        }))

    progress(50)
    async with Harness() as h:
        await h.start_operator(harness_settings(progress_poll_seconds=60))  # one poll, as the run starts
        await h.create(lft("run-p", output=str(out)))
        await h.jobset_running("run-p")
        await h.wait_for_status("LoraFinetune", "run-p", lambda s: s.get("step") == 50)
        progress(100)
        await h.jobset_condition("run-p", "Completed", "AllJobsCompleted", "jobset completed successfully")
        st = (await h.wait_for_status("LoraFinetune", "run-p", _phase("Exporting")))["status"]
        assert st["progress"] == "100/100" and st["lastCheckpoint"].endswith("/checkpoints/100")


async def test_a_resumed_run_is_not_reported_as_queued_by_kueue():
    """The JobSet controller's Suspended condition stays True for a moment after a resume: read as
    suspension, every resumed run without a queue showed Kueue's WaitingForAdmission."""
    async with Harness() as h:
        await h.start_operator()
        await h.create(lft("run-k"))
        await h.jobset_running("run-k")
        await h.wait_for_status("LoraFinetune", "run-k", _phase("Running"))
        await h.patch_spec("LoraFinetune", "run-k", {"suspend": True})
        await h.wait_for_status("LoraFinetune", "run-k", _phase("Suspended"))
        await h.patch_status("JobSet", "run-k", {
            "conditions": [{"type": "Suspended", "status": "True", "reason": "SuspendedJobs", "message": "jobset is suspended",
                            "lastTransitionTime": _now()}],
            "replicatedJobsStatus": [{"name": "slice", "active": 0, "ready": 0, "succeeded": 0, "failed": 0, "suspended": 2}],
        })
        await h.patch_spec("LoraFinetune", "run-k", {"suspend": False})
        await h.wait_for_status("LoraFinetune", "run-k", _phase("Pending"))
        await asyncio.sleep(1)  # the JobSet's events and two resyncs
        st = (await h.get("LoraFinetune", "run-k"))["status"]
        assert _cond(st, "Running")["reason"] in ("Resumed", "WaitingForPods"), _cond(st, "Running")
        assert not await _has_event(h, "run-k", "WaitingForAdmission")
