"""The real kopf operator over HTTP against the KMock emulator: the lifecycle of both CRs."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import kmock
import pytest
from k8s_harness import ApiServerEmulator, Harness, Rejected, harness_settings


pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def lft(name: str, output: str | None = None, **spec: Any) -> dict[str, Any]:
    base = {
        "model": {"source": "gs://models-bucket/llama"},
        "dataset": {"train": "gs://data-bucket/train.jsonl"},
        # A local path nobody writes: the progress timer finds nothing and touches no cloud storage.
        "output": {"uri": output or f"/nonexistent/lora-runs/{name}"},
        "tpu": {"type": "v5p", "topology": "2x2x2", "slices": 2},
        "training": {"steps": 100},
    }
    base.update(spec)
    return {"apiVersion": "lora-operator.dev/v1alpha1", "kind": "LoraFinetune", "metadata": {"name": name}, "spec": base}


def adc(name: str, **spec: Any) -> dict[str, Any]:
    """An AdapterConversion from a PEFT adapter under gs://runs-bucket/<name>/ to Orbax beside it."""
    base = {
        "source": {"uri": f"gs://runs-bucket/{name}/hf-adapter", "format": "hf-peft"},
        "target": {"uri": f"gs://runs-bucket/{name}/orbax", "format": "orbax"},
        "model": {"source": "gs://models-bucket/llama"},
    }
    base.update(spec)
    return {"apiVersion": "lora-operator.dev/v1alpha1", "kind": "AdapterConversion", "metadata": {"name": name}, "spec": base}


@pytest.fixture
async def h():
    async with Harness() as harness:
        await harness.start_operator()
        yield harness
        assert harness.server_errors() == []


async def test_create_makes_jobset_and_configmap_once(h):
    await h.create(lft("run-a"))
    st = await h.wait_for_status("LoraFinetune", "run-a", lambda s: s.get("phase") == "Pending")
    assert st["status"]["jobSetName"] == "run-a"
    assert st["status"]["tpu"] == "v5p 2x2x2 x2"
    assert st["status"]["progress"] == "0/100"
    js = await h.wait_for(lambda: h.get("JobSet", "run-a"), what="JobSet")
    assert js["metadata"]["ownerReferences"][0]["uid"] == st["metadata"]["uid"]
    cm = await h.wait_for(lambda: h.get("ConfigMap", "run-a-config"), what="ConfigMap")
    assert json.loads(cm["data"]["config.json"])["training"]["steps"] == 100
    assert [o["metadata"]["name"] for o in await h.list("JobSet")] == ["run-a"]
    assert [o["metadata"]["name"] for o in await h.list("ConfigMap")] == ["run-a-config"]
    await h.wait_for(lambda: _has_event(h, "run-a", "Created"), what="Created event")
    # kopf's bookkeeping is in annotations, not in the (pruned) status; the operator's own durable
    # record (what it did to the children, lora_operator.reconcile) is part of the status schema.
    assert set(st["status"]) <= {"phase", "conditions", "observedGeneration", "jobSetName", "tpu", "totalSteps", "progress", "restarts",
                                 "record"}


def _phase(p: str):
    return lambda s: s.get("phase") == p


def _cond(status: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == ctype)


