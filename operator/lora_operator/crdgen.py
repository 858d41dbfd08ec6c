"""Generate the CRD YAML in `crds/` from the pydantic API models (one source of truth).

Pydantic's JSON Schema is turned into a Kubernetes *structural* schema: `$ref`s inlined,
`anyOf [X, null]` collapsed to X (optional = not required), JSON-Schema-2020 exclusive bounds
rewritten to OpenAPI v3.0 booleans, titles and `additionalProperties: false` dropped (the API
server prunes unknown fields instead), object/list defaults from `default_factory` emitted as
`{}`/`[]` so the API server fills the nested defaults. Cross-field checks that JSON Schema
cannot express are the models' declared rules (`lora_trainer.rules`): each becomes a CEL rule
(`x-kubernetes-validations`) at the schema node of the model that declares it. Only what the
models have no notion of is written here: a spec's immutability and `env` as a list-map.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from lora_trainer.rules import declared_rules
from lora_operator.api import (
    GROUP,
    VERSION,
    AdapterConversionSpec,
    AdapterConversionStatus,
    LoraFinetuneSpec,
    LoraFinetuneStatus,
)
from lora_operator.generated import write_or_check

Schema = dict[str, Any]

IMMUTABLE_MESSAGE = (
    "spec is immutable once the LoraFinetune exists, except spec.suspend; "
    "delete and recreate the resource (or create a new one) to change it"
)


def _deref(node: Any, defs: Schema) -> Any:
    """Inline every `$ref` (siblings such as description/default override the target's)."""
    if isinstance(node, list):
        return [_deref(x, defs) for x in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
        target.update({k: v for k, v in node.items() if k != "$ref"})
        return _deref(target, defs)
    return {k: _deref(v, defs) for k, v in node.items()}


def _structural(node: Schema) -> Schema:
    """Rewrite one (dereferenced) JSON Schema node into the structural OpenAPI v3.0 subset."""
    node = dict(node)
    any_of = node.pop("anyOf", None)
    if any_of is not None:
        non_null = [b for b in any_of if b.get("type") != "null"]
        if len(non_null) != 1:
            raise ValueError(f"cannot express anyOf {any_of} structurally; use one type per field")
        merged = dict(non_null[0])
        merged.update(node)
        node = merged
    for key in ("title", "additionalProperties"):
        node.pop(key, None)
    if node.get("default", 0) is None:
        del node["default"]
    for bound, inclusive in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(bound), int | float) and not isinstance(node[bound], bool):
            node[inclusive] = node[bound]
            node[bound] = True
    if "properties" in node:
        node["properties"] = {k: _structural(v) for k, v in node["properties"].items()}
        node.setdefault("type", "object")
    if "items" in node:
        node["items"] = _structural(node["items"])
    if "enum" in node and "type" not in node:
        node["type"] = "string"
    return node


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _nested_models(model: type[BaseModel], schema: Schema) -> Iterator[tuple[type[BaseModel], Schema]]:
    """Each field of `model` that holds a model (`X`, `X | None`, `list[X]`), with that model's
    schema node: the field's own, or its `items` for a list."""
    for name, field in model.model_fields.items():
        prop = schema["properties"].get(field.alias or name)
        if prop is None:
            continue
        node = prop.get("items", {}) if prop.get("type") == "array" else prop
        if "properties" not in node:
            continue
        annotation = field.annotation
        for sub in (annotation,) if _is_model(annotation) else getattr(annotation, "__args__", ()):
            if _is_model(sub):
                yield sub, node


def _add_factory_defaults(model: type[BaseModel], schema: Schema) -> None:
    """Give fields with a `default_factory` a `{}`/`[]` default so nested defaults apply server-side."""
    for name, field in model.model_fields.items():
        prop = schema["properties"].get(field.alias or name)
        if prop is not None and field.default_factory is not None:
            prop["default"] = [] if isinstance(field.default_factory(), list) else {}
    for sub, node in _nested_models(model, schema):
        _add_factory_defaults(sub, node)


def _add_declared_rules(model: type[BaseModel], schema: Schema) -> None:
    """Each model's declared rules as CEL at its own node, so `self` in a rule is that model's object."""
    rules = [_rule(r.cel, r.message, f".{r.field}") for r in declared_rules(model)]
    if rules:
        schema.setdefault("x-kubernetes-validations", []).extend(rules)
    for sub, node in _nested_models(model, schema):
        _add_declared_rules(sub, node)


def model_schema(model: type[BaseModel]) -> Schema:
    """The structural OpenAPI schema of a pydantic model, with defaults, bounds, enums, docs and the
    models' cross-field rules."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    schema = _structural(_deref(raw, defs))
    _add_factory_defaults(model, schema)
    _add_declared_rules(model, schema)
    return schema


def _rule(rule: str, message: str, field_path: str | None = None, reason: str | None = None) -> Schema:
    out: Schema = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    if reason:
        out["reason"] = reason
    return out


def _immutable_except(props: Schema, mutable: set[str]) -> str:
    """A transition rule on the spec: no field other than `mutable` may be added or removed.

    Value changes are caught by a `self == oldSelf` rule on each field (`_freeze_fields`); split
    this way, every rule stays cheap for the API server's CEL cost estimate."""
    return " && ".join(f"has(self.{name}) == has(oldSelf.{name})" for name in sorted(props) if name not in mutable)


def _freeze_fields(props: Schema, mutable: set[str], path: str) -> None:
    for name, prop in props.items():
        if name not in mutable:
            prop.setdefault("x-kubernetes-validations", []).append(
                _rule("self == oldSelf", f"{path}.{name} cannot change once the resource exists (only spec.suspend can); "
                      "create a new LoraFinetune instead", reason="FieldValueForbidden")
            )


def _lora_finetune_structure(spec: Schema) -> None:
    """What the models do not declare: `env` as a map keyed by name (one entry per name, so no
    duplicate overrides another), and the spec immutable except `suspend`."""
    p = spec["properties"]
    p["env"]["x-kubernetes-list-type"] = "map"
    p["env"]["x-kubernetes-list-map-keys"] = ["name"]
    spec.setdefault("x-kubernetes-validations", []).append(
        _rule(_immutable_except(p, {"suspend"}), IMMUTABLE_MESSAGE, reason="FieldValueForbidden")
    )
    _freeze_fields(p, {"suspend"}, "spec")


def _adapter_conversion_structure(spec: Schema) -> None:
    """The spec is immutable: a conversion runs once."""
    spec.setdefault("x-kubernetes-validations", []).append(_rule(
        "self == oldSelf", "spec is immutable once the AdapterConversion exists; create a new one instead",
        reason="FieldValueForbidden",
    ))


def _status_schema(model: type[BaseModel]) -> Schema:
    schema = model_schema(model)
    conditions = schema["properties"]["conditions"]
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    conditions["items"]["properties"]["lastTransitionTime"]["format"] = "date-time"
    return schema


def _crd(kind: str, plural: str, short: str, spec: Schema, status: Schema, columns: list[Schema]) -> Schema:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": [short],
                "categories": ["lora"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": columns,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": spec.pop("description", kind),
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec,
                                "status": status,
                            },
                        }
                    },
                }
            ],
        },
    }


