"""Operator latency and memory: N LoraFinetunes created at once against the KMock emulator.

Runs the real `lora-operator run` as a separate process (kubeconfig pointing at the emulator on
loopback, so its RSS is its own), creates N CRs concurrently, and measures for each the time
from its creation (the API answer) to its JobSet appearing in the emulator; then reads the
operator's peak RSS (VmHWM). Writes the figures into the "Operator" section of
docs/benchmarks.md. Run by hand: `.venv/bin/python bench/operator_latency.py [--count 200]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from k8s_harness import PATHS, ApiServerEmulator, Harness  # noqa: E402
import kmock  # noqa: E402
from crdcheck import validate  # noqa: E402
from gcs_emulator import free_port  # noqa: E402
import report  # bench/ is on sys.path when a script here runs

#: How the operator is started (override with env LORA_BENCH_OPERATOR_CMD, e.g. to profile it).
OPERATOR_CMD = os.environ.get("LORA_BENCH_OPERATOR_CMD", str(ROOT / ".venv" / "bin" / "lora-operator")).split()
SECTION = "## Operator"


class TimedEmulator(ApiServerEmulator):
    """Notes when the operator first writes each CR's status (its handler started) and when each
    JobSet is created (no polling that would compete with the server)."""

    jobset_created: dict[str, float] = {}
    handler_started: dict[str, float] = {}

    async def _handle(self, request: kmock.Request) -> Any:
        response = await super()._handle(request)
        res = request.resource
        if res is not None and 200 <= response.status < 300:
            if request.action == kmock.action.CREATE and res.plural == "jobsets":
                TimedEmulator.jobset_created.setdefault((request.data or {}).get("metadata", {}).get("name"), time.monotonic())
            elif res.plural == "lorafinetunes" and request.subresource == "status" and request.name:
                TimedEmulator.handler_started.setdefault(request.name, time.monotonic())
        return response


def _cr(i: int) -> dict[str, Any]:
    body = {
        "apiVersion": "lora-operator.dev/v1alpha1",
        "kind": "LoraFinetune",
        "metadata": {"name": f"bench-{i:04d}", "namespace": "default"},
        "spec": {
            "model": {"source": "gs://models-bucket/llama"},
            "dataset": {"train": "gs://data-bucket/train.jsonl"},
            "output": {"uri": f"/nonexistent/bench/{i}"},
            "tpu": {"type": "v5p", "topology": "2x2x2", "slices": 2},
        },
    }
    body, errors = validate("lorafinetunes", body)
    assert not errors, errors
    return body


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc status")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def measure(count: int, timeout: float) -> dict[str, Any]:
    bodies = [_cr(i) for i in range(count)]
    async with Harness(TimedEmulator(strict=False)) as h:
        tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
        kubeconfig = tmp / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "emu",
            "clusters": [{"name": "emu", "cluster": {"server": h.url}}],
            "users": [{"name": "emu", "user": {}}],
            "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "emu"}}],
        }))
        settings = tmp / "settings.yaml"
        # The runs' outputs are local paths nobody writes (no progress to read, no cloud storage).
        settings.write_text("logLevel: WARNING\nallowedLocalPaths: [/nonexistent]\n")
        port = free_port()
        env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        proc = subprocess.Popen(
            [*OPERATOR_CMD, "run", "--settings", str(settings),
             "--liveness", f"http://127.0.0.1:{port}/healthz", "--metrics-port", str(free_port())],
            env=env, stdout=subprocess.DEVNULL, stderr=open(tmp / "operator.log", "w"),
        )
        try:
            async with aiohttp.ClientSession() as probe:
                deadline = time.monotonic() + 60
                while True:
                    try:
                        async with probe.get(f"http://127.0.0.1:{port}/healthz") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise RuntimeError(f"operator did not become live; see {tmp / 'operator.log'}")
                    await asyncio.sleep(0.1)
            idle_rss = _peak_rss_mb(proc.pid)

            created: dict[str, float] = {}
            seen = TimedEmulator.jobset_created

            async def create(body: dict[str, Any]) -> None:
                status, data = await h._request("POST", PATHS["LoraFinetune"].format(ns="default"), body)
                assert status in (200, 201), data
                created[body["metadata"]["name"]] = time.monotonic()

            start = time.monotonic()
            creating = asyncio.gather(*(create(b) for b in bodies))
            await creating
            while len(seen) < count and time.monotonic() - start < timeout:
                await asyncio.sleep(0.05)
            peak_rss = _peak_rss_mb(proc.pid)
        finally:
            proc.terminate()
            try:
                await asyncio.to_thread(proc.wait, 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait)
    latencies = [seen[n] - created[n] for n in seen if n in created]
    started = TimedEmulator.handler_started
    queued = [started[n] - created[n] for n in seen if n in created and n in started]
    handling = [seen[n] - started[n] for n in seen if n in started]
    return {
        "count": count,
        "jobsets": len(seen),
        "p50_s": round(statistics.median(latencies), 3),
        "p99_s": round(_percentile(latencies, 0.99), 3),
        "max_s": round(max(latencies), 3),
        "all_created_in_s": round(max(seen.values()) - start, 2),
        "queue_p50_s": round(statistics.median(queued), 3),
        "handler_p50_s": round(statistics.median(handling), 3),
        "idle_rss_mb": round(idle_rss, 1),
        "peak_rss_mb": round(peak_rss, 1),
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
    }


def write_section(results: list[dict[str, Any]]) -> None:
    """Replace (or append) the Operator section of docs/benchmarks.md; other sections stay."""
    p99 = statistics.median(r["p99_s"] for r in results)
    peak = max(r["peak_rss_mb"] for r in results)
    complete = all(r["jobsets"] == r["count"] for r in results)
    verdict = (
        f"latency target {'met' if p99 < 2 and complete else 'NOT met'}, memory target {'met' if peak < 200 else 'NOT met'}"
        + ("" if complete else " (some JobSets never appeared)")
    )
    rows = "\n".join(
        f"| {i + 1} | {r['jobsets']} / {r['count']} | {r['p50_s']} s | {r['p99_s']} s | {r['max_s']} s | "
        f"{r['queue_p50_s']} s | {r['handler_p50_s']} s | "
        f"{r['idle_rss_mb']} / {r['peak_rss_mb']} MB | {r['load_avg_1m']} |"
        for i, r in enumerate(results)
    )
    r0 = results[0]
    handler = round(statistics.median(r["handler_p50_s"] for r in results), 3)
    body = f"""{SECTION}

