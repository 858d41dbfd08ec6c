"""SIGKILL of the real `lora-operator run` process at random points of many runs' lives.

Twenty-four LoraFinetunes go through creation (some suspended), suspension and resumption,
completion (the JobSet's TTL deletes it 0.3-3 s later), export (the Job's TTL too) and, for some
of them, deletion, on a schedule of their own, while the operator process is SIGKILLed right after
a random number of its writes (or after a random time) and started again, over and over; the
users and the JobSet, Job, TTL and garbage-collection controllers (emulated here the way the real
ones act) go on while it is down. A kill point is a run caught mid-life by a kill; each is
described by the run's stage, its phase and the operator's last two requests about it.

What must hold (issue 22): no run gets a second JobSet or export Job (nothing is deleted by hand
here, so any second one is a duplicate or a resurrection), none is stranded (each reaches its end
state once the operator stays up), and every one ends as it would without faults: Succeeded with
its adapter, one `Created` event and no `...Recreated`,
`WaitingForAdmission` or repeated event; deleted ones gone with every child.
Budget: about 60 s on 2 cores.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kmock
import pytest
from k8s_harness import HARNESS_AGENT, ApiServerEmulator, Harness, _now

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RUNS = 24
#: The chaos phase ends after this many operator lives, or when every run is at its end state.
MAX_LIVES, MIN_LIVES = 60, 10
TTL = (0.3, 3.0)
SETTINGS = {"progressPollSeconds": 0.5, "allowedLocalPaths": ["/nonexistent"], "jobTtlSecondsAfterFinished": 1}


class RecordingEmulator(ApiServerEmulator):
    """Remembers, per run, the operator's last two requests about it (the run, its children or its
    events), and counts the operator's writes for the killer."""

    def __init__(self) -> None:
        super().__init__(strict=False)
        self.last: dict[str, tuple[str, str]] = {}
        self.writes = 0
        self.kill_after: int | None = None
        self.write_reached = asyncio.Event()

    async def _handle(self, request: kmock.Request) -> Any:
        response = await super()._handle(request)
        if request.resource is None or request.headers.get("User-Agent", "").startswith(HARNESS_AGENT):
            return response
        data = request.data if isinstance(request.data, dict) else {}
        plural = request.resource.plural
        name = request.name or (data.get("metadata") or {}).get("name") or ""
        run = (data.get("involvedObject") or {}).get("name", "") if plural == "events" else _run_of(name)
        if run:  # the operator's last two requests about the run: where it was in its work on it
            this = f"{getattr(request.method, 'value', request.method)} {plural}{'/' + request.subresource if request.subresource else ''}"
            self.last[run] = (self.last.get(run, ("-", "-"))[1], this)
        if request.action in (kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE):
            self.writes += 1
            if self.kill_after is not None and self.writes >= self.kill_after:
                self.write_reached.set()  # the killer SIGKILLs the operator right after this write
        return response


def _run_of(child: str) -> str:
    for suffix in ("-export-merged", "-export", "-config"):
        if child.endswith(suffix):
            return child[: -len(suffix)]
    return child


@dataclass
class Run:
    """One run's schedule (seconds after the start) and where it is."""

    name: str
    start: float
    suspend_at_create: bool
    flips: list[tuple[float, bool]]
    complete_at: float
    delete_at: float | None
    stage: str = "scheduled"
    running_since: float | None = None

    @property
    def deleted(self) -> bool:
        return self.delete_at is not None


def schedule(rng: random.Random) -> dict[str, Run]:
    runs = {}
    for i in range(RUNS):
        start = 0.6 * i
        suspended = i % 3 == 0
        flips = [(start + 3.0, False)] if suspended else [(start + 2.0, True), (start + 5.0, False)] if i % 3 == 1 else []
        complete = start + 8 + rng.uniform(0, 6)
        delete = start + rng.uniform(1, 16) if i % 3 == 2 or i % 7 == 4 else None
        runs[f"chaos-{i}"] = Run(f"chaos-{i}", start, suspended, flips, complete, delete)
    return runs


async def _not_ended(h: Harness, runs: dict[str, Run]) -> list[dict[str, Any]]:
    """The runs not at their end state, with what the operator and the controllers left of them."""
    out = []
    for name, end in (await ended(h, runs)).items():
        if not end:
            cr = await h.get("LoraFinetune", name)
            children = [{k: o["metadata"].get(k) for k in ("name", "uid", "finalizers", "deletionTimestamp")} | {
                "suspend": o.get("spec", {}).get("suspend"), "status": o.get("status")}
                for kind in ("JobSet", "Job") for o in await h.list(kind) if _run_of(o["metadata"]["name"]) == name]
            out.append({"run": name, "stage": runs[name].stage, "cr": cr and {"meta": cr["metadata"], "spec.suspend": cr["spec"].get("suspend"),
                        "status": cr.get("status")}, "children": children})
    return out