def _col(name: str, path: str, typ: str = "string", priority: int = 0, description: str | None = None) -> Schema:
    col: Schema = {"name": name, "type": typ, "jsonPath": path}
    if priority:
        col["priority"] = priority
    if description:
        col["description"] = description
    return col


def lora_finetune_crd() -> Schema:
    """The LoraFinetune CRD as a dict."""
    spec = model_schema(LoraFinetuneSpec)
    _lora_finetune_structure(spec)
    columns = [
        _col("Phase", ".status.phase"),
        _col("TPU", ".status.tpu", description="type, topology and slices, e.g. v5p 2x2x2 x2"),
        _col("Step", ".status.progress", description="step/totalSteps"),
        _col("Loss", ".status.loss"),
        _col("Restarts", ".status.restarts", "integer", description="restarts counted toward spec.maxRestarts"),
        _col("Preemptions", ".status.preemptions", "integer", description="restarts after a preemption (not counted)"),
        _col("Age", ".metadata.creationTimestamp", "date"),
        _col("Adapter URI", ".status.adapterUri", priority=1),
        _col("Queue", ".spec.queueName", priority=1),
        _col("Capacity", ".spec.tpu.capacity.type", priority=1),
    ]
    return _crd("LoraFinetune", "lorafinetunes", "lft", spec, _status_schema(LoraFinetuneStatus), columns)


def adapter_conversion_crd() -> Schema:
    """The AdapterConversion CRD as a dict."""
    spec = model_schema(AdapterConversionSpec)
    _adapter_conversion_structure(spec)
    columns = [
        _col("Phase", ".status.phase"),
        _col("From", ".spec.source.format"),
        _col("To", ".spec.target.format"),
        _col("Output", ".status.outputUri"),
        _col("Age", ".metadata.creationTimestamp", "date"),
    ]
    return _crd("AdapterConversion", "adapterconversions", "adc", spec, _status_schema(AdapterConversionStatus), columns)


HEADER = "# Generated by `lora-operator crds` from operator/lora_operator/api.py. Do not edit.\n"


def generated_files() -> dict[str, str]:
    """File name -> YAML text of every CRD."""
    out = {}
    for crd in (lora_finetune_crd(), adapter_conversion_crd()):
        name = f"{crd['spec']['group']}_{crd['spec']['names']['plural']}.yaml"
        out[name] = HEADER + yaml.safe_dump(crd, sort_keys=False, width=120)
    return out


def check_or_write(directories: Sequence[Path], *, check: bool = False) -> int:
    """Write the CRDs into each directory, or with `check` report drift and return 1."""
    return write_or_check(generated_files(), directories, check=check, what="CRDs", command="lora-operator crds")
