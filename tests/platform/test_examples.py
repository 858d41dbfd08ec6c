"""The shipped examples: every manifest renders into valid objects, and the GKE ones come out as
the slices they promise. The demo dataset is exactly what its generator writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import k8s_schemas
from rendered import EXAMPLES, LOCAL_DEMO, MANIFESTS, render, render_command
from lora_operator.api import LoraFinetuneSpec
from lora_operator.tpu import CATALOG
from lora_trainer.config import TrainConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
from test_operator_render import jobset_validator  # noqa: E402  (the JobSet v0.12.0 schema helper)


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def env_names(jobset: dict[str, Any]) -> set[str]:
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    return {e["name"] for e in pod["containers"][0]["env"]}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_example_renders_to_valid_objects(path: Path) -> None:
    objs = render(path)
    assert objs
    for obj in objs:
        if obj["kind"] == "JobSet":
            errors = [f"{list(e.absolute_path)}: {e.message}" for e in jobset_validator().iter_errors(obj)]
            assert errors == [], f"{path.name}: JobSet invalid"
        else:
            k8s_schemas.validate(obj)
    source = yaml.safe_load(path.read_text())
    if source["kind"] == "LoraFinetune":
        (cm,) = by_kind(objs, "ConfigMap")
        shipped = TrainConfig.model_validate(json.loads(cm["data"]["config.json"]))
        assert shipped == LoraFinetuneSpec.model_validate(source["spec"]).train_config()
        assert by_kind(objs, "Job"), "the post-training export Job is part of the rendered children"


def test_the_local_demo_is_refused_in_a_cluster() -> None:
    """Its relative paths name nothing in a trainer pod: the cluster render refuses them, naming each
    field (run-local runs it; tests/platform/test_local_e2e.py)."""
    rc, out, err = render_command(LOCAL_DEMO)
    assert rc == 2 and out == ""
    for field in ("spec.model.source", "spec.dataset.train", "spec.dataset.eval", "spec.output.uri"):
        assert f"{field}: " in err, (field, err)
    assert "gs://BUCKET/PATH" in err


def _slice(objs: list[dict[str, Any]]) -> tuple[int, dict[str, Any], dict[str, Any]]:
    (jobset,) = by_kind(objs, "JobSet")
    rjob = jobset["spec"]["replicatedJobs"][0]
    job = rjob["template"]["spec"]
    return rjob["replicas"], job, job["template"]["spec"]


def test_llama31_8b_runs_on_one_v5p_2x2x2_slice() -> None:
    objs = render(EXAMPLES / "gke" / "llama31-8b-v5p.yaml")
    replicas, job, pod = _slice(objs)
    assert replicas == 1 and job["parallelism"] == job["completions"] == 2  # 8 chips / 4 per host
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": CATALOG["v5p"].accelerator, "cloud.google.com/gke-tpu-topology": "2x2x2"}
    assert pod["containers"][0]["resources"]["limits"]["google.com/tpu"] == "4"
    assert pod["serviceAccountName"] == "lora-trainer"
    assert by_kind(objs, "JobSet")[0]["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "tpu-v5p"


def test_qwen3_runs_on_two_v6e_4x4_slices_with_megascale() -> None:
    objs = render(EXAMPLES / "gke" / "qwen3-v6e-multislice.yaml")
    replicas, job, pod = _slice(objs)
    assert replicas == 2 and job["parallelism"] == 4
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu-v6e-slice"
    assert pod["nodeSelector"]["cloud.google.com/gke-spot"] == "true"  # spot capacity, preemptions not counted
    assert {n for n in env_names(by_kind(objs, "JobSet")[0]) if n.startswith("MEGASCALE_")} >= {"MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID", "MEGASCALE_COORDINATOR_ADDRESS"}
    hf_token = next(e for e in pod["containers"][0]["env"] if e["name"] == "HF_TOKEN")
    assert hf_token["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    # merged export asked: two export Jobs, adapter and merged model.
    outs = sorted(j["spec"]["template"]["spec"]["containers"][0]["command"][-1] for j in by_kind(objs, "Job"))
    assert outs == ["gs://acme-ml-runs/qwen3-8b-multislice/hf-adapter", "gs://acme-ml-runs/qwen3-8b-multislice/merged"]


def test_qlora_example_quantizes_the_base_to_nf4() -> None:
    objs = render(EXAMPLES / "gke" / "qlora-llama31-70b-v5p.yaml")
    (cm,) = by_kind(objs, "ConfigMap")
    quant = json.loads(cm["data"]["config.json"])["lora"]["quantization"]
    assert quant == {"weightQtype": "nf4", "tileSize": 64}
    _, job, _ = _slice(objs)
    assert job["parallelism"] == 8  # v5p 2x4x4 = 32 chips / 4 per host


def test_adapter_conversion_example_renders_one_convert_job() -> None:
    (job,) = render(EXAMPLES / "gke" / "adapter-conversion.yaml")
    assert job["kind"] == "Job"
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["lora-trainer", "convert"]
    assert command[command.index("--from") + 1] == "hf-peft" and command[command.index("--to") + 1] == "orbax"


def test_demo_dataset_is_what_its_generator_writes() -> None:
    subprocess.run([sys.executable, str(EXAMPLES / "data" / "make_dataset.py"), "--check"], check=True)
    for name, n in (("train.jsonl", 400), ("eval.jsonl", 40)):
        rows = [json.loads(line) for line in (EXAMPLES / "data" / name).read_text().splitlines()]
        assert len(rows) == n
        assert all(set(r) == {"prompt", "completion"} and r["prompt"] and r["completion"] for r in rows)


def test_demo_manifest_points_at_the_shipped_data() -> None:
    spec = LoraFinetuneSpec.model_validate(yaml.safe_load((EXAMPLES / "lora-finetune.yaml").read_text())["spec"])
    assert (EXAMPLES / spec.dataset.train).is_file() and (EXAMPLES / spec.dataset.eval).is_file()
    assert spec.model.source == "tiny-llama"  # written by `make tiny-model`
