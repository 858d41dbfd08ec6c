"""One status write per reconcile (issue 24), counted on the operator's own API client against KMock.

The controller is driven directly, one reconcile per transition, with kopf left out: its handlers
and timers would reconcile at moments of their own, and the count is per reconcile. A write that
must precede an operation on a child (the durable record of issue 22: the admission before the
children are created, the suspension requested before the JobSet is patched, what training ended
with before the JobSet is let go) is a deliberate second write, a write-ahead; every other
change a reconcile decides lands in its one final write.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from k8s_harness import Harness, harness_settings
from test_operator_e2e import adc, lft

from lora_operator.controller import Controller
from lora_operator.kube import Kube
from lora_operator.plan import plan_adapter_conversion
from lora_trainer.progress_record import ProgressRecord

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

STATUS, CHILD = "status", "child"


class CountingKube:
    """The operator's client, logging its status writes and its operations on children in order."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.log: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kube, name)

    def merge_patch(self, *args: Any, status: bool = False, **kwargs: Any) -> dict[str, Any]:
        self.log.append(STATUS if status else CHILD)
        return self.kube.merge_patch(*args, status=status, **kwargs)

    def create_or_adopt(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self.log.append(CHILD)
        return self.kube.create_or_adopt(manifest)

    def set_finalizers(self, obj: dict[str, Any], finalizers: list[str]) -> dict[str, Any]:
        self.log.append(CHILD)
        return self.kube.set_finalizers(obj, finalizers)


def write_aheads(log: list[str]) -> int:
    """Status writes directly followed by an operation on a child."""
    return sum(1 for a, b in zip(log, log[1:]) if (a, b) == (STATUS, CHILD))


async def reconcile(controller: Controller, kube: CountingKube, kind: str, name: str) -> list[str]:
    """One reconcile of `name`: what it sent, in order."""
    kube.log.clear()
    await asyncio.to_thread(controller.reconcile, kind, "default", name)
    return list(kube.log)


def writes(log: list[str]) -> tuple[int, int]:
    """(status writes, of which write-aheads)."""
    return log.count(STATUS), write_aheads(log)


async def test_a_run_writes_its_status_once_per_reconcile_plus_its_write_aheads():
    async with Harness() as h:
        kube = CountingKube(h.kube())
        controller = Controller(kube, harness_settings())  # type: ignore[arg-type]
        await h.create(lft("run-w", output="gs://runs-bucket/run-w"))
        # Created: the admission before the children, then their uids.
        assert writes(await reconcile(controller, kube, "LoraFinetune", "run-w")) == (2, 1)
        assert writes(await reconcile(controller, kube, "LoraFinetune", "run-w")) == (0, 0)
        await h.jobset_running("run-w")
        assert writes(await reconcile(controller, kube, "LoraFinetune", "run-w")) == (1, 0)
        kube.log.clear()
        await asyncio.to_thread(controller.record_progress, "default", "run-w", ProgressRecord(step=10, total_steps=100))
        assert kube.log == [STATUS]
        # Suspended: the request before the JobSet is patched, then what was applied.
        await h.patch_spec("LoraFinetune", "run-w", {"suspend": True})
        assert writes(await reconcile(controller, kube, "LoraFinetune", "run-w")) == (2, 1)
        await h.patch_spec("LoraFinetune", "run-w", {"suspend": False})
        assert writes(await reconcile(controller, kube, "LoraFinetune", "run-w")) == (2, 1)
        await h.jobset_condition("run-w", "Completed", "AllJobsCompleted", "jobset completed successfully")
        # Training ended: Exporting before the JobSet is let go, then the export Job's uid.
        assert writes(await reconcile(controller, kube, "LoraFinetune", "run-w")) == (2, 1)
        await h.job_finished("run-w-export")
        # Succeeded before the export Job is let go; nothing after it.
        log = await reconcile(controller, kube, "LoraFinetune", "run-w")
        assert writes(log) == (1, 1) and log[-1] == CHILD
        assert (await h.get("LoraFinetune", "run-w"))["status"]["phase"] == "Succeeded"


async def test_a_conversion_whose_job_outlived_its_status_is_written_once():
    """Admitting the conversion and adopting its Job are two rounds of one reconcile with no child
    operation between them: one write (each round wrote its own before)."""
    async with Harness() as h:
        kube = CountingKube(h.kube())
        settings = harness_settings()
        controller = Controller(kube, settings)  # type: ignore[arg-type]
        cr = await h.create(adc("conv-w"))
        job = plan_adapter_conversion(cr, settings).job
        assert job is not None
        await asyncio.to_thread(h.kube().create_or_adopt, job)  # made before the status was lost (a restore)
        assert writes(await reconcile(controller, kube, "AdapterConversion", "conv-w")) == (1, 0)
        status = (await h.get("AdapterConversion", "conv-w"))["status"]
        assert status["jobName"] == "conv-w-convert" and [c["name"] for c in status["record"]["children"]] == ["conv-w-convert"]
        assert writes(await reconcile(controller, kube, "AdapterConversion", "conv-w")) == (0, 0)