async def test_running_progress_and_restarts(h, tmp_path):
    out = tmp_path / "run-b"
    await h.create(lft("run-b", output=str(out)))
    await h.wait_for_status("LoraFinetune", "run-b", _phase("Pending"))
    await h.jobset_running("run-b")
    st = await h.wait_for_status("LoraFinetune", "run-b", _phase("Running"))
    assert _cond(st["status"], "Running")["status"] == "True"
    assert st["status"]["startTime"]
    out.mkdir(parents=True)
    (out / "progress.json").write_text(json.dumps({
        "step": 42, "totalSteps": 100, "loss": 1.23456, "learningRate": 1e-4, "tokensPerSecond": 5120.0,
        "stepTimeSeconds": 0.5, "etaSeconds": 29.0, "eta": "29s", "mfu": None,
        "lastCheckpoint": f"{out}/checkpoints/40", "time": "2026-12-03T08:00:00Z",
    }))
    st = await h.wait_for_status("LoraFinetune", "run-b", lambda s: s.get("step") == 42)
    assert st["status"]["progress"] == "42/100"
    assert st["status"]["loss"] == "1.235"
    assert st["status"]["tokensPerSecond"] == "5120"
    assert st["status"]["eta"] == "29s"
    assert st["status"]["lastCheckpoint"].endswith("/checkpoints/40")
    await h.jobset_running("run-b", restarts=1)
    st = await h.wait_for_status("LoraFinetune", "run-b", lambda s: s.get("restarts") == 1)
    assert st["status"]["phase"] == "Running"
    await h.wait_for(lambda: _has_event(h, "run-b", "Restarted"), what="Restarted event")


async def _has_event(h: Harness, name: str, reason: str) -> bool:
    return any(e["reason"] == reason for e in await h.events_for(name))


async def _deleted_child_comes_back(h: Harness, kind: str, name: str, owner: str, reason: str) -> None:
    """Delete a child by hand; the operator creates a new one (another uid) and posts `reason` on its owner."""
    old_uid = (await h.wait_for(lambda: h.get(kind, name), what=f"{kind} {name}"))["metadata"]["uid"]
    await h.delete(kind, name)
    await h.replaced(kind, name, old_uid)
    await h.wait_for(lambda: _has_event(h, owner, reason), what=f"{reason} event")


async def test_deleting_a_run_completes_despite_the_operators_finalizer(h):
    """kopf puts its finalizer on every LoraFinetune (its timers need one): deleting a pending or a
    running run must still end with the object gone, the operator removing its finalizer; an
    AdapterConversion goes too."""
    finalizer = "lora-operator.dev/finalizer"

    async def finalized(name: str) -> bool:
        cr = await h.get("LoraFinetune", name)
        return finalizer in ((cr or {}).get("metadata", {}).get("finalizers") or [])

    for name, running in (("run-dp", False), ("run-dr", True)):
        await h.create(lft(name))
        await h.wait_for(lambda: finalized(name), what=f"{name}'s finalizer")
        if running:
            await h.jobset_running(name)
            await h.wait_for_status("LoraFinetune", name, _phase("Running"))
        await h.delete("LoraFinetune", name)
        await h.gone("LoraFinetune", name)
    await h.create(adc("conv-d"))
    await h.wait_for_status("AdapterConversion", "conv-d", lambda s: bool(s.get("jobName")))
    await h.delete("AdapterConversion", "conv-d")
    await h.gone("AdapterConversion", "conv-d")


async def test_a_deleted_jobset_of_a_training_run_is_created_again(h):
    """Deleting a running run's JobSet by hand does not strand the run in a stale phase: the
    operator creates it again (training resumes from its checkpoint) and says so in an event; a
    finished run's JobSet stays deleted."""
    await h.create(lft("run-j"))
    await h.jobset_running("run-j")
    await h.wait_for_status("LoraFinetune", "run-j", _phase("Running"))
    await _deleted_child_comes_back(h, "JobSet", "run-j", "run-j", "JobSetRecreated")
    await h.jobset_condition("run-j", "Failed", "FailJobSetFailurePolicyAction", "a trainer pod exited 3")
    await h.wait_for_status("LoraFinetune", "run-j", _phase("Failed"))
    await h.delete("JobSet", "run-j")
    await h.gone("JobSet", "run-j")
    await asyncio.sleep(1)  # two resync intervals
    assert await h.get("JobSet", "run-j") is None