`bench/operator_latency.py` (run by hand): {r0['count']} LoraFinetunes created at once against the
KMock emulator on loopback; the real `lora-operator run` in its own process; latency = CR creation
(API answer) -> its JobSet exists; peak RSS = the operator process's VmHWM. {len(results)} runs, each
with a fresh emulator and operator. Machine: {r0['cpus']} CPUs shared with other work (the 1-minute
load average at the end of each run is in the table), Python {r0['python']}. The emulator runs in the
benchmark's own process and is part of the measured path; all three share the cores with the other
work. "queue" is creation -> the operator's first write for that CR (its handler started), "handler"
is that first write -> the JobSet exists (status patch, ConfigMap, JobSet).

| run | JobSets | p50 | p99 | slowest | queue p50 | handler p50 | RSS idle / peak | load |
|---|---|---|---|---|---|---|---|---|
{rows}

Median p99 {round(p99, 3)} s over the runs (range {min(r['p99_s'] for r in results)}-{max(r['p99_s'] for r in results)} s; target < 2 s),
peak RSS {peak} MB (target < 200 MB): {verdict}.
Nearly all of the latency is queueing before a CR's handler starts (the handler itself takes
~{handler} s, median over the runs): {r0['count']} events arrive at once and the emulator, the operator and the benchmark share
{r0['cpus']} cores.
Measured {time.strftime('%Y-%m-%d', time.gmtime())}.
"""
    report.write_section(SECTION, body)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=200)
    p.add_argument("--repeat", type=int, default=3, help="independent runs (fresh emulator and operator each)")
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = p.parse_args()
    results = []
    for _ in range(args.repeat):
        TimedEmulator.jobset_created, TimedEmulator.handler_started = {}, {}
        results.append(asyncio.run(measure(args.count, args.timeout)))
        print(json.dumps(results[-1]))
    if not args.no_write:
        write_section(results)
    return 0 if all(r["jobsets"] == r["count"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