def lft(name: str, suspend: bool) -> dict[str, Any]:
    return {"apiVersion": "lora-operator.dev/v1alpha1", "kind": "LoraFinetune", "metadata": {"name": name},
            "spec": {"model": {"source": "gs://models-bucket/llama"}, "dataset": {"train": "gs://data-bucket/train.jsonl"},
                     "output": {"uri": f"/nonexistent/chaos/{name}"}, "tpu": {"type": "v5p", "topology": "2x2x2"},
                     "training": {"steps": 100}, "suspend": suspend}}


async def _sleep_until(t0: float, at: float) -> None:
    await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))


async def user(h: Harness, run: Run, t0: float) -> None:
    """What the run's author does: create, suspend and resume, delete, on schedule, operator or not."""
    await _sleep_until(t0, run.start)
    await h.create(lft(run.name, run.suspend_at_create))
    run.stage = "created-suspended" if run.suspend_at_create else "created"
    actions: list[tuple[float, Any]] = [*run.flips]
    if run.delete_at is not None:
        actions.append((run.delete_at, "delete"))
    for at, action in sorted(actions, key=lambda a: a[0]):
        await _sleep_until(t0, at)
        if action == "delete":
            await h.delete("LoraFinetune", run.name)
            run.stage = "deleting"
            return
        if run.stage in ("completed", "exported"):
            continue
        await h.patch_spec("LoraFinetune", run.name, {"suspend": action})
        run.stage = "suspended" if action else "resumed"


async def _patch_status(h: Harness, kind: str, name: str, status: dict[str, Any]) -> None:
    from k8s_harness import PATHS

    await h._request("PATCH", PATHS[kind].format(ns="default") + f"/{name}/status", {"status": status}, merge=True)


def _true(obj: dict[str, Any], ctype: str) -> bool:
    return any(c.get("type") == ctype and c.get("status") == "True" for c in (obj.get("status") or {}).get("conditions") or [])


async def controllers(h: Harness, runs: dict[str, Run], t0: float, stop: asyncio.Event, rng: random.Random) -> None:
    """The JobSet, Job, TTL-after-finished and garbage-collection controllers, as the real ones act:
    status through the status subresource, deletions through DELETE (held by finalizers)."""
    due: dict[str, float] = {}
    job_seen: dict[str, float] = {}
    while not stop.is_set():
        now = time.monotonic()
        owners = {cr["metadata"]["uid"] for cr in await h.list("LoraFinetune")}
        for kind in ("JobSet", "Job", "ConfigMap"):
            for obj in await h.list(kind):
                meta, name = obj["metadata"], obj["metadata"]["name"]
                if meta.get("deletionTimestamp"):
                    continue
                if not {r["uid"] for r in meta.get("ownerReferences") or []} & owners:  # garbage collector
                    await h._request("DELETE", f"{_collection(kind)}/{name}")
                    continue
                run = runs[_run_of(name)]
                if kind == "ConfigMap":
                    continue
                if _true(obj, "Completed") or _true(obj, "Complete"):  # TTL after finished
                    if now >= due.setdefault(f"{kind}/{meta['uid']}", now + rng.uniform(*TTL)):
                        await h._request("DELETE", f"{_collection(kind)}/{name}")
                elif kind == "Job":
                    if now - job_seen.setdefault(meta["uid"], now) > 0.5:
                        await _patch_status(h, "Job", name, {"startTime": _now(), "completionTime": _now(), "succeeded": 1, "conditions": [
                            {"type": "Complete", "status": "True", "reason": "", "message": "", "lastTransitionTime": _now()}]})
                        run.stage = "exported"
                elif obj["spec"].get("suspend"):
                    run.running_since = None
                    if not (obj.get("status") or {}).get("replicatedJobsStatus", [{}])[0].get("suspended"):
                        await _patch_status(h, "JobSet", name, {"replicatedJobsStatus": [
                            {"name": "slice", "active": 0, "ready": 0, "succeeded": 0, "failed": 0, "suspended": 1}]})
                elif run.running_since is None:
                    run.running_since = now
                    await _patch_status(h, "JobSet", name, {"restarts": 0, "replicatedJobsStatus": [
                        {"name": "slice", "active": 1, "ready": 1, "succeeded": 0, "failed": 0, "suspended": 0}]})
                elif now >= t0 + run.complete_at and now - run.running_since > 0.3:
                    await _patch_status(h, "JobSet", name, {
                        "conditions": [{"type": "Completed", "status": "True", "reason": "AllJobsCompleted",
                                        "message": "jobset completed successfully", "lastTransitionTime": _now()}],
                        "terminalState": "Completed"})
                    run.stage = "completed"
        await asyncio.sleep(0.1)


def _collection(kind: str) -> str:
    from k8s_harness import PATHS

    return PATHS[kind].format(ns="default")