async def test_watch_namespaces_confine_the_operator():
    """With `watchNamespaces` (the chart then grants namespaced Roles only) a run elsewhere is left
    alone: no status, no JobSet; a run in a watched namespace is handled as usual."""
    async with Harness() as h:
        await h.start_operator(harness_settings(watch_namespaces=["team-a"]))
        outside, inside = lft("run-out"), lft("run-in")
        inside["metadata"]["namespace"] = "team-a"
        await h.create(outside)
        await h.create(inside)
        await h.wait_for_status("LoraFinetune", "run-in", _phase("Pending"), namespace="team-a")
        await h.wait_for(lambda: h.get("JobSet", "run-in", "team-a"), what="JobSet in team-a")
        await asyncio.sleep(1)  # the other run was created first; give a cluster-wide watch time to show
        assert "status" not in await h.get("LoraFinetune", "run-out")
        assert await h.list("JobSet") == [] and await h.list("ConfigMap") == []
        assert h.server_errors() == []


async def test_suspend_and_resume(h):
    await h.create(lft("run-c"))
    await h.wait_for_status("LoraFinetune", "run-c", _phase("Pending"))
    await h.jobset_running("run-c")
    await h.wait_for_status("LoraFinetune", "run-c", _phase("Running"))
    await h.patch_spec("LoraFinetune", "run-c", {"suspend": True})
    st = await h.wait_for_status("LoraFinetune", "run-c", _phase("Suspended"))
    assert _cond(st["status"], "Suspended")["status"] == "True"
    assert _cond(st["status"], "Running")["status"] == "False"
    assert (await h.get("JobSet", "run-c"))["spec"]["suspend"] is True
    await h.patch_spec("LoraFinetune", "run-c", {"suspend": False})
    await h.wait_for(lambda: _jobset_suspend_is(h, "run-c", False), what="JobSet resumed")
    st = await h.wait_for_status("LoraFinetune", "run-c", _phase("Running"))
    assert _cond(st["status"], "Suspended")["status"] == "False"
    assert [o["metadata"]["name"] for o in await h.list("JobSet")] == ["run-c"]
    # Everything else in the spec is immutable once created.
    with pytest.raises(Rejected, match="spec.lora cannot change"):
        await h.patch_spec("LoraFinetune", "run-c", {"lora": {"rank": 4}})


async def _jobset_suspend_is(h: Harness, name: str, value: bool) -> bool:
    js = await h.get("JobSet", name)
    return js is not None and js["spec"]["suspend"] is value


class _AdmissionWebhook(ApiServerEmulator):
    """A validating webhook (JobSet's, or a policy engine's on Jobs) refusing every create of one
    resource while `refusing`, as it refuses an object it finds invalid (HTTP 403)."""

    def __init__(self, plural: str, *, refusing: bool = True) -> None:
        super().__init__(strict=False)
        self.plural = plural
        self.refusing = refusing

    async def _handle(self, request: kmock.Request) -> Any:
        if (self.refusing and request.resource is not None and request.resource.plural == self.plural
                and request.action == kmock.action.CREATE):
            raise kmock.KubernetesError(
                status=403, reason="Forbidden",
                message=f'admission webhook "v{self.plural}.kb.io" denied the request: spec.template: Invalid value',
            )
        return await super()._handle(request)


async def _failed_by_webhook(h: Harness, kind: str, name: str, reason: str, plural: str) -> str:
    """The CR ends Failed with `reason`, its message quoting the webhook; returns the message."""
    failed = _cond((await h.wait_for_status(kind, name, _phase("Failed")))["status"], "Failed")
    assert failed["reason"] == reason
    assert f'admission webhook "v{plural}.kb.io" denied the request' in failed["message"]
    return failed["message"]


async def test_a_child_refused_at_admission_fails_the_run():
    """Retrying cannot change a webhook's or the schema's verdict: the run fails, saying why (it was
    Pending "created JobSet" for ever, the create retried without end)."""
    async with Harness(_AdmissionWebhook("jobsets")) as h:
        await h.start_operator()
        await h.create(lft("run-w"))
        await _failed_by_webhook(h, "LoraFinetune", "run-w", "InvalidSpec", "jobsets")
        await h.wait_for(lambda: _has_event(h, "run-w", "InvalidSpec"), what="InvalidSpec event")


