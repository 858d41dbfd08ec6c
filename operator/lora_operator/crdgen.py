"""Generate the CRD YAML in `crds/` from the pydantic API models (one source of truth).

Pydantic's JSON Schema is turned into a Kubernetes *structural* schema: `$ref`s inlined,
`anyOf [X, null]` collapsed to X (optional = not required), JSON-Schema-2020 exclusive bounds
rewritten to OpenAPI v3.0 booleans, titles and `additionalProperties: false` dropped (the API
server prunes unknown fields instead), object/list defaults from `default_factory` emitted as
`{}`/`[]` so the API server fills the nested defaults. Cross-field checks that JSON Schema
cannot express become CEL rules (`x-kubernetes-validations`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from lora_operator.api import (
    GROUP,
    RESERVED_ENV_MESSAGE,
    RESERVED_ENV_PATTERN,
    VERSION,
    AdapterConversionSpec,
    AdapterConversionStatus,
    LoraFinetuneSpec,
    LoraFinetuneStatus,
)
from lora_operator.generated import write_or_check
from lora_operator.tpu import CATALOG

Schema = dict[str, Any]

#: Powers of two a quantization tile may be (CEL has no bitwise operators).
TILE_SIZES = [2**i for i in range(13)]

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


def _add_factory_defaults(model: type[BaseModel], schema: Schema) -> None:
    """Give fields with a `default_factory` a `{}`/`[]` default so nested defaults apply server-side."""
    for name, field in model.model_fields.items():
        prop = schema["properties"].get(field.alias or name)
        if prop is None:
            continue
        if field.default_factory is not None:
            value = field.default_factory()
            prop["default"] = [] if isinstance(value, list) else {}
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel) and prop.get("type") == "object":
            _add_factory_defaults(sub, prop)
        # Optional sub-models (X | None) have their own factories one level down.
        for arg in getattr(sub, "__args__", ()):
            if isinstance(arg, type) and issubclass(arg, BaseModel) and "properties" in prop:
                _add_factory_defaults(arg, prop)
        if prop.get("type") == "array" and "properties" in prop.get("items", {}):
            item_type = next(
                (a for a in getattr(sub, "__args__", ()) if isinstance(a, type) and issubclass(a, BaseModel)), None
            )
            if item_type is not None:
                _add_factory_defaults(item_type, prop["items"])


def model_schema(model: type[BaseModel]) -> Schema:
    """The structural OpenAPI schema of a pydantic model, with defaults, bounds, enums and docs."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    schema = _structural(_deref(raw, defs))
    _add_factory_defaults(model, schema)
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


def _lora_finetune_rules(spec: Schema) -> None:
    """Attach the cross-field CEL rules of a LoraFinetune spec."""
    p = spec["properties"]
    tpu = p["tpu"]
    tpu["x-kubernetes-validations"] = [
        _rule(
            f"!has(self.type) || !has(self.topology) || self.type != '{t.name}' || self.topology in {list(t.topologies)}",
            f"spec.tpu.topology is not offered by GKE for {t.name}; use one of {', '.join(t.topologies)}",
            ".topology",
        )
        for t in CATALOG.values()
    ]
    tpu["properties"]["capacity"]["x-kubernetes-validations"] = [
        _rule("(self.type == 'reservation') == has(self.reservation)",
              "spec.tpu.capacity.reservation names the reservation to use: set it exactly when type is reservation", ".reservation"),
        _rule("!has(self.flexStart) || self.type == 'flexStart'",
              "spec.tpu.capacity.flexStart only applies to type: flexStart; drop it or set the type", ".flexStart"),
    ]
    lora = p["lora"]
    lora["x-kubernetes-validations"] = [_rule("self.rank > 0", "spec.lora.rank must be > 0 (e.g. 8 or 16)", ".rank")]
    lora["properties"]["quantization"]["x-kubernetes-validations"] = [
        _rule(
            f"!has(self.tileSize) || self.tileSize in {TILE_SIZES}",
            "spec.lora.quantization.tileSize must be a power of two (e.g. 32, 64, 128)",
            ".tileSize",
        )
    ]
    p["training"]["x-kubernetes-validations"] = [
        _rule(
            "self.globalBatchSize % self.gradientAccumulation == 0",
            "spec.training.globalBatchSize must be divisible by spec.training.gradientAccumulation",
            ".globalBatchSize",
        )
    ]
    p["output"]["x-kubernetes-validations"] = [
        _rule("!self.uri.startsWith('hf://')", "spec.output.uri: hf:// is read-only; write to gs://BUCKET/... or a path", ".uri")
    ]
    p["env"]["items"]["x-kubernetes-validations"] = [
        _rule(f"!self.name.matches('{RESERVED_ENV_PATTERN}')", f"spec.env[].name is reserved: {RESERVED_ENV_MESSAGE}", ".name")
    ]
    p["env"]["x-kubernetes-list-type"] = "map"
    p["env"]["x-kubernetes-list-map-keys"] = ["name"]
    spec["x-kubernetes-validations"] = [
        _rule(
            "!(has(self.training) && has(self.training.evalEvery)) || has(self.dataset.eval)",
            "spec.training.evalEvery needs spec.dataset.eval: add an eval dataset or drop evalEvery",
            ".training.evalEvery",
        ),
        _rule(_immutable_except(p, {"suspend"}), IMMUTABLE_MESSAGE, reason="FieldValueForbidden"),
    ]
    _freeze_fields(p, {"suspend"}, "spec")


def _as_directory(uri: str) -> str:
    """CEL for `api.as_directory`: the URI with one trailing `/`."""
    return f"({uri}.endsWith('/') ? {uri} : {uri} + '/')"


def _adapter_conversion_rules(spec: Schema) -> None:
    p = spec["properties"]
    p["target"]["x-kubernetes-validations"] = [
        _rule("!self.uri.startsWith('hf://')", "spec.target.uri: hf:// is read-only; write to gs://BUCKET/... or a path", ".uri")
    ]
    spec["x-kubernetes-validations"] = [
        _rule(
            "!has(self.merged) || !self.merged || self.target.format == 'hf-peft'",
            "spec.merged writes an HF model: set spec.target.format to hf-peft or drop merged",
            ".merged",
        ),
        _rule(
            "self.source.format != self.target.format",
            "spec.target.format is spec.source.format: nothing to convert; set spec.target.format to the other format",
            ".target.format",
        ),
        _rule(
            f"!{_as_directory('self.target.uri')}.startsWith({_as_directory('self.source.uri')}) && "
            f"!{_as_directory('self.source.uri')}.startsWith({_as_directory('self.target.uri')})",
            "spec.target.uri overlaps spec.source.uri (the same directory, or one inside the other): the conversion "
            "replaces its target directory whole; write to a directory outside the source",
            ".target.uri",
        ),
        _rule(
            "self == oldSelf",
            "spec is immutable once the AdapterConversion exists; create a new one instead",
            reason="FieldValueForbidden",
        ),
    ]


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
    _lora_finetune_rules(spec)
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
    _adapter_conversion_rules(spec)
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
