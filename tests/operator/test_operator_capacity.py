"""GKE capacity kinds, Kueue topology-aware scheduling and the admin's pod overlay, rendered: every
kind for every TPU type passes the CRD (schema and CEL) and its JobSet the real JobSet schema, with
the selectors, tolerations and annotations XPK renders for the same choice."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from crdcheck import validate
from test_operator_render import body, jobset_validator

from lora_operator.render import InvalidSpec, render_lora_finetune
from lora_operator.settings import OperatorSettings
from lora_operator.tpu import CATALOG

SETTINGS = OperatorSettings(default_queue_name="tpu-queue")
CAPACITIES: dict[str, dict[str, Any]] = {
    "onDemand": {"type": "onDemand"},
    "spot": {"type": "spot"},
    "reservation": {"type": "reservation", "reservation": {"name": "v5p-res-1"}},
    "flexStart": {"type": "flexStart", "flexStart": {"maxRunDurationSeconds": 86400}},
}
#: What each kind adds: node selector, tolerations (beyond the TPU one), JobSet annotations.
EXPECTED: dict[str, tuple[dict[str, str], list[dict[str, str]], dict[str, str]]] = {
    "onDemand": ({}, [], {}),
    "spot": ({"cloud.google.com/gke-spot": "true"},
             [{"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"}], {}),
    "reservation": ({"cloud.google.com/reservation-name": "v5p-res-1"}, [], {}),
    "flexStart": ({"cloud.google.com/gke-queued": "true"},
                  [{"key": "cloud.google.com/gke-queued", "operator": "Equal", "value": "true", "effect": "NoSchedule"}],
                  {"provreq.kueue.x-k8s.io/maxRunDurationSeconds": "86400"}),
}
MATRIX = [(kind, t, topo) for kind in CAPACITIES for t, entry in CATALOG.items() for topo in (entry.topologies[0], entry.topologies[-1])]
TPU_TOLERATION = {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}


def _pod(js: dict[str, Any]) -> dict[str, Any]:
    return js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]


def _schema_errors(js: dict[str, Any]) -> list[str]:
    return [f"{list(e.absolute_path)}: {e.message}" for e in jobset_validator().iter_errors(js)]


@pytest.mark.parametrize(("kind", "tpu_type", "topology"), MATRIX)
def test_every_capacity_kind_renders_for_every_tpu_type(kind: str, tpu_type: str, topology: str) -> None:
    cr = body(tpu={"type": tpu_type, "topology": topology, "slices": 2, "capacity": CAPACITIES[kind]})
    admitted, errors = validate("lorafinetunes", cr)
    assert errors == []
    _, js = render_lora_finetune(admitted, SETTINGS)
    assert _schema_errors(js) == []
    selector, tolerations, annotations = EXPECTED[kind]
    pod = _pod(js)["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": CATALOG[tpu_type].accelerator,
                                   "cloud.google.com/gke-tpu-topology": topology, **selector}
    assert pod["tolerations"] == [TPU_TOLERATION, *tolerations]
    assert js["metadata"]["annotations"] == {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool",
                                             **annotations}


def test_flex_start_defaults_to_the_longest_run_and_needs_a_queue() -> None:
    cr = body(tpu={"type": "v6e", "topology": "4x4", "capacity": {"type": "flexStart"}})
    admitted, errors = validate("lorafinetunes", cr)
    assert errors == [] and admitted["spec"]["tpu"]["capacity"] == {"type": "flexStart"}
    _, js = render_lora_finetune(admitted, SETTINGS)
    assert js["metadata"]["annotations"]["provreq.kueue.x-k8s.io/maxRunDurationSeconds"] == "604800"
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "tpu-queue"
    # Only Kueue's ProvisioningRequest gets flex-start nodes: without a queue the run is refused, naming the fix.
    with pytest.raises(InvalidSpec, match="spec.queueName.*LocalQueue.*provisioning admission check") as e:
        render_lora_finetune(admitted, OperatorSettings())
    assert e.value.field == "spec.queueName"
    _, js = render_lora_finetune(body(queueName="dws", tpu={"capacity": {"type": "flexStart"}}), OperatorSettings())
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "dws"


@pytest.mark.parametrize("mode", ["required", "preferred"])
def test_topology_aware_scheduling_annotates_the_pods_when_the_admin_enables_it(mode: str) -> None:
    assert "annotations" not in _pod(render_lora_finetune(body(), SETTINGS)[1])["metadata"]
    settings = OperatorSettings.model_validate({"topologyAwareScheduling": {"mode": mode, "level": "cloud.google.com/gce-topology-block"}})
    _, js = render_lora_finetune(body(tpu={"capacity": {"type": "spot"}}), settings)
    assert _pod(js)["metadata"]["annotations"] == {f"kueue.x-k8s.io/podset-{mode}-topology": "cloud.google.com/gce-topology-block"}
    assert _schema_errors(js) == []


OVERLAY = {
    "nodeSelector": {"cloud.google.com/gke-nodepool": "tpu-v5p-pool"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
    "volumes": [
        {"name": "gcs-cache", "csi": {"driver": "gcsfuse.csi.storage.gke.io", "volumeAttributes": {"bucketName": "acme-ml"}}},
        {"name": "local-ssd", "ephemeral": {"volumeClaimTemplate": {"spec": {
            "accessModes": ["ReadWriteOnce"], "storageClassName": "local-ssd", "resources": {"requests": {"storage": "375Gi"}}}}}},
    ],
    "volumeMounts": [{"name": "gcs-cache", "mountPath": "/gcs", "readOnly": True}, {"name": "local-ssd", "mountPath": "/scratch"}],
    "annotations": {"gke-gcsfuse/volumes": "true"},
    "labels": {"cost-centre": "ml-research"},
}


def test_the_admin_overlay_is_added_to_every_trainer_pod() -> None:
    settings = OperatorSettings.model_validate({"podTemplateOverlay": OVERLAY})
    _, plain = render_lora_finetune(body(tpu={"capacity": {"type": "spot"}}), OperatorSettings())
    _, js = render_lora_finetune(body(tpu={"capacity": {"type": "spot"}}), settings)
    assert _schema_errors(js) == []
    before, after = _pod(plain), _pod(js)
    assert after["spec"]["nodeSelector"] == {**before["spec"]["nodeSelector"], **OVERLAY["nodeSelector"]}
    assert after["spec"]["tolerations"] == [*before["spec"]["tolerations"], *OVERLAY["tolerations"]]
    assert after["spec"]["volumes"] == [*before["spec"]["volumes"], *OVERLAY["volumes"]]
    (trainer,), (trainer_before,) = after["spec"]["containers"], before["spec"]["containers"]
    assert trainer["volumeMounts"] == [*trainer_before["volumeMounts"], *OVERLAY["volumeMounts"]]
    assert after["metadata"]["annotations"] == OVERLAY["annotations"]
    assert after["metadata"]["labels"] == {**OVERLAY["labels"], **before["metadata"]["labels"]}
    # Nothing else changes: not the security context, not the JobSet around the pods.
    assert after["spec"]["securityContext"] == before["spec"]["securityContext"]
    assert trainer["securityContext"] == trainer_before["securityContext"]
    stripped = copy.deepcopy(js)
    stripped["spec"]["replicatedJobs"][0]["template"]["spec"]["template"] = before
    assert stripped == plain
