"""The real kopf operator over HTTP against the KMock emulator: the lifecycle of both CRs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from k8s_harness import Harness, Rejected

pytestmark = pytest.mark.timeout(120)


def lft(name: str, output: str = "gs://runs-bucket/run", **spec: Any) -> dict[str, Any]:
    base = {
        "model": {"source": "gs://models-bucket/llama"},
        "dataset": {"train": "gs://data-bucket/train.jsonl"},
        "output": {"uri": output},
        "tpu": {"type": "v5p", "topology": "2x2x2", "slices": 2},
        "training": {"steps": 100},
    }
    base.update(spec)
    return {"apiVersion": "lora-operator.dev/v1alpha1", "kind": "LoraFinetune", "metadata": {"name": name}, "spec": base}


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
    js = await h.get("JobSet", "run-a")
    assert js["metadata"]["ownerReferences"][0]["uid"] == st["metadata"]["uid"]
    cm = await h.get("ConfigMap", "run-a-config")
    assert json.loads(cm["data"]["config.json"])["training"]["steps"] == 100
    assert [o["metadata"]["name"] for o in await h.list("JobSet")] == ["run-a"]
    assert [o["metadata"]["name"] for o in await h.list("ConfigMap")] == ["run-a-config"]
    assert any(e["reason"] == "Created" for e in await h.events_for("run-a"))
    # kopf's bookkeeping is in annotations, not in the (pruned) status.
    assert set(st["status"]) <= {"phase", "conditions", "observedGeneration", "jobSetName", "tpu", "totalSteps", "progress", "restarts"}