async def test_every_child_refused_at_admission_fails_its_resource():
    """The same verdict for each child the operator creates later: a deleted JobSet created again,
    the export Jobs, the conversion Job, and a conversion Job created again (each was retried
    without end, or left the resource in a stale phase with the error only in the operator's log)."""
    webhook = _AdmissionWebhook("jobsets", refusing=False)
    async with Harness(webhook) as h:
        await h.start_operator()
        await h.create(lft("run-r"))
        await h.jobset_running("run-r")
        await h.wait_for_status("LoraFinetune", "run-r", _phase("Running"))
        webhook.refusing = True
        await h.delete("JobSet", "run-r")
        message = await _failed_by_webhook(h, "LoraFinetune", "run-r", "InvalidSpec", "jobsets")
        assert message.startswith("the JobSet was deleted and cannot be created again")

        webhook.refusing = False
        await h.create(lft("run-x", output="gs://runs-bucket/run-x"))
        await h.jobset_condition("run-x", "Completed", "AllJobsCompleted", "jobset completed successfully")
        await h.wait_for_status("LoraFinetune", "run-x", _phase("Exporting"))
        await h.wait_for(lambda: h.get("Job", "run-x-export"), what="export Job")  # written Exporting first, then created
        webhook.plural, webhook.refusing = "jobs", True
        await h.delete("Job", "run-x-export")
        message = await _failed_by_webhook(h, "LoraFinetune", "run-x", "ExportFailed", "jobs")
        assert message.startswith("an export Job was deleted and cannot be created again")

        webhook.refusing = False
        await h.create(adc("conv-r"))
        await h.wait_for(lambda: h.get("Job", "conv-r-convert"), what="conversion Job")
        webhook.refusing = True
        await h.delete("Job", "conv-r-convert")
        await _failed_by_webhook(h, "AdapterConversion", "conv-r", "InvalidSpec", "jobs")

        await h.create(adc("conv-w"))
        await _failed_by_webhook(h, "AdapterConversion", "conv-w", "InvalidSpec", "jobs")
        await h.create(lft("run-e", output="gs://runs-bucket/run-e"))
        await h.jobset_condition("run-e", "Completed", "AllJobsCompleted", "jobset completed successfully")
        message = await _failed_by_webhook(h, "LoraFinetune", "run-e", "ExportFailed", "jobs")
        assert message.startswith("cannot start the export") and "run-e-export" in message


async def test_completion_exports_then_succeeds(h):
    await h.create(lft("run-d", output="gs://runs-bucket/run-d"))
    await h.wait_for_status("LoraFinetune", "run-d", _phase("Pending"))
    await h.jobset_running("run-d")
    await h.jobset_condition("run-d", "Completed", "AllJobsCompleted", "jobset completed successfully")
    st = await h.wait_for_status("LoraFinetune", "run-d", _phase("Exporting"))
    assert _cond(st["status"], "Exporting")["reason"] in ("TrainingCompleted", "ExportPending")
    await h.patch_status("Job", "run-d-export", {"active": 1, "startTime": "2026-12-04T08:00:00Z"})
    st = await h.wait_for_status("LoraFinetune", "run-d", lambda s: _cond(s, "Exporting")["reason"] == "ExportRunning")
    assert st["status"]["phase"] == "Exporting" and _cond(st["status"], "Exporting")["status"] == "True"
    job = await h.get("Job", "run-d-export")
    assert job["spec"]["template"]["spec"]["containers"][0]["command"] == [
        "lora-trainer", "export", "--checkpoint", "gs://runs-bucket/run-d/checkpoints", "--out", "gs://runs-bucket/run-d/hf-adapter"
    ]
    assert job["metadata"]["ownerReferences"][0]["uid"] == st["metadata"]["uid"]
    await h.job_finished("run-d-export")
    st = await h.wait_for_status("LoraFinetune", "run-d", _phase("Succeeded"))
    assert st["status"]["adapterUri"] == "gs://runs-bucket/run-d/hf-adapter"
    assert st["status"]["completionTime"]
    assert _cond(st["status"], "Succeeded")["status"] == "True"
    await h.wait_for(lambda: _has_event(h, "run-d", "ExportSucceeded"), what="ExportSucceeded event")


