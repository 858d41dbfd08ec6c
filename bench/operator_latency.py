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
import socket
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

DOC = ROOT / "docs" / "benchmarks.md"
#: How the operator is started (override with env LORA_BENCH_OPERATOR_CMD, e.g. to profile it).
OPERATOR_CMD = os.environ.get("LORA_BENCH_OPERATOR_CMD", str(ROOT / ".venv" / "bin" / "lora-operator")).split()
SECTION = "## Operator"


class TimedEmulator(ApiServerEmulator):
    """Notes when each JobSet is created (no polling that would compete with the server)."""

    jobset_created: dict[str, float] = {}

    async def _handle(self, request: kmock.Request) -> Any:
        response = await super()._handle(request)
        if request.action == kmock.action.CREATE and request.resource is not None and request.resource.plural == "jobsets":
            name = (request.data or {}).get("metadata", {}).get("name")
            if name and 200 <= response.status < 300:
                TimedEmulator.jobset_created.setdefault(name, time.monotonic())
        return response


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        settings.write_text("logLevel: WARNING\n")
        port = _free_port()
        env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        proc = subprocess.Popen(
            [*OPERATOR_CMD, "run", "--settings", str(settings),
             "--liveness", f"http://127.0.0.1:{port}/healthz"],
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
    return {
        "count": count,
        "jobsets": len(seen),
        "p50_s": round(statistics.median(latencies), 3),
        "p99_s": round(_percentile(latencies, 0.99), 3),
        "max_s": round(max(latencies), 3),
        "all_created_in_s": round(max(seen.values()) - start, 2),
        "idle_rss_mb": round(idle_rss, 1),
        "peak_rss_mb": round(peak_rss, 1),
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
    }


def write_section(result: dict[str, Any]) -> None:
    """Replace (or append) the Operator section of docs/benchmarks.md; other sections stay."""
    ok = result["p99_s"] < 2 and result["peak_rss_mb"] < 200 and result["jobsets"] == result["count"]
    body = f"""{SECTION}

`bench/operator_latency.py` (run by hand): {result['count']} LoraFinetunes created at once against the
KMock emulator on loopback; the real `lora-operator run` in its own process; latency = CR creation
(API answer) -> its JobSet exists. Machine: {result['cpus']} CPUs shared with other work (1-minute load
average {result['load_avg_1m']} at the end of the run), Python {result['python']}. The emulator runs in the
benchmark's own process and is part of the measured path.

| metric | value | target |
|---|---|---|
| JobSets created | {result['jobsets']} / {result['count']} | all |
| creation -> JobSet p50 | {result['p50_s']} s | |
| creation -> JobSet p99 | {result['p99_s']} s | < 2 s |
| slowest | {result['max_s']} s | |
| operator RSS idle / peak (VmHWM) | {result['idle_rss_mb']} / {result['peak_rss_mb']} MB | < 200 MB |

Targets {'met' if ok else 'NOT met'}. Measured {time.strftime('%Y-%m-%d', time.gmtime())}.
"""
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    if SECTION in text:
        head, _, rest = text.partition(SECTION)
        nxt = rest.find("\n## ")
        tail = rest[nxt + 1:] if nxt >= 0 else ""
        text = head + body + ("\n" + tail if tail else "")
    else:
        text = text.rstrip("\n") + "\n\n" + body
    DOC.write_text(text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=200)
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = p.parse_args()
    result = asyncio.run(measure(args.count, args.timeout))
    print(json.dumps(result, indent=2))
    if not args.no_write:
        write_section(result)
    return 0 if result["jobsets"] == result["count"] else 1


if __name__ == "__main__":
    sys.exit(main())
