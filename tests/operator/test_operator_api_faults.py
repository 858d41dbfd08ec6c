"""The real operator behind an API server that fails: 429s, 500s before and after serving a write,
409s on its conditional writes, watches answered 410 Gone or dropped (tests/k8s_faults.py).

Six runs and a conversion go through their whole life (one created suspended and resumed, one
suspended and resumed, one whose JobSet is deleted by hand, two whose finished JobSets their TTL
deletes at once) with a resync far beyond the test's length, so only the watches and the
handlers' own retries drive them. They must end exactly as without faults: no duplicate child
(one JobSet per run, two for the one deleted by hand), the hand-deleted JobSet back through its
watch (not a timer), one `Created` per run, one `JobSetRecreated` for the deleted JobSet and no
other `...Recreated`, no `WaitingForAdmission` (no Kueue here). Budget: about 20 s.
"""

from __future__ import annotations

import asyncio
import collections
import random

import kmock
import pytest
from k8s_faults import FaultProxy
from k8s_harness import Harness, harness_settings
from test_operator_e2e import _cond, _phase, adc, lft

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

RUNS = [f"fault-{i}" for i in range(6)]
#: Seconds each wait allows. Faults can stack on one object: kopf retries a failed reconcile after
#: 5 s and throttles an object after an error in its own API calls (1, 1, 2, 3, 5, 8 s ...); under
#: a loaded CI machine one wait overran 30 s. Still half the 120 s resync, so only the watches and
#: retries can drive the runs.
WAIT = 60


async def test_api_faults_change_no_end_state_child_or_event():
    async with Harness(expected_errors=(r"fault injected by the test proxy",)) as h, FaultProxy(h.url, random.Random(409)) as proxy:
        await h.start_operator(harness_settings(progress_poll_seconds=120), url=proxy.url)
        for i, name in enumerate(RUNS):
            await h.create(lft(name, output=f"gs://runs-bucket/{name}", suspend=i == 0))
        await h.create(adc("fault-conv"))
        for name in RUNS:
            await h.wait_for(lambda name=name: h.get("JobSet", name), timeout=WAIT, what=f"JobSet {name}")
        for name in RUNS[1:]:
            await h.jobset_running(name)
            await h.wait_for_status("LoraFinetune", name, _phase("Running"), timeout=WAIT)
        await h.wait_for_status("LoraFinetune", RUNS[0], _phase("Suspended"), timeout=WAIT)

        await h.patch_spec("LoraFinetune", RUNS[1], {"suspend": True})
        await h.wait_for(lambda: _suspended(h, RUNS[1], True), timeout=WAIT, what="the JobSet suspended")
        await h.wait_for_status("LoraFinetune", RUNS[1], _phase("Suspended"), timeout=WAIT)
        for name in RUNS[:2]:
            await h.patch_spec("LoraFinetune", name, {"suspend": False})
            await h.wait_for(lambda name=name: _suspended(h, name, False), timeout=WAIT, what=f"JobSet {name} resumed")
            await h.jobset_running(name)
            await h.wait_for_status("LoraFinetune", name, _phase("Running"), timeout=WAIT)

        old = (await h.get("JobSet", RUNS[2]))["metadata"]["uid"]
        await h.delete("JobSet", RUNS[2])
        await h.replaced("JobSet", RUNS[2], old)  # within 30 s, the resync being 120 s away: through the watch
        await h.jobset_running(RUNS[2])

        for name in RUNS:
            await h.jobset_condition(name, "Completed", "AllJobsCompleted", "jobset completed successfully")
        for name in RUNS[3:5]:  # their TTL deletes them at once; the tracking finalizer holds them
            await h.delete("JobSet", name)
        for name in [f"{n}-export" for n in RUNS] + ["fault-conv-convert"]:
            await h.wait_for(lambda name=name: h.get("Job", name), timeout=WAIT, what=f"Job {name}")
            await h.job_finished(name)
        for name in RUNS:
            status = (await h.wait_for_status("LoraFinetune", name, _phase("Succeeded"), timeout=WAIT))["status"]
            assert status["adapterUri"] == f"gs://runs-bucket/{name}/hf-adapter"
            assert _cond(status, "Succeeded")["reason"] == "ExportSucceeded"
        await h.wait_for_status("AdapterConversion", "fault-conv", _phase("Succeeded"), timeout=WAIT)
        for name in RUNS[3:5]:  # let go once the run said what it did
            await h.gone("JobSet", name, timeout=WAIT)
        await h.stop_operator()
        proxy.enabled = False

        print(f"faults injected: {dict(proxy.counts)}")
        assert set(proxy.counts) == {"429", "500", "lost", "409", "410", "drop"}, proxy.counts
        created = h.emulator.created
        for name in RUNS:
            assert len(created["jobsets", name]) == (2 if name == RUNS[2] else 1), (name, created["jobsets", name])
            assert len(created["jobs", f"{name}-export"]) == 1 and len(created["configmaps", f"{name}-config"]) == 1
            reasons = collections.Counter(e["reason"] for e in await h.events_for(name))
            assert reasons["Created"] == 1 and reasons["JobSetRecreated"] == (1 if name == RUNS[2] else 0), (name, reasons)
            assert reasons["ExportStarted"] == 1 and reasons["ExportSucceeded"] == 1, (name, reasons)
            assert not {"ExportRecreated", "WaitingForAdmission", "SettingsChanged"} & set(reasons), (name, reasons)
        assert len(created["jobs", "fault-conv-convert"]) == 1
        conversion = collections.Counter(e["reason"] for e in await h.events_for("fault-conv"))
        assert conversion["Created"] == 1 and conversion["ConversionSucceeded"] == 1 and not conversion["ConversionRecreated"]


async def _suspended(h: Harness, name: str, value: bool) -> bool:
    js = await h.get("JobSet", name)
    return js is not None and js["spec"]["suspend"] is value


async def test_the_emulator_s_watch_misses_no_write_made_while_it_lists():
    """A watch (re)opened while objects change streams every change, as a real API server's does:
    the test above reconnects its dropped watches at any moment. KMock subscribed to changes only
    after streaming its listing, so a write made while a client was still reading the listing was in
    neither, and only a resync would have shown it (`ApiServerEmulator._serve_watch`). The watch is
    driven here one event at a time: the write lands after the listing's first object."""
    async with Harness() as h:
        for i in range(3):
            await h.create(lft(f"w-{i}"))
        request = kmock.Request(action=kmock.action.WATCH, resource=kmock.resource("lora-operator.dev", "v1alpha1", "lorafinetunes"),
                                namespace="default")
        watch = h.emulator._serve_watch(request)
        try:
            assert await anext(watch) == b""
            events = [await anext(watch)]
            await h.patch_spec("LoraFinetune", "w-2", {"suspend": True})
            events += [await asyncio.wait_for(anext(watch), 10) for _ in range(3)]
        finally:
            await watch.aclose()
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "w-0"), ("ADDED", "w-1"), ("ADDED", "w-2"), ("MODIFIED", "w-2")]
    assert events[2]["object"]["spec"]["suspend"] is False and events[3]["object"]["spec"]["suspend"] is True
