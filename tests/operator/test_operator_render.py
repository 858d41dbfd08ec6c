"""Rendering: every JobSet validates against the real JobSet v0.12.0 CRD schema; Jobs and the
ConfigMap carry exactly what the trainer and the platform need."""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from jobset_controller import PodEnd, after_pod_failure, job_failure, jobset_action

from lora_operator.cli import main as cli_main
from lora_operator.render import (
    InvalidSpec,
    Owner,
    render_all,
    render_conversion_job,
    render_export_jobs,
    render_lora_finetune,
)
from lora_operator.api import AdapterConversionSpec, LoraFinetuneSpec
from lora_operator.settings import OperatorSettings
from lora_operator.tpu import CATALOG, slice_shape
from lora_trainer import exit_codes
from lora_trainer.config import TrainConfig

REFERENCE = Path(__file__).resolve().parents[2] / ".." / "shared" / "reference"
SETTINGS = OperatorSettings()
#: A platform whose admin allows the service account, priority class and token Secret the tests name.
PLATFORM = OperatorSettings(allowed_service_accounts=["trainer-ksa"], allowed_priority_classes=["high"],
                            allowed_token_secrets=["hf-secret"])


def _to_draft4(node: Any) -> Any:
    """The CRD's structural schema as plain JSON Schema: int-or-string -> integer|string, no
    x-kubernetes-*, and strict objects.

    Strict because the API server prunes what a structural schema does not declare: a misspelt
    or misplaced field in a JobSet would be dropped silently, so here it is an error (an object
    with declared properties takes no others unless it preserves unknown fields).
    """
    if isinstance(node, list):
        return [_to_draft4(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _to_draft4(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("anyOf", None)
        out["type"] = ["integer", "string"]
    if "properties" in node and "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@cache
def jobset_validator() -> jsonschema.Draft4Validator:
    crd = yaml.safe_load((REFERENCE / "jobset.x-k8s.io_jobsets.v0.12.0.yaml").read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2")
    return jsonschema.Draft4Validator(_to_draft4(version["schema"]["openAPIV3Schema"]))


def body(name: str = "run-1", **spec: Any) -> dict[str, Any]:
    base = {
        "model": {"source": "gs://models-bucket/llama"},
        "dataset": {"train": "gs://data-bucket/train.jsonl"},
        "output": {"uri": "gs://runs-bucket/run-1"},
    }
    base.update(spec)
    return {
        "apiVersion": "lora-operator.dev/v1alpha1",
        "kind": "LoraFinetune",
        "metadata": {"name": name, "namespace": "ml", "uid": "uid-1"},
        "spec": base,
    }


MATRIX = [(t, topo, s) for t, entry in CATALOG.items() for topo in entry.topologies[:4] + entry.topologies[-1:] for s in (1, 2, 4)]


@pytest.mark.parametrize(("tpu_type", "topology", "slices"), MATRIX)
def test_jobset_validates_against_jobset_crd(tpu_type, topology, slices):
    cm, js = render_lora_finetune(body(tpu={"type": tpu_type, "topology": topology, "slices": slices}), SETTINGS)
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in jobset_validator().iter_errors(js)]
    assert errors == []
    shape = slice_shape(tpu_type, topology)
    rjob = js["spec"]["replicatedJobs"][0]
    assert rjob["replicas"] == slices
    job = rjob["template"]["spec"]
    assert job["parallelism"] == job["completions"] == shape.hosts
    assert job["completionMode"] == "Indexed" and job["backoffLimit"] == 0
    pod = job["template"]["spec"]
    limits = pod["containers"][0]["resources"]["limits"]
    assert limits["google.com/tpu"] == str(shape.chips_per_host)
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": CATALOG[tpu_type].accelerator,
        "cloud.google.com/gke-tpu-topology": topology,
    }
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["JAX_PROCESS_COUNT"]["value"] == str(shape.hosts * slices)
    assert env["JAX_COORDINATOR_ADDRESS"]["value"] == "run-1-slice-0-0.run-1:8476"
    assert ("MEGASCALE_NUM_SLICES" in env) == (slices > 1)


def test_the_jobset_schema_check_catches_misspelt_and_misplaced_fields():
    """The API server would prune these silently; the check must not accept them."""
    _, js = render_lora_finetune(body(), SETTINGS)
    pod = lambda j: j["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]  # noqa: E731
    misspelt, misplaced = copy.deepcopy(js), copy.deepcopy(js)
    pod(misspelt)["nodeSelecter"] = pod(misspelt).pop("nodeSelector")
    pod(misplaced)["readOnlyRootFilesystem"] = True
    for bad, field in ((misspelt, "nodeSelecter"), (misplaced, "readOnlyRootFilesystem")):
        assert any(field in e.message for e in jobset_validator().iter_errors(bad)), field
    assert list(jobset_validator().iter_errors(js)) == []


def test_single_chip_topology_has_one_chip_per_host():
    _, js = render_lora_finetune(body(tpu={"type": "v6e", "topology": "1x1"}), SETTINGS)
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["google.com/tpu"] == "1"


@pytest.mark.parametrize(
    ("pod", "action"),
    [
        (PodEnd(exit_codes.PREEMPTED), "RestartJobSetAndIgnoreMaxRestarts"),  # saved on SIGTERM
        (PodEnd(137, disrupted=True), "RestartJobSetAndIgnoreMaxRestarts"),  # preempted, killed
        (PodEnd(exit_codes.USER_ERROR, disrupted=True), "RestartJobSetAndIgnoreMaxRestarts"),  # the disruption decides
        (PodEnd(exit_codes.USER_ERROR), "FailJobSet"),
        (PodEnd(1), "FailJobSet"),  # a crash outside the table
        (PodEnd(exit_codes.RETRIABLE), "RestartJobSet"),  # a storage outage counts
        (PodEnd(137), "RestartJobSet"),  # killed without a disruption (e.g. the kernel's OOM kill)
        (PodEnd(exit_codes.INTERRUPTED), "RestartJobSet"),
    ],
)
def test_failure_policies_restart_preemptions_without_counting(pod: PodEnd, action: str):
    """What the Job and JobSet controllers do with each way a trainer pod can end, from the rendered policies."""
    _, js = render_lora_finetune(body(maxRestarts=7), SETTINGS)
    fp = js["spec"]["failurePolicy"]
    assert fp["maxRestarts"] == 7 and fp["restartStrategy"] == "BlockingRecreate"
    job = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert jobset_action(fp, *job_failure(job, pod)) == action


def test_only_counted_restarts_use_up_max_restarts():
    _, js = render_lora_finetune(body(maxRestarts=1), SETTINGS)
    for _ in range(5):
        js["status"] = after_pod_failure(js, PodEnd(137, disrupted=True))
    assert js["status"] == {"restarts": 5, "restartsCountTowardsMax": 0}
    js["status"] = after_pod_failure(js, PodEnd(exit_codes.RETRIABLE))
    assert js["status"] == {"restarts": 6, "restartsCountTowardsMax": 1}
    js["status"] = after_pod_failure(js, PodEnd(exit_codes.RETRIABLE))
    assert js["status"]["conditions"][0]["reason"] == "ReachedMaxRestarts"


def test_jobset_platform_details():
    _, js = render_lora_finetune(
        body(queueName="team-q", priorityClassName="high", serviceAccountName="trainer-ksa",
             hfTokenSecretRef={"name": "hf-secret", "key": "tok"}, env=[{"name": "FOO", "value": "bar"}]),
        PLATFORM,
    )
    meta = js["metadata"]
    assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "team-q"
    assert meta["annotations"]["alpha.jobset.sigs.k8s.io/exclusive-topology"] == "cloud.google.com/gke-nodepool"
    assert meta["ownerReferences"] == [
        {"apiVersion": "lora-operator.dev/v1alpha1", "kind": "LoraFinetune", "name": "run-1", "uid": "uid-1",
         "controller": True, "blockOwnerDeletion": True}
    ]
    assert meta["labels"]["lora-operator.dev/lorafinetune"] == "run-1"
    assert js["spec"]["ttlSecondsAfterFinished"] == 86400
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "high" and pod["serviceAccountName"] == "trainer-ksa"
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["tolerations"] == [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    assert pod["restartPolicy"] == "Never" and pod["automountServiceAccountToken"] is False
    c = pod["containers"][0]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    env = {e["name"]: e for e in c["env"]}
    assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-secret", "key": "tok"}}}
    assert env["FOO"]["value"] == "bar"
    assert env["LORA_JOB_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['jobset.sigs.k8s.io/job-index']"


def test_host_network_follows_settings_and_defaults_apply():
    s = OperatorSettings(allow_host_network=False, default_tpu_type="v6e", default_queue_name="default-q")
    _, js = render_lora_finetune(body(), s)
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert "hostNetwork" not in pod and "dnsPolicy" not in pod
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu-v6e-slice"
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "1x1"
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "default-q"
    assert jobset_validator().is_valid(js)


def test_config_map_is_the_train_config_and_holds_no_secret():
    b = body(hfTokenSecretRef={"name": "hf-secret"}, lora={"rank": 4})
    cm, _ = render_lora_finetune(b, PLATFORM)
    cfg = json.loads(cm["data"]["config.json"])
    assert TrainConfig.model_validate(cfg) == LoraFinetuneSpec.model_validate(b["spec"]).train_config()
    assert cfg["lora"]["rank"] == 4
    assert "hf-secret" not in cm["data"]["config.json"] and "tpu" not in cfg
    assert cm["metadata"]["name"] == "run-1-config"


def test_disallowed_image_is_refused_naming_the_field_and_allowlist():
    with pytest.raises(InvalidSpec, match=r"spec.image.*ghcr.io/lora-operator/lora-trainer") as e:
        render_lora_finetune(body(image="docker.io/evil/miner:1"), SETTINGS)
    assert e.value.field == "spec.image"
    _, js = render_lora_finetune(body(image="ghcr.io/lora-operator/lora-trainer:dev"), SETTINGS)
    assert js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":dev")


def test_topology_errors_list_valid_ones():
    with pytest.raises(InvalidSpec, match="use one of 2x2x1, 2x2x2"):
        render_lora_finetune(body(tpu={"topology": "3x3x3"}), SETTINGS)
    with pytest.raises(InvalidSpec, match="metadata.name"):
        render_lora_finetune(body(name="x" * 41), SETTINGS)


def test_export_jobs():
    b = body(output={"uri": "gs://runs-bucket/r/", "export": {"hfPeft": True, "merged": True}})
    owner = Owner.from_body(b)
    jobs = render_export_jobs(owner, LoraFinetuneSpec.model_validate(b["spec"]), SETTINGS)
    commands = [j["spec"]["template"]["spec"]["containers"][0]["command"] for j in jobs]
    assert commands == [
        ["lora-trainer", "export", "--checkpoint", "gs://runs-bucket/r/checkpoints", "--out", "gs://runs-bucket/r/hf-adapter"],
        ["lora-trainer", "export", "--checkpoint", "gs://runs-bucket/r/checkpoints", "--merged", "--out", "gs://runs-bucket/r/merged"],
    ]
    assert [j["metadata"]["name"] for j in jobs] == ["run-1-export", "run-1-export-merged"]
    for j in jobs:
        assert j["apiVersion"] == "batch/v1" and j["spec"]["backoffLimit"] == 0
        pod = j["spec"]["template"]["spec"]
        assert pod["restartPolicy"] == "Never"
        assert pod["containers"][0]["resources"] == SETTINGS.export_resources.to_wire()
        assert j["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    none = copy.deepcopy(b)
    none["spec"]["output"]["export"] = {"hfPeft": False, "merged": False}
    assert render_export_jobs(owner, LoraFinetuneSpec.model_validate(none["spec"]), SETTINGS) == []


def test_conversion_job():
    spec = {
        "source": {"uri": "gs://bkt1/adapter", "format": "orbax"},
        "target": {"uri": "gs://bkt1/merged", "format": "hf-peft"},
        "model": {"source": "gs://bkt1/base", "family": "qwen3"},
        "merged": True,
    }
    b = {"kind": "AdapterConversion", "metadata": {"name": "c1", "namespace": "ml", "uid": "u2"}, "spec": spec}
    job = render_conversion_job(Owner.from_body(b), AdapterConversionSpec.model_validate(spec), SETTINGS)
    assert job["spec"]["template"]["spec"]["containers"][0]["command"] == [
        "lora-trainer", "convert", "--from", "orbax", "--to", "hf-peft", "--source", "gs://bkt1/adapter",
        "--out", "gs://bkt1/merged", "--base", "gs://bkt1/base", "--family", "qwen3", "--merged",
    ]
    assert job["metadata"]["name"] == "c1-convert"
    assert job["metadata"]["labels"]["lora-operator.dev/adapterconversion"] == "c1"
    assert [m["kind"] for m in render_all(b, SETTINGS)] == ["Job"]


def test_render_command_prints_a_yaml_stream(tmp_path, capsys):
    cr = tmp_path / "cr.yaml"
    cr.write_text(yaml.safe_dump(body(tpu={"type": "v5e", "topology": "4x4", "slices": 2})))
    assert cli_main(["render", "-f", str(cr)]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in docs] == ["ConfigMap", "JobSet", "Job"]
    assert jobset_validator().is_valid(docs[1])
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(body(tpu={"type": "v5e", "topology": "2x2x2"})))
    assert cli_main(["render", "-f", str(bad)]) == 2
    assert "spec.tpu.topology" in capsys.readouterr().err


def test_invalid_uri_message_names_the_field_and_the_allowed_forms():
    with pytest.raises(InvalidSpec, match=r"spec.model.source: 's3://b/m' is not a supported location; use .*hf://ORG/NAME"):
        render_lora_finetune(body(model={"source": "s3://b/m"}), SETTINGS)


@pytest.mark.parametrize(("tpu_type", "topology", "slices"), [("v5p", "2x2x2", 2), ("v5e", "4x4", 3), ("v6e", "1x1", 1)])
def test_rendered_env_gives_every_pod_a_distinct_jax_process_id(tpu_type, topology, slices):
    """The seam with lora_trainer.distributed: resolve the downward API as the kubelet would."""
    from lora_trainer.distributed import cluster_env

    _, js = render_lora_finetune(body(tpu={"type": tpu_type, "topology": topology, "slices": slices}), SETTINGS)
    rjob = js["spec"]["replicatedJobs"][0]
    hosts = rjob["template"]["spec"]["completions"]
    env = rjob["template"]["spec"]["template"]["spec"]["containers"][0]["env"]
    ids = set()
    for job_index in range(rjob["replicas"]):
        for completion in range(hosts):
            labels = {"jobset.sigs.k8s.io/job-index": str(job_index), "jobset.sigs.k8s.io/replicatedjob-replicas": str(slices)}
            annotations = {"batch.kubernetes.io/job-completion-index": str(completion)}
            resolved = {}
            for e in env:
                if "value" in e:
                    resolved[e["name"]] = e["value"]
                elif "fieldRef" in e.get("valueFrom", {}):
                    path = e["valueFrom"]["fieldRef"]["fieldPath"]
                    source, key = path.split("[", 1)
                    key = key.strip("]'")
                    resolved[e["name"]] = (labels if source == "metadata.labels" else annotations)[key]
            c = cluster_env(resolved)
            assert c.kind == "explicit" and c.process_count == hosts * slices
            assert c.coordinator == "run-1-slice-0-0.run-1:8476"
            ids.add(c.process_id)
    assert ids == set(range(hosts * slices))
