"""The generated CRDs: committed YAML up to date, structural, in agreement with the models and
the trainer config, and rejecting a corpus of bad specs (schema + CEL, as the API server would)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from crdcheck import apply_defaults, open_api_schema, prune, validate
from pydantic import ValidationError

from lora_operator import crdgen
from lora_operator.api import AdapterConversionSpec, LoraFinetuneSpec
from lora_operator.cli import main as cli_main
from lora_trainer.config import TrainConfig

GOOD_LFT: dict[str, Any] = {
    "model": {"source": "gs://models-bucket/llama-3.2-1b"},
    "dataset": {"train": "gs://data-bucket/train.jsonl"},
    "output": {"uri": "gs://runs-bucket/run-1"},
    "tpu": {"type": "v5p", "topology": "2x2x2", "slices": 2},
}
GOOD_ADC: dict[str, Any] = {
    "source": {"uri": "gs://runs-bucket/run-1/hf-adapter", "format": "hf-peft"},
    "target": {"uri": "gs://runs-bucket/run-1/orbax", "format": "orbax"},
    "model": {"source": "gs://models-bucket/llama-3.2-1b"},
}


def _cr(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "lora-operator.dev/v1alpha1", "kind": kind, "metadata": {"name": "x"}, "spec": spec}


def test_committed_crds_match_the_models():
    root = Path(__file__).resolve().parents[2]
    assert crdgen.check_or_write([root / "crds"], check=True) == 0, "run `lora-operator crds` and commit crds/"


def test_crds_command_writes_and_check_detects_drift(tmp_path, capsys):
    assert cli_main(["crds", "--out", str(tmp_path / "a"), "--out", str(tmp_path / "b")]) == 0
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == sorted(crdgen.generated_files())
    assert cli_main(["crds", "--check", "--out", str(tmp_path / "a")]) == 0
    f = tmp_path / "a" / "lora-operator.dev_lorafinetunes.yaml"
    f.write_text(f.read_text().replace("shortNames:\n    - lft", "shortNames:\n    - lf"))
    assert cli_main(["crds", "--check", "--out", str(tmp_path / "a")]) == 1
    assert "out of date" in capsys.readouterr().err


def _walk(node: Any, path: str = ""):
    if isinstance(node, dict):
        yield path, node
        for k, v in node.get("properties", {}).items():
            yield from _walk(v, f"{path}.{k}")
        if "items" in node:
            yield from _walk(node["items"], f"{path}[]")


@pytest.mark.parametrize("plural", ["lorafinetunes", "adapterconversions"])
def test_schema_is_structural(plural):
    for path, node in _walk(open_api_schema(plural)):
        assert "type" in node, f"{path} has no type"
        for banned in ("anyOf", "oneOf", "allOf", "$ref", "additionalProperties", "title"):
            assert banned not in node, f"{path} has {banned}"
        if path.count(".") >= 2 and path.startswith(".spec") and not path.endswith("[]"):
            assert node.get("description"), f"{path} has no description"
        if "default" in node:
            assert node["default"] is not None, path


def test_crd_metadata_columns_and_names():
    lft = yaml.safe_load(crdgen.generated_files()["lora-operator.dev_lorafinetunes.yaml"])
    v = lft["spec"]["versions"][0]
    assert v["subresources"] == {"status": {}}
    cols = {c["name"]: c for c in v["additionalPrinterColumns"]}
    assert [c["name"] for c in v["additionalPrinterColumns"]] == [
        "Phase", "TPU", "Step", "Loss", "Restarts", "Preemptions", "Age", "Adapter URI", "Queue", "Capacity"
    ]
    assert cols["Restarts"]["jsonPath"] == ".status.restarts" and cols["Preemptions"]["jsonPath"] == ".status.preemptions"
    assert cols["TPU"]["jsonPath"] == ".status.tpu" and cols["Step"]["jsonPath"] == ".status.progress"
    assert cols["Adapter URI"]["priority"] == 1 and cols["Queue"]["priority"] == 1 and "priority" not in cols["Phase"]
    assert lft["spec"]["names"]["shortNames"] == ["lft"] and lft["spec"]["names"]["categories"] == ["lora"]
    adc = yaml.safe_load(crdgen.generated_files()["lora-operator.dev_adapterconversions.yaml"])
    assert adc["spec"]["names"]["shortNames"] == ["adc"]


def test_every_train_config_field_is_in_the_crd_with_the_same_default():
    """Defaulting {model, dataset, output} through the CRD schema gives exactly the trainer's defaults."""
    spec_schema = open_api_schema("lorafinetunes")["properties"]["spec"]
    minimal = {k: GOOD_LFT[k] for k in ("model", "dataset", "output")}
    defaulted = apply_defaults(spec_schema, copy.deepcopy(minimal))
    trainer_view = {k: v for k, v in defaulted.items() if k in {f.alias or n for n, f in TrainConfig.model_fields.items()}}
    assert trainer_view == TrainConfig.model_validate(minimal).to_wire()
    assert set(spec_schema["properties"]) == {f.alias or n for n, f in LoraFinetuneSpec.model_fields.items()}
    # The whole CR spec defaults the same way in pydantic and in the API server.
    assert defaulted == LoraFinetuneSpec.model_validate(minimal).to_wire()
    assert set(spec_schema["required"]) == {"model", "dataset", "output"}


