"""`/metrics` of the real operator (kopf over HTTP against KMock): runs by phase, admission wait,
restarts and preemptions, each run's step/tokens/s/MFU, reconcile errors, leadership; scraped
over HTTP as Prometheus does and parsed with prometheus_client's own parser."""

from __future__ import annotations

import json

import aiohttp
import pytest
from gcs_emulator import free_port
from k8s_harness import Harness, harness_settings
from prometheus_client.parser import text_string_to_metric_families
from test_operator_e2e import lft
from test_operator_recovery import _StatusHiccup

from lora_operator.metrics import OperatorMetrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _run(name: str) -> tuple[tuple[str, str], ...]:
    return (("name", name), ("namespace", "default"))


async def test_metrics_follow_the_runs(tmp_path):
    metrics = OperatorMetrics()
    port = free_port()
    server = metrics.serve(port, "127.0.0.1")
    try:
        emulator = _StatusHiccup(strict=False)
        async with Harness(emulator, expected_errors=(r"etcdserver: request timed out",)) as h, aiohttp.ClientSession() as http:
            await h.start_operator(harness_settings(), metrics=metrics)

            async def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
                async with http.get(f"http://127.0.0.1:{port}/metrics") as r:
                    assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
                    return _samples(await r.text())

            out = tmp_path / "run-m"
            await h.create(lft("run-m", output=str(out)))
            await h.create(lft("run-p"))
            await h.wait_for_status("LoraFinetune", "run-p", lambda s: s.get("phase") == "Pending")
            await h.jobset_running("run-m")
            await h.wait_for_status("LoraFinetune", "run-m", lambda s: s.get("phase") == "Running")
            out.mkdir()
            (out / "progress.json").write_text(json.dumps({"step": 42, "totalSteps": 100, "loss": 1.5,
                                                           "tokensPerSecond": 5120.0, "mfu": 0.412, "eta": "29s"}))
            await h.wait_for_status("LoraFinetune", "run-m", lambda s: s.get("step") == 42)
            await h.jobset_running("run-m", restarts=3, counted=1)  # two preemptions, one counted fault
            await h.wait_for_status("LoraFinetune", "run-m", lambda s: s.get("preemptions") == 2)

            async def settled() -> dict | None:
                m = await scrape()
                return m if m.get(("lora_operator_run_preemptions_total", _run("run-m"))) == 2 else None

            m = await h.wait_for(settled, what="metrics of run-m")
            assert m[("lora_operator_runs", (("phase", "Running"),))] == 1
            assert m[("lora_operator_runs", (("phase", "Pending"),))] == 1
            assert m[("lora_operator_runs", (("phase", "Failed"),))] == 0
            assert m[("lora_operator_run_step", _run("run-m"))] == 42
            assert m[("lora_operator_run_total_steps", _run("run-m"))] == 100
            assert m[("lora_operator_run_tokens_per_second", _run("run-m"))] == 5120
            assert m[("lora_operator_run_mfu", _run("run-m"))] == 0.412
            assert m[("lora_operator_run_restarts_total", _run("run-m"))] == 1
            assert m[("lora_operator_run_pending_seconds", _run("run-p"))] >= 0
            assert ("lora_operator_run_pending_seconds", _run("run-m")) not in m  # it runs
            assert m[("lora_operator_admission_wait_seconds_count", ())] == 1  # run-m's wait, seen Pending -> Running
            assert m[("lora_operator_leader", ())] == 1

            # A handler that fails (status writes answered 500 more often than the client retries): kopf
            # logs it and retries; the counter shows it.
            emulator.plural = "lorafinetunes"
            (out / "progress.json").write_text(json.dumps({"step": 43, "totalSteps": 100}))

            async def failed() -> dict | None:
                m = await scrape()
                errors = {labels: v for (name, labels), v in m.items() if name == "lora_operator_reconcile_errors_total"}
                return errors or None

            errors = await h.wait_for(failed, what="a counted reconcile error")
            assert all(dict(labels)["how"] == "exception" for labels in errors) and sum(errors.values()) >= 1
            await h.delete("LoraFinetune", "run-p")
            await h.gone("LoraFinetune", "run-p")

            async def forgotten() -> dict | None:
                m = await scrape()
                return m if ("lora_operator_run_restarts_total", _run("run-p")) not in m else None

            await h.wait_for(forgotten, what="the deleted run gone from /metrics")
            assert h.server_errors() == []
    finally:
        server.shutdown()
