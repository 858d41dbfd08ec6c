"""The chart's RBAC allows every request the real operator makes, and nothing it never makes.

Evidence comes from the KMock harness (tests/k8s_harness.py), which records each
request the operator sends as (RBAC verb, `<group>/<resource>[/<subresource>]`): the lifecycle
scenario below, plus whatever other harness tests of the same pytest run recorded, plus the
file named by LORA_RBAC_USAGE_FILE when a previous run wrote one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

import k8s_harness
from k8s_harness import Harness, harness_settings
from lora_operator.render import render_lora_finetune
from lora_operator.settings import LeaderElection
from test_chart import CUSTOM_VALUES, render

pytestmark = pytest.mark.timeout(180)

NAMESPACE = "default"

#: Rights the chart grants although no emulator scenario exercises them, each with its reason.
#: Keep this list short: every entry is a right the tests cannot prove is needed.
GRANTED_WITHOUT_EVIDENCE: dict[tuple[str, str], str] = {}


def _lft(name: str, output: Path) -> dict[str, Any]:
    return {
        "apiVersion": "lora-operator.dev/v1alpha1",
        "kind": "LoraFinetune",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "model": {"source": "hf://meta-llama/Llama-3.1-8B"},
            "dataset": {"train": "gs://data-bucket/train.jsonl"},
            "output": {"uri": str(output), "export": {"hfPeft": True, "merged": True}},
            "tpu": {"type": "v5p", "topology": "2x2x2"},
            "training": {"steps": 10},
            "hfTokenSecretRef": {"name": "hf-token"},
        },
    }


async def _lifecycle(h: Harness, tmp_path: Path) -> None:
    """Create (with a Secret reference, children pre-existing), run with progress, complete,
    export (adapter and merged); convert. Starts the operator."""
    await h.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-token", "namespace": NAMESPACE}, "data": {"token": "eA=="}})
    output = tmp_path / "run"
    output.mkdir()
    body = await h.create(_lft("rbac-run", output))
    # As after an operator restart that had made the ConfigMap only: the create gets a 409 and reads
    # it back to adopt it (the `get` right on ConfigMaps); the JobSet is created.
    config_map, _ = render_lora_finetune(body, harness_settings())
    await h.create(config_map)
    # As one of several replicas (replicaCount > 1): it elects itself leader over a Lease first.
    await h.start_operator(harness_settings(leader_election=LeaderElection(enabled=True, lease_namespace=NAMESPACE)))
    await h.wait_for_status("LoraFinetune", "rbac-run", lambda s: s.get("phase") == "Pending")
    (output / "progress.json").write_text(json.dumps({"step": 5, "totalSteps": 10, "loss": 1.5, "tokensPerSecond": 100.0, "eta": "1m"}))
    await h.jobset_running("rbac-run")
    await h.wait_for_status("LoraFinetune", "rbac-run", lambda s: s.get("phase") == "Running" and s.get("step") == 5)
    await h.jobset_condition("rbac-run", "Completed", "AllJobsCompleted", "jobs completed")
    await h.wait_for_status("LoraFinetune", "rbac-run", lambda s: s.get("phase") == "Exporting")
    for job in ("rbac-run-export", "rbac-run-export-merged"):
        await h.wait_for(lambda job=job: h.get("Job", job), what=f"Job {job}")
        await h.job_finished(job)
    await h.wait_for_status("LoraFinetune", "rbac-run", lambda s: s.get("phase") == "Succeeded")

    await h.create({
        "apiVersion": "lora-operator.dev/v1alpha1",
        "kind": "AdapterConversion",
        "metadata": {"name": "rbac-convert", "namespace": NAMESPACE},
        "spec": {
            "source": {"uri": "gs://runs-bucket/peft", "format": "hf-peft"},
            "target": {"uri": "gs://runs-bucket/orbax", "format": "orbax"},
            "model": {"source": "gs://models-bucket/llama"},
        },
    })
    await h.wait_for(lambda: h.get("Job", "rbac-convert-convert"), what="conversion Job")
    await h.job_finished("rbac-convert-convert")
    await h.wait_for_status("AdapterConversion", "rbac-convert", lambda s: s.get("phase") == "Succeeded")


def _recorded_elsewhere() -> set[tuple[str, str]]:
    usage = set(k8s_harness._RUN_USAGE)
    if (path := os.environ.get("LORA_RBAC_USAGE_FILE")) and Path(path).exists():
        usage |= {(r["verb"], f"{r['apiGroup']}/{r['resource']}") for r in json.loads(Path(path).read_text())}
    return usage


def _grants(objs: list[dict[str, Any]], kind: str, namespace: str | None = None) -> set[tuple[str, str]]:
    """(verb, group/resource) pairs granted by the (Cluster)Roles of `kind` (in `namespace`)."""
    out = set()
    for obj in objs:
        if obj["kind"] != kind or obj["metadata"].get("namespace") != namespace:
            continue
        for rule in obj["rules"]:
            out |= {(v, f"{g}/{r}") for v in rule["verbs"] for g in rule["apiGroups"] for r in rule["resources"]}
    return out


CLUSTER_SCOPED = {"apiextensions.k8s.io/customresourcedefinitions"}
#: Leader election's Lease: granted in the operator's own (release) namespace, not where runs are.
LEASES = "coordination.k8s.io/leases"
RELEASE_NAMESPACE = "lora-system"


def _runs(used: set[tuple[str, str]]) -> set[tuple[str, str]]:
    return {(v, r) for v, r in used if r != LEASES}


@pytest.fixture(scope="module")
def used(tmp_path_factory: pytest.TempPathFactory) -> set[tuple[str, str]]:
    import asyncio

    async def scenario() -> set[tuple[str, str]]:
        async with Harness() as h:
            await _lifecycle(h, tmp_path_factory.mktemp("rbac"))
            await h.stop_operator()
            assert h.server_errors() == []
            return h.requests

    return asyncio.run(scenario()) | _recorded_elsewhere()


def test_the_scenario_exercised_every_kind_of_object(used: set[tuple[str, str]]) -> None:
    resources = {r for _, r in used}
    assert {"lora-operator.dev/lorafinetunes", "lora-operator.dev/lorafinetunes/status", "jobset.x-k8s.io/jobsets", "batch/jobs",
            "/configmaps", LEASES} <= resources


def test_cluster_role_allows_everything_the_operator_did(used: set[tuple[str, str]]) -> None:
    granted = _grants(render({}), "ClusterRole")
    assert sorted(_runs(used) - granted) == []


def test_the_leader_election_role_allows_exactly_what_the_election_did(used: set[tuple[str, str]]) -> None:
    granted = _grants(render({"replicaCount": 2}), "Role", RELEASE_NAMESPACE)
    assert granted == {(v, r) for v, r in used if r == LEASES}


def test_namespaced_roles_allow_everything_the_operator_did_in_their_namespace(used: set[tuple[str, str]]) -> None:
    objs = render({**CUSTOM_VALUES, "watchNamespaces": [NAMESPACE, "team-b"]})
    cluster = _grants(objs, "ClusterRole")
    for ns in (NAMESPACE, "team-b"):
        granted = _grants(objs, "Role", ns)
        missing = {(v, r) for v, r in _runs(used) if (v, r) not in (cluster if r in CLUSTER_SCOPED else granted)}
        assert sorted(missing) == [], f"Role in {ns} lacks rights the operator used"
    assert {r for _, r in cluster} <= CLUSTER_SCOPED, "only discovery reads may stay cluster-wide"


def test_nothing_is_granted_that_the_operator_never_used(used: set[tuple[str, str]]) -> None:
    granted = _grants(render({}), "ClusterRole")
    unused = granted - _runs(used) - set(GRANTED_WITHOUT_EVIDENCE)
    assert sorted(unused) == [], "drop these rules from charts/lora-operator/templates/_helpers.tpl (or prove they are needed)"