async def test_an_export_job_deleted_while_exporting_is_created_again(h):
    await h.create(lft("run-x", output="gs://runs-bucket/run-x"))
    await h.jobset_running("run-x")
    await h.jobset_condition("run-x", "Completed", "AllJobsCompleted", "jobset completed successfully")
    await h.wait_for_status("LoraFinetune", "run-x", _phase("Exporting"))
    await _deleted_child_comes_back(h, "Job", "run-x-export", "run-x", "ExportRecreated")
    await h.job_finished("run-x-export")
    await h.wait_for_status("LoraFinetune", "run-x", _phase("Succeeded"))


async def test_merged_export_needs_both_jobs(h):
    spec = lft("run-m", output="gs://runs-bucket/run-m")
    spec["spec"]["output"]["export"] = {"hfPeft": True, "merged": True}
    await h.create(spec)
    await h.wait_for_status("LoraFinetune", "run-m", _phase("Pending"))
    await h.jobset_condition("run-m", "Completed", "AllJobsCompleted", "done")
    await h.wait_for_status("LoraFinetune", "run-m", _phase("Exporting"))
    await h.wait_for(lambda: h.get("Job", "run-m-export-merged"), what="merged export Job")
    await h.job_finished("run-m-export")
    await h.job_finished("run-m-export-merged")
    st = await h.wait_for_status("LoraFinetune", "run-m", _phase("Succeeded"))
    assert st["status"]["mergedUri"] == "gs://runs-bucket/run-m/merged"


async def test_jobset_failure_fails_the_run_with_a_reason(h):
    await h.create(lft("run-e"))
    await h.wait_for_status("LoraFinetune", "run-e", _phase("Pending"))
    await h.jobset_condition("run-e", "Failed", "FailJobSetFailurePolicyAction", "jobset failed due to PodFailurePolicy")
    st = await h.wait_for_status("LoraFinetune", "run-e", _phase("Failed"))
    failed = _cond(st["status"], "Failed")
    assert failed["status"] == "True" and failed["reason"] == "TrainingFailed"
    assert "PodFailurePolicy" in failed["message"] and "kubectl logs" in failed["message"]
    await h.wait_for(lambda: _has_event(h, "run-e", "TrainingFailed"), what="TrainingFailed event")
    assert await h.list("Job") == []


async def test_export_failure_fails_with_export_failed(h):
    await h.create(lft("run-f"))
    await h.wait_for_status("LoraFinetune", "run-f", _phase("Pending"))
    await h.jobset_condition("run-f", "Completed", "AllJobsCompleted", "done")
    await h.wait_for_status("LoraFinetune", "run-f", _phase("Exporting"))
    await h.job_finished("run-f-export", failed=True, message="Job has reached the specified backoff limit")
    st = await h.wait_for_status("LoraFinetune", "run-f", _phase("Failed"))
    failed = _cond(st["status"], "Failed")
    assert failed["reason"] == "ExportFailed"
    assert "backoff limit" in failed["message"] and "run-f-export" in failed["message"]
    assert "adapterUri" not in st["status"]


async def test_adapter_conversion(h):
    await h.create(adc("conv", model={"source": "gs://models-bucket/llama", "family": "llama3"}))
    st = await h.wait_for_status("AdapterConversion", "conv", _phase("Pending"))
    assert st["status"]["jobName"] == "conv-convert"
    job = await h.wait_for(lambda: h.get("Job", "conv-convert"), what="conversion Job")
    assert job["spec"]["template"]["spec"]["containers"][0]["command"][:6] == [
        "lora-trainer", "convert", "--from", "hf-peft", "--to", "orbax"
    ]
    await h.patch_status("Job", "conv-convert", {"active": 1, "startTime": "2026-12-03T08:00:00Z"})
    await h.wait_for_status("AdapterConversion", "conv", _phase("Running"))
    await h.job_finished("conv-convert")
    st = await h.wait_for_status("AdapterConversion", "conv", _phase("Succeeded"))
    assert st["status"]["outputUri"] == "gs://runs-bucket/conv/orbax"
    with pytest.raises(Rejected, match="spec.merged"):
        await h.create(adc("bad", merged=True))