def test_enums_and_bounds_come_from_the_models():
    s = open_api_schema("lorafinetunes")["properties"]["spec"]["properties"]
    assert s["tpu"]["properties"]["type"]["enum"] == ["v4", "v5e", "v5p", "v6e", "tpu7x"]
    assert s["lora"]["properties"]["rank"]["minimum"] == 1
    alpha = s["lora"]["properties"]["alpha"]
    assert alpha["minimum"] == 0 and alpha["exclusiveMinimum"] is True
    assert s["output"]["properties"]["uri"]["pattern"].startswith("^(gs://")
    assert s["lora"]["properties"]["quantization"]["properties"]["weightQtype"]["enum"] == ["nf4", "int4", "int8", "fp8"]


def test_good_specs_pass_schema_and_cel():
    assert validate("lorafinetunes", _cr("LoraFinetune", GOOD_LFT))[1] == []
    assert validate("adapterconversions", _cr("AdapterConversion", GOOD_ADC))[1] == []
    LoraFinetuneSpec.model_validate(GOOD_LFT)
    AdapterConversionSpec.model_validate(GOOD_ADC)


def _merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in patch.items():
        out[k] = _merge(out.get(k, {}), v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


BAD_LFT: list[tuple[dict[str, Any], str]] = [
    ({"tpu": {"type": "v5e", "topology": "2x2x2"}}, "spec.tpu.topology"),
    ({"tpu": {"type": "v5p", "topology": "4x4"}}, "spec.tpu.topology"),
    ({"tpu": {"type": "v6e", "topology": "3x3"}}, "spec.tpu.topology"),
    ({"tpu": {"type": "v7"}}, "spec.tpu.type"),
    ({"tpu": {"topology": "2x2x2x2"}}, "spec.tpu.topology"),
    ({"tpu": {"slices": 0}}, "spec.tpu.slices"),
    ({"lora": {"rank": 0}}, "spec.lora.rank"),
    ({"lora": {"alpha": 0}}, "spec.lora.alpha"),
    ({"lora": {"dropout": 1.0}}, "spec.lora.dropout"),
    ({"lora": {"quantization": {"weightQtype": "nf4", "tileSize": 48}}}, "spec.lora.quantization.tileSize"),
    ({"lora": {"quantization": {"weightQtype": "int2"}}}, "spec.lora.quantization.weightQtype"),
    ({"lora": {"quantization": {"tileSize": 64}}}, "spec.lora.quantization"),
    ({"model": {"source": "s3://bucket/model"}}, "spec.model.source"),
    ({"dataset": {"train": "ftp://host/train.jsonl"}}, "spec.dataset.train"),
    ({"output": {"uri": "hf://org/model"}}, "spec.output.uri"),
    ({"output": {"uri": "gs://B/upper-case-bucket"}}, "spec.output.uri"),
    ({"training": {"globalBatchSize": 6, "gradientAccumulation": 4}}, "spec.training.globalBatchSize"),
    ({"training": {"evalEvery": 10}}, "spec.training.evalEvery"),
    ({"training": {"steps": 0}}, "spec.training.steps"),
    ({"training": {"schedule": "exponential"}}, "spec.training.schedule"),
    ({"dataset": {"format": "sharegpt"}}, "spec.dataset.format"),
    ({"dataset": {"maxSeqLen": 4}}, "spec.dataset.maxSeqLen"),
    ({"model": {"dtype": "int8"}}, "spec.model.dtype"),
    ({"maxRestarts": -1}, "spec.maxRestarts"),
    ({"env": [{"name": "JAX_PLATFORMS", "value": "cpu"}]}, "spec.env[0].name"),
    ({"env": [{"name": "1BAD", "value": "x"}]}, "spec.env.0.name"),
    # The operator sets these two; a duplicate later in the list would win in Kubernetes.
    ({"env": [{"name": "JOB_COMPLETION_INDEX", "value": "0"}]}, "spec.env[0].name"),
    ({"env": [{"name": "HF_TOKEN", "value": "hf_literal"}]}, "spec.env[0].name"),
    ({"queueName": "Not_A_Queue"}, "spec.queueName"),
    ({"queueName": "q" * 64}, "spec.queueName"),  # it becomes a label value: 63 at most
    ({"serviceAccountName": "UPPER"}, "spec.serviceAccountName"),
    ({"resources": {"limits": {"cpu": "lots"}}}, "spec.resources.limits.cpu"),
    ({"hfTokenSecretRef": {"name": "bad name"}}, "spec.hfTokenSecretRef.name"),
    ({"tpu": {"capacity": {"type": "preemptible"}}}, "spec.tpu.capacity.type"),
    ({"tpu": {"capacity": {"type": "reservation"}}}, "spec.tpu.capacity.reservation"),
    ({"tpu": {"capacity": {"type": "spot", "reservation": {"name": "tpu-res"}}}}, "spec.tpu.capacity.reservation"),
    ({"tpu": {"capacity": {"type": "reservation", "reservation": {"name": "Tpu_Res"}}}}, "spec.tpu.capacity.reservation.name"),
    ({"tpu": {"capacity": {"type": "spot", "flexStart": {}}}}, "spec.tpu.capacity.flexStart"),
    ({"tpu": {"capacity": {"type": "flexStart", "flexStart": {"maxRunDurationSeconds": 604801}}}},
     "spec.tpu.capacity.flexStart.maxRunDurationSeconds"),
]


def _field_named(errors: list[str], field: str) -> bool:
    dotted = field.replace("[", ".").replace("]", "")
    return any(e.startswith(field) or e.replace("[", ".").replace("]", "").startswith(dotted) for e in errors)


@pytest.mark.parametrize(("patch", "field"), BAD_LFT, ids=[f for _, f in BAD_LFT])
def test_bad_lora_finetune_is_rejected_naming_the_field(patch, field):
    _, errors = validate("lorafinetunes", _cr("LoraFinetune", _merge(GOOD_LFT, patch)))
    assert errors, f"{patch} was accepted"
    assert _field_named(errors, field), errors
    # The operator's own models (used when a CR got past an older schema) reject it too.
    with pytest.raises(ValidationError):
        LoraFinetuneSpec.model_validate(_merge(GOOD_LFT, patch))


BAD_ADC: list[tuple[dict[str, Any], str]] = [
    ({"merged": True}, "spec.merged"),
    ({"target": {"uri": "hf://org/adapter", "format": "hf-peft"}}, "spec.target.uri"),
    ({"source": {"format": "lora"}}, "spec.source.format"),
    ({"model": {"family": "mistral"}}, "spec.model.family"),
]


@pytest.mark.parametrize(("patch", "field"), BAD_ADC, ids=[f for _, f in BAD_ADC])
def test_bad_adapter_conversion_is_rejected_naming_the_field(patch, field):
    _, errors = validate("adapterconversions", _cr("AdapterConversion", _merge(GOOD_ADC, patch)))
    assert _field_named(errors, field), errors
    with pytest.raises(ValidationError):
        AdapterConversionSpec.model_validate(_merge(GOOD_ADC, patch))


def test_fields_outside_the_schema_never_reach_a_pod():
    """`resources`/`env` cannot smuggle TPU chips, secrets by value or privileges: the API server prunes
    what the structural schema does not declare (or rejects it under strict field validation)."""
    smuggled = {
        "resources": {"limits": {"cpu": "4", "google.com/tpu": "8"}},
        "env": [{"name": "X", "value": "1", "valueFrom": {"secretKeyRef": {"name": "other", "key": "k"}}}],
        "securityContext": {"privileged": True},
        # The admin's pod overlay is an operator setting; a CR cannot add node selectors or volumes.
        "podTemplateOverlay": {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]},
        "tpu": {"nodeSelector": {"cloud.google.com/gke-nodepool": "someone-elses"}},
    }
    cr = _cr("LoraFinetune", _merge(GOOD_LFT, smuggled))
    assert sorted(prune(open_api_schema("lorafinetunes"), cr)[1]) == [
        "spec.env[0].valueFrom", "spec.podTemplateOverlay", "spec.resources.limits.google.com/tpu", "spec.securityContext",
        "spec.tpu.nodeSelector",
    ]
    obj, errors = validate("lorafinetunes", cr)
    assert errors == []
    spec = LoraFinetuneSpec.model_validate(obj["spec"])
    assert spec.resources.limits.to_wire() == {"cpu": "4"}
    assert [e.to_wire() for e in spec.env] == [{"name": "X", "value": "1"}]


def test_spec_is_immutable_except_suspend():
    old, errors = validate("lorafinetunes", _cr("LoraFinetune", GOOD_LFT))
    assert errors == []
    suspended = _merge(old, {"spec": {"suspend": True}})
    assert validate("lorafinetunes", suspended, old=old)[1] == []
    for patch in ({"spec": {"lora": {"rank": 8}}}, {"spec": {"tpu": {"slices": 4}}}, {"spec": {"image": "x"}}):
        _, errors = validate("lorafinetunes", _merge(old, patch), old=old)
        assert any("immutable" in e or "cannot change" in e for e in errors), patch
    # Adding or removing a whole optional field is caught at the spec level.
    added = _merge(old, {"spec": {"queueName": "late-queue"}})
    assert any("immutable" in e for e in validate("lorafinetunes", added, old=old)[1])
    dropped = copy.deepcopy(old)
    del dropped["spec"]["tpu"]["topology"]
    assert any("spec.tpu cannot change" in e for e in validate("lorafinetunes", dropped, old=old)[1])
