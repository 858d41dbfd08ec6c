"""Every declared cross-field rule (`lora_trainer.rules.Rule`) says the same thing on both sides.

For a table of valid and invalid objects per rule: the CEL the generated CRD carries at the
model's schema node (evaluated with cel-python, on the object as the API server holds it, defaults
applied) and the pydantic models accept and refuse the same ones, naming the same fields with the
same messages. Every declared rule must have a valid and an invalid case here. For whole specs,
`kubectl apply` (the API server) and the operator or run-local print the same lines.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from crdcheck import apply_defaults, cel_holds, open_api_schema, validate
from pydantic import BaseModel, ValidationError

from lora_operator.api import AdapterConversionSpec, CapacitySpec, EnvVar, LoraFinetuneSpec, TpuSpec
from lora_operator.tpu import CATALOG
from lora_trainer.config import ApiModel, LoraSpec, OutputSpec, QuantizationSpec, TrainConfig, TrainingSpec, validation_problems
from lora_trainer.rules import RULE_ERROR, declared_rules

LFT, ADC = "lorafinetunes", "adapterconversions"
TRAIN = {"model": {"source": "gs://models-bucket/llama"}, "dataset": {"train": "gs://data-bucket/train.jsonl"},
         "output": {"uri": "gs://runs-bucket/run"}}
CONVERT = {"source": {"uri": "gs://runs-bucket/run/hf-adapter", "format": "hf-peft"},
           "target": {"uri": "gs://runs-bucket/run/orbax", "format": "orbax"}, "model": {"source": "gs://models-bucket/llama"}}
#: Rules that a field's own type also enforces (a bound, a pattern): pydantic stops at the field,
#: so their `check` is compared with the CEL on an unvalidated model (`model_construct`).
SHADOWED = {(LoraSpec, "rank"), (OutputSpec, "uri")}

#: (CRD, schema node of the model, model, object at that node, fields of the rules it breaks).
CASES: list[tuple[str, str, type[BaseModel], dict[str, Any], tuple[str, ...]]] = [
    *((LFT, "spec.tpu", TpuSpec, {"type": t.name, "topology": t.topologies[0]}, ()) for t in CATALOG.values()),
    *((LFT, "spec.tpu", TpuSpec, {"type": t.name, "topology": "3x3"}, ("topology",)) for t in CATALOG.values()),
    (LFT, "spec.tpu", TpuSpec, {"topology": "3x3"}, ()),  # no type: the operator's default type decides
    (LFT, "spec.tpu", TpuSpec, {"type": "v5p"}, ()),
    (LFT, "spec.tpu.capacity", CapacitySpec, {}, ()),
    (LFT, "spec.tpu.capacity", CapacitySpec, {"type": "reservation", "reservation": {"name": "res-1"}}, ()),
    (LFT, "spec.tpu.capacity", CapacitySpec, {"type": "reservation"}, ("reservation",)),
    (LFT, "spec.tpu.capacity", CapacitySpec, {"type": "spot", "reservation": {"name": "res-1"}}, ("reservation",)),
    (LFT, "spec.tpu.capacity", CapacitySpec, {"type": "flexStart", "flexStart": {}}, ()),
    (LFT, "spec.tpu.capacity", CapacitySpec, {"type": "spot", "flexStart": {}}, ("flexStart",)),
    (LFT, "spec.tpu.capacity", CapacitySpec, {"type": "reservation", "flexStart": {}}, ("reservation", "flexStart")),
    (LFT, "spec.lora", LoraSpec, {"rank": 8}, ()),
    (LFT, "spec.lora", LoraSpec, {"rank": 0}, ("rank",)),
    (LFT, "spec.lora.quantization", QuantizationSpec, {"weightQtype": "nf4"}, ()),
    *((LFT, "spec.lora.quantization", QuantizationSpec, {"weightQtype": "nf4", "tileSize": n}, ()) for n in (1, 64, 4096)),
    *((LFT, "spec.lora.quantization", QuantizationSpec, {"weightQtype": "nf4", "tileSize": n}, ("tileSize",)) for n in (3, 48, 4095)),
    (LFT, "spec.training", TrainingSpec, {}, ()),
    (LFT, "spec.training", TrainingSpec, {"globalBatchSize": 8, "gradientAccumulation": 4}, ()),
    (LFT, "spec.training", TrainingSpec, {"globalBatchSize": 6, "gradientAccumulation": 4}, ("globalBatchSize",)),
    (LFT, "spec.training", TrainingSpec, {"gradientAccumulation": 3}, ("globalBatchSize",)),  # against the default 8
    (LFT, "spec.output", OutputSpec, {"uri": "gs://runs-bucket/run"}, ()),
    (LFT, "spec.output", OutputSpec, {"uri": "hf://org/model"}, ("uri",)),
    (LFT, "spec.env[]", EnvVar, {"name": "MY_HF_ENDPOINT_NOTE"}, ()),
    *((LFT, "spec.env[]", EnvVar, {"name": name}, ("name",)) for name in ("HF_TOKEN", "https_proxy", "PYTHONPATH", "Path")),
    # TrainConfig's rules are the spec's: the trainer's config file and the CR say the same.
    *((LFT, "spec", model, {**TRAIN, "training": {"evalEvery": 10}}, ("training.evalEvery",)) for model in (TrainConfig, LoraFinetuneSpec)),
    *((LFT, "spec", model, {**TRAIN, "dataset": {**TRAIN["dataset"], "eval": "gs://data-bucket/eval.jsonl"},
                            "training": {"evalEvery": 10}}, ()) for model in (TrainConfig, LoraFinetuneSpec)),
    (ADC, "spec", AdapterConversionSpec, CONVERT, ()),
    (ADC, "spec", AdapterConversionSpec, {**CONVERT, "merged": True, "source": {**CONVERT["source"], "format": "orbax"},
                                          "target": {"uri": "gs://runs-bucket/run/merged", "format": "hf-peft"}}, ()),
    (ADC, "spec", AdapterConversionSpec, {**CONVERT, "merged": True}, ("merged",)),
    (ADC, "spec", AdapterConversionSpec, {**CONVERT, "target": {**CONVERT["target"], "format": "hf-peft"}}, ("target.format",)),
    (ADC, "spec", AdapterConversionSpec, {**CONVERT, "target": {**CONVERT["target"], "uri": "hf://org/adapter"}}, ("target.uri",)),
    *((ADC, "spec", AdapterConversionSpec, {**CONVERT, "target": {**CONVERT["target"], "uri": uri}}, ("target.uri",))
      for uri in ("gs://runs-bucket/run/hf-adapter/", "gs://runs-bucket/run/hf-adapter/orbax", "gs://runs-bucket/run")),
    (ADC, "spec", AdapterConversionSpec, {**CONVERT, "target": {**CONVERT["target"], "uri": "gs://runs-bucket/run/hf-adapter-orbax"}}, ()),
    (ADC, "spec", AdapterConversionSpec, {**CONVERT, "merged": True, "target": {"uri": "hf://org/a", "format": "hf-peft"}},
     ("target.uri", "target.format")),
]


def _node(plural: str, path: str) -> dict[str, Any]:
    """The schema node at a dotted path of the CRD (`x[]`: the items of list `x`)."""
    node = open_api_schema(plural)
    for part in path.split("."):
        node = node["properties"][part.removesuffix("[]")]
        node = node["items"] if part.endswith("[]") else node
    return node


def _cel_failures(plural: str, path: str, obj: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, message) of each rule at the node that the object, defaulted as the API server does, breaks."""
    node = _node(plural, path)
    obj = apply_defaults(node, copy.deepcopy(obj))
    return [(r["fieldPath"].lstrip("."), r["message"]) for r in node.get("x-kubernetes-validations", [])
            if "oldSelf" not in r["rule"] and not cel_holds(r["rule"], obj)]


