"""`lora-operator run` as a real process: kubeconfig login, liveness endpoint, CR -> JobSet."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from gcs_emulator import free_port
from k8s_harness import Harness, real_cluster

from lora_operator.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]


def test_run_refuses_bad_settings(tmp_path, capsys):
    bad = tmp_path / "settings.yaml"
    bad.write_text("allowedImages: [x]\n")
    assert cli_main(["run", "--settings", str(bad)]) == 2
    assert "allowedImages" in capsys.readouterr().err


def test_run_says_when_the_metrics_port_is_taken(capsys):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli_main(["run", "--metrics-port", str(port)]) == 2
    assert f"cannot serve /metrics on port {port}" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_operator_process_serves_liveness_and_creates_jobsets(tmp_path):
    async with Harness() as h:
        port = free_port()
        log = tmp_path / "operator.log"
        proc = h.operator_process(tmp_path, ["--liveness", f"http://127.0.0.1:{port}/healthz", "--metrics-port", "0"], log)
        try:
            async with aiohttp.ClientSession() as s:
                async def live() -> bool:
                    try:
                        async with s.get(f"http://127.0.0.1:{port}/healthz") as r:
                            return r.status == 200
                    except aiohttp.ClientError:
                        assert proc.poll() is None, log.read_text()
                        return False

                await h.wait_for(live, timeout=60, what="liveness endpoint")
            await h.create({
                "apiVersion": "lora-operator.dev/v1alpha1", "kind": "LoraFinetune", "metadata": {"name": "proc"},
                "spec": {"model": {"source": "gs://models-bucket/m"}, "dataset": {"train": "gs://data-bucket/t.jsonl"},
                         "output": {"uri": "gs://runs-bucket/proc"}},
            })
            js = await h.wait_for(lambda: h.get("JobSet", "proc"), timeout=30, what="JobSet from the process")
            assert js["metadata"]["labels"]["lora-operator.dev/lorafinetune"] == "proc"
        finally:
            proc.terminate()
            await asyncio.to_thread(proc.wait, 30)
        assert proc.returncode == 0, log.read_text()


REAL = pytest.mark.skipif(not real_cluster(), reason="needs a real cluster: set KUBECONFIG and LORA_E2E_REAL_CLUSTER=1")


@REAL
def test_crds_install_on_a_real_cluster():
    """Server-side dry-run of both CRDs: the API server itself checks structure and CEL cost."""
    for crd in sorted((ROOT / "crds").glob("*.yaml")):
        out = subprocess.run(["kubectl", "apply", "--dry-run=server", "-f", str(crd)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr


@REAL
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_suspended_run_on_a_real_cluster(tmp_path):
    """On a cluster with the JobSet CRD and controller: apply our CRDs, run the operator process
    against the kubeconfig, create a suspended LoraFinetune (no TPU needed) in a scratch namespace,
    and see the JobSet created suspended and the CR Suspended; the server applies our schema and CEL."""
    import json
    import time
    import uuid

    def kubectl(*args: str, stdin: str | None = None) -> str:
        out = subprocess.run(["kubectl", *args], input=stdin, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stdout

    for crd in sorted((ROOT / "crds").glob("*.yaml")):
        kubectl("apply", "--server-side", "-f", str(crd))
    ns = f"lora-e2e-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", ns)
    log = tmp_path / "operator.log"
    proc = subprocess.Popen([sys.executable, "-m", "lora_operator.cli", "run", "-n", ns, "--liveness", f"http://127.0.0.1:{free_port()}/healthz"],
                            stdout=subprocess.DEVNULL, stderr=log.open("w"), cwd=ROOT)
    try:
        bad = {"apiVersion": "lora-operator.dev/v1alpha1", "kind": "LoraFinetune", "metadata": {"name": "bad", "namespace": ns},
               "spec": {"model": {"source": "gs://models-bucket/m"}, "dataset": {"train": "gs://data-bucket/t.jsonl"},
                        "output": {"uri": "gs://runs-bucket/x"}, "tpu": {"type": "v5e", "topology": "2x2x2"}}}
        rejected = subprocess.run(["kubectl", "apply", "-f", "-"], input=json.dumps(bad), capture_output=True, text=True)
        assert rejected.returncode != 0 and "spec.tpu.topology" in rejected.stderr
        good = json.loads(json.dumps(bad))
        good["metadata"]["name"] = "suspended"
        good["spec"]["tpu"] = {"type": "v5p", "topology": "2x2x2"}
        good["spec"]["suspend"] = True
        kubectl("apply", "-f", "-", stdin=json.dumps(good))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            cr = json.loads(kubectl("-n", ns, "get", "lft", "suspended", "-o", "json"))
            if (cr.get("status") or {}).get("phase") == "Suspended":
                break
            time.sleep(2)
        else:
            raise AssertionError(f"CR never became Suspended; operator log:\n{log.read_text()}")
        js = json.loads(kubectl("-n", ns, "get", "jobsets.jobset.x-k8s.io", "suspended", "-o", "json"))
        assert js["spec"]["suspend"] is True
    finally:
        proc.terminate()
        proc.wait(30)
        subprocess.run(["kubectl", "delete", "namespace", ns, "--wait=false"], capture_output=True)