async def ended(h: Harness, runs: dict[str, Run]) -> dict[str, bool]:
    """Per run: at its end state, Succeeded (or, for a deleted run, gone) with no child left (the
    finished ones deleted by their TTL once the operator let them go, a deleted run's by the
    garbage collector)."""
    crs = {cr["metadata"]["name"]: cr for cr in await h.list("LoraFinetune")}
    with_children = {_run_of(o["metadata"]["name"]) for kind in ("JobSet", "Job") for o in await h.list(kind)}
    out = {}
    for name, run in runs.items():
        phase = ((crs.get(name) or {}).get("status") or {}).get("phase")
        out[name] = (name not in crs if run.deleted else phase == "Succeeded") and name not in with_children
    return out


async def test_sigkill_at_random_points_duplicates_resurrects_and_strands_nothing(tmp_path: Path):
    rng = random.Random(22)
    runs = schedule(rng)
    emulator = RecordingEmulator()
    kill_points: list[tuple[str, ...]] = []
    async with Harness(emulator) as h:
        operator = h.process(tmp_path, SETTINGS)
        t0 = time.monotonic()
        stop = asyncio.Event()
        tasks = [asyncio.create_task(user(h, run, t0)) for run in runs.values()]
        tasks.append(asyncio.create_task(controllers(h, runs, t0, stop, rng)))
        try:
            lives = 0
            while lives < MAX_LIVES:
                if all((await ended(h, runs)).values()) and lives >= MIN_LIVES:
                    break
                # Killed right after its n-th write of this life (between a write and the next
                # step that depends on it), or after a random time (during start-up, too).
                emulator.write_reached.clear()
                emulator.kill_after = emulator.writes + rng.randint(1, 30)
                operator.start()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(emulator.write_reached.wait(), rng.uniform(0.5, 3.0))
                operator.kill()
                emulator.kill_after = None
                lives += 1
                crs = {cr["metadata"]["name"]: cr for cr in await h.list("LoraFinetune")}
                for name, end in (await ended(h, runs)).items():
                    if runs[name].stage != "scheduled" and not end:
                        phase = ((crs.get(name) or {}).get("status") or {}).get("phase", "-")
                        kill_points.append((name, runs[name].stage, phase, *emulator.last.get(name, ("-", "-"))))
                await asyncio.sleep(rng.uniform(0.1, 1.0))  # down: users and controllers go on
            operator.start()  # the last life: it stays up and must bring every run to its end
            await operator.wait_live()

            async def all_ended() -> bool:
                return all((await ended(h, runs)).values())

            try:
                await h.wait_for(all_ended, timeout=60, what="every run at its end state")
            except AssertionError as e:
                raise AssertionError(f"{e}: {await _not_ended(h, runs)}") from None
            assert await operator.stop() == 0, operator.log.read_text()[-3000:]
            assert "Traceback" not in operator.log.read_text(), "the operator logged an exception (kopf logs and goes on)"
        finally:
            stop.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        distinct = {point[1:] for point in kill_points}
        print(f"{lives} SIGKILLs, {len(kill_points)} kill points (a run caught mid-life), {len(distinct)} distinct "
              f"(stage, phase, last two requests) of {len(runs)} runs")
        assert len(kill_points) >= 100, kill_points
        for run in runs.values():
            jobsets = emulator.created.get(("jobsets", run.name), [])
            exports = emulator.created.get(("jobs", f"{run.name}-export"), [])
            assert len(jobsets) <= 1 and len(exports) <= 1, (run.name, jobsets, exports)  # no duplicate, no resurrection
            reasons = collections.Counter(e["reason"] for e in await h.events_for(run.name))
            assert not {"JobSetRecreated", "ExportRecreated", "WaitingForAdmission", "SettingsChanged"} & set(reasons), reasons
            # A run deleted before the operator saw its JobSet has no Created event: nobody is left to tell.
            assert reasons["Created"] == len(jobsets) or run.deleted and reasons["Created"] == 0, (run.name, reasons)
            if run.deleted:
                continue
            assert len(jobsets) == 1 and len(exports) == 1, (run.name, jobsets, exports)
            status = (await h.get("LoraFinetune", run.name))["status"]
            assert _end_state(status) == _end_state_without_faults(run), (run.name, status)


def _end_state(status: dict[str, Any]) -> dict[str, Any]:
    record = status.get("record") or {}
    return {
        "phase": status["phase"], "adapterUri": status.get("adapterUri"), "jobSetName": status.get("jobSetName"),
        "progress": status.get("progress"), "restarts": status.get("restarts"),
        "conditions": {c["type"]: (c["status"], c["reason"]) for c in status["conditions"] if c["status"] == "True"},
        "children": sorted((c["kind"], c["name"]) for c in record.get("children") or []),
    }


def _end_state_without_faults(run: Run) -> dict[str, Any]:
    return {
        "phase": "Succeeded", "adapterUri": f"/nonexistent/chaos/{run.name}/hf-adapter", "jobSetName": run.name,
        "progress": "0/100", "restarts": 0, "conditions": {"Succeeded": ("True", "ExportSucceeded")},
        "children": [("Job", f"{run.name}-export"), ("JobSet", run.name)],
    }