def _pydantic_failures(model: type[BaseModel], obj: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, message) of each broken rule pydantic reports; any other error fails the test."""
    shadowed = [r for r in declared_rules(model) if (model, r.field) in SHADOWED]
    try:
        model.model_validate(obj)
    except ValidationError as e:
        rules = [(".".join(map(str, err["loc"])), err["msg"]) for err in e.errors() if err["type"] == RULE_ERROR]
        others = {".".join(map(str, err["loc"])) for err in e.errors() if err["type"] != RULE_ERROR}
        unchecked = model.model_construct(**obj)
        assert others <= {r.field for r in shadowed}, e
        return rules + [(r.field, r.message) for r in shadowed if r.field in others and not r.check(unchecked)]
    return []


@pytest.mark.parametrize(("plural", "path", "model", "obj", "broken"), CASES,
                         ids=[f"{m.__name__}-{i}" for i, (_, _, m, _, _) in enumerate(CASES)])
def test_cel_and_pydantic_refuse_the_same_objects_with_the_same_message(plural, path, model, obj, broken):
    cel = _cel_failures(plural, path, obj)
    assert sorted(field for field, _ in cel) == sorted(broken)
    assert _pydantic_failures(model, obj) == cel


def _models_with_rules() -> set[type[BaseModel]]:
    todo, found = [ApiModel], set()
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if declared_rules(cls):
            found.add(cls)
    return found


def test_every_declared_rule_has_a_valid_and_an_invalid_case():
    assert {model for _, _, model, _, _ in CASES} == _models_with_rules()
    refused = {(model, message) for plural, path, model, obj, _ in CASES for _, message in _cel_failures(plural, path, obj)}
    untested = [rule.message for model in _models_with_rules() for rule in declared_rules(model) if (model, rule.message) not in refused]
    assert untested == []
    assert all(any(m is model and not broken for _, _, m, _, broken in CASES) for model in _models_with_rules())


#: Whole specs, as a user applies them: (CRD, model, spec). One model's rules broken in each: pydantic
#: runs a model's rules once its fields are valid, so a broken rule in `spec.training` hides the
#: spec's own until it is fixed, where the API server reports them all at once.
WHOLE = [
    (LFT, LoraFinetuneSpec, {**TRAIN, "training": {"globalBatchSize": 6, "gradientAccumulation": 4}}),
    (LFT, LoraFinetuneSpec, {**TRAIN, "training": {"evalEvery": 5}}),
    (LFT, LoraFinetuneSpec, {**TRAIN, "tpu": {"type": "v5e", "topology": "2x2x2"}}),
    (LFT, LoraFinetuneSpec, {**TRAIN, "tpu": {"capacity": {"type": "reservation", "flexStart": {}}}}),
    (LFT, LoraFinetuneSpec, {**TRAIN, "env": [{"name": "OK", "value": "1"}, {"name": "hf_token", "value": "x"}]}),
    (ADC, AdapterConversionSpec, {**CONVERT, "merged": True, "target": {"uri": "gs://runs-bucket/run", "format": "orbax"}}),
]


@pytest.mark.parametrize(("plural", "model", "spec"), WHOLE)
def test_kubectl_and_the_operator_report_a_broken_rule_alike(plural, model, spec):
    """`kubectl apply` (the API server's `field: Invalid value: message`) and the operator or
    run-local (`validation_problems`, `field: message`) name the same fields in the same words."""
    _, errors = validate(plural, {"apiVersion": "lora-operator.dev/v1alpha1", "kind": model.__name__, "metadata": {"name": "x"},
                                  "spec": spec})
    with pytest.raises(ValidationError) as e:
        model.model_validate(spec)
    problems = validation_problems(e.value, "spec.")
    server = [err.replace(": Invalid value:", ":").replace("[", ".").replace("]", "") for err in errors]
    assert errors and len(errors) == e.value.error_count() and all(text in problems for text in server), (server, problems)