async def test_a_conversion_job_deleted_before_it_finished_is_created_again(h):
    await h.create(adc("conv-r"))
    await _deleted_child_comes_back(h, "Job", "conv-r-convert", "conv-r", "ConversionRecreated")
    await h.job_finished("conv-r-convert")
    await h.wait_for_status("AdapterConversion", "conv-r", _phase("Succeeded"))


async def test_adapter_conversion_failure_fails_with_conversion_failed(h):
    await h.create(adc("conv-bad"))
    await h.wait_for(lambda: h.get("Job", "conv-bad-convert"), what="conversion Job")
    await h.job_finished("conv-bad-convert", failed=True, message="Job has reached the specified backoff limit")
    st = await h.wait_for_status("AdapterConversion", "conv-bad", _phase("Failed"))
    failed = _cond(st["status"], "Failed")
    assert failed["reason"] == "ConversionFailed"
    assert "backoff limit" in failed["message"]
    assert "outputUri" not in st["status"]


async def test_operator_restart_keeps_exactly_one_jobset(h):
    await h.create(lft("run-g"))
    await h.wait_for(lambda: h.get("JobSet", "run-g"), what="JobSet")
    await h.stop_operator()
    await h.start_operator()
    await h.jobset_running("run-g")
    await h.wait_for_status("LoraFinetune", "run-g", _phase("Running"))
    assert [o["metadata"]["name"] for o in await h.list("JobSet")] == ["run-g"]
    assert [o["metadata"]["name"] for o in await h.list("ConfigMap")] == ["run-g-config"]


async def test_a_restart_while_exporting_does_not_train_again(h):
    """A run whose training finished needs no JobSet any more: an operator restarted after the
    JobSet's TTL removed it finishes the export and creates no new JobSet (which would take a slice)."""
    await h.create(lft("run-e", output="gs://runs-bucket/run-e"))
    await h.jobset_running("run-e")
    await h.jobset_condition("run-e", "Completed", "AllJobsCompleted", "jobset completed successfully")
    await h.wait_for_status("LoraFinetune", "run-e", _phase("Exporting"))
    await h.stop_operator()
    await h.delete("JobSet", "run-e")
    await h.start_operator()
    await h.job_finished("run-e-export")
    await h.wait_for_status("LoraFinetune", "run-e", _phase("Succeeded"))
    assert await h.list("JobSet") == []


async def test_bad_crs_fail_with_the_field_and_others_keep_running(h, caplog):
    caplog.set_level(logging.DEBUG)  # every record of kopf and the operator, not only warnings
    secret_value = "hf_TOPSECRET_value_123"
    # Past the schema (the allowlist is the operator's setting, not the CRD's): refused by the operator.
    await h.create(lft("bad-image", image="docker.io/evil/miner:1"))
    st = await h.wait_for_status("LoraFinetune", "bad-image", _phase("Failed"))
    failed = _cond(st["status"], "Failed")
    assert failed["reason"] == "InvalidSpec" and "spec.image" in failed["message"]
    assert "ghcr.io/lora-operator/lora-trainer" in failed["message"]
    # A missing Secret: a False condition naming the field and the fix; no JobSet yet.
    await h.create(lft("no-secret", hfTokenSecretRef={"name": "hf-token"}))
    st = await h.wait_for_status("LoraFinetune", "no-secret", lambda s: any(
        c["type"] == "SecretsResolved" and c["status"] == "False" for c in s.get("conditions", [])))
    msg = _cond(st["status"], "SecretsResolved")["message"]
    assert "spec.hfTokenSecretRef" in msg and "kubectl -n default create secret generic hf-token" in msg
    assert await h.get("JobSet", "no-secret") is None
    # The operator keeps serving the others; a CR whose Secret exists runs, the token only by reference.
    await h.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-token"},
                    "stringData": {"token": secret_value}, "data": {"token": "aGZfVE9QU0VDUkVUX3ZhbHVlXzEyMw=="}})
    await h.create(lft("good", hfTokenSecretRef={"name": "hf-token"}))
    await h.wait_for_status("LoraFinetune", "good", _phase("Pending"))
    js = await h.wait_for(lambda: h.get("JobSet", "good"), what="JobSet")
    env = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}} in env
    everything = json.dumps([o for kind in ("LoraFinetune", "JobSet", "ConfigMap", "Event", "Job") for o in await h.list(kind)])
    assert secret_value not in everything and "aGZfVE9QU0VDUkVU" not in everything
    assert "Handler 'reconcile' succeeded" in caplog.text and secret_value not in caplog.text
    # A name Kubernetes accepts but JobSet cannot use for its Jobs and pods (DNS-1035).
    await h.create(lft("llama3.1-8b"))
    failed = _cond((await h.wait_for_status("LoraFinetune", "llama3.1-8b", _phase("Failed")))["status"], "Failed")
    assert failed["reason"] == "InvalidSpec" and "metadata.name" in failed["message"] and "'llama3-1-8b'" in failed["message"]
    assert await h.get("JobSet", "llama3.1-8b") is None
    # Rejected at admission (schema/CEL) with the field named.
    with pytest.raises(Rejected, match="spec.tpu.topology"):
        await h.create(lft("bad-topo", tpu={"type": "v5e", "topology": "2x2x2"}))


async def test_rbac_usage_is_recorded(tmp_path, monkeypatch):
    usage = tmp_path / "rbac.json"
    monkeypatch.setenv("LORA_RBAC_USAGE_FILE", str(usage))
    async with Harness() as h:
        await h.start_operator()
        await h.create(lft("run-r"))
        await h.wait_for_status("LoraFinetune", "run-r", _phase("Pending"))
        await h.jobset_condition("run-r", "Completed", "AllJobsCompleted", "done")
        await h.wait_for_status("LoraFinetune", "run-r", _phase("Exporting"))
        await h.stop_operator()
        used = h.requests
    for expected in [("create", "jobset.x-k8s.io/jobsets"), ("create", "/configmaps"), ("create", "batch/jobs"),
                     ("patch", "lora-operator.dev/lorafinetunes/status"), ("watch", "lora-operator.dev/lorafinetunes"),
                     ("list", "apiextensions.k8s.io/customresourcedefinitions"), ("create", "/events"),
                     ("get", "lora-operator.dev/lorafinetunes")]:
        assert expected in used, expected
    rows = json.loads(usage.read_text())
    assert {"verb": "create", "apiGroup": "jobset.x-k8s.io", "resource": "jobsets"} in rows
    assert not any(r["resource"] == "secrets" and r["verb"] != "get" for r in rows)


async def test_missed_jobset_event_is_caught_by_the_resync_timer(h):
    """kopf does not retry event handlers; the resync timer re-reads the JobSet of in-flight runs."""
    await h.create(lft("run-s"))
    await h.wait_for_status("LoraFinetune", "run-s", _phase("Pending"))
    await h.wait_for(lambda: h.get("JobSet", "run-s"), what="JobSet")
    # Change the stored JobSet without a watch event, as if the operator had missed it.
    h.emulator.objects["jobset.x-k8s.io/v1alpha2/jobsets", "default", "run-s"].patch(
        {"status": {"restarts": 0, "replicatedJobsStatus": [{"name": "slice", "active": 2, "ready": 2}]}}
    )
    await h.wait_for_status("LoraFinetune", "run-s", _phase("Running"))
