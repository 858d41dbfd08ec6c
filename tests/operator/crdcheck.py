"""Validate objects the way the API server does with our CRDs: pruning, defaults, structural schema, CEL.

The KMock emulator does no validation, so the harness and the invalid-CR corpus use this:
jsonschema (Draft 4 semantics, as OpenAPI v3.0: boolean exclusiveMinimum) on the CRD's
openAPIV3Schema with the `x-kubernetes-*` keys dropped, then every `x-kubernetes-validations`
rule evaluated with a real CEL interpreter (cel-python), transition rules only on update.
"""

from __future__ import annotations

import copy
import re
from functools import cache
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml

CRD_DIR = Path(__file__).resolve().parents[2] / "crds"


@cache
def crd(plural: str) -> dict[str, Any]:
    """The committed CRD for `plural` (e.g. `lorafinetunes`)."""
    return yaml.safe_load((CRD_DIR / f"lora-operator.dev_{plural}.yaml").read_text())


def open_api_schema(plural: str) -> dict[str, Any]:
    return crd(plural)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _strip_k8s(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _strip_k8s(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if isinstance(node, list):
        return [_strip_k8s(x) for x in node]
    return node


def prune(schema: dict[str, Any], obj: Any, path: str = "") -> tuple[Any, list[str]]:
    """Drop fields the structural schema does not declare, as the API server does; returns (object, dropped paths).

    `metadata` and `x-kubernetes-preserve-unknown-fields` subtrees are kept as they are.
    """
    dropped: list[str] = []
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return obj, dropped
    if isinstance(obj, dict) and "properties" in schema:
        kept = {}
        for name, value in obj.items():
            if name in schema["properties"]:
                kept[name], more = (value, []) if name == "metadata" and not path else prune(
                    schema["properties"][name], value, f"{path}.{name}"
                )
                dropped += more
            else:
                dropped.append(f"{path}.{name}".lstrip("."))
        return kept, dropped
    if isinstance(obj, list) and "items" in schema:
        items = []
        for i, item in enumerate(obj):
            pruned, more = prune(schema["items"], item, f"{path}[{i}]")
            items.append(pruned)
            dropped += more
        return items, dropped
    return obj, dropped


def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """Structural defaulting: fill missing properties that have a default, recursively."""
    if isinstance(obj, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in obj and "default" in sub:
                obj[name] = copy.deepcopy(sub["default"])
            if name in obj:
                obj[name] = apply_defaults(sub, obj[name])
    elif isinstance(obj, list) and "items" in schema:
        return [apply_defaults(schema["items"], x) for x in obj]
    return obj


@cache
def _program(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def cel_holds(rule: str, new: Any, old: Any = None) -> bool:
    """Evaluate one CEL rule with `self` (and, for a transition rule, `oldSelf`) bound to JSON values."""
    activation = {"self": celpy.json_to_cel(new)}
    if old is not None:
        activation["oldSelf"] = celpy.json_to_cel(old)
    return bool(_program(rule).evaluate(activation))


def _cel_errors(schema: dict[str, Any], new: Any, old: Any, path: str) -> list[str]:
    errors: list[str] = []
    for rule in schema.get("x-kubernetes-validations", []):
        transition = "oldSelf" in rule["rule"]
        if transition and old is None:
            continue
        if not cel_holds(rule["rule"], new, old if transition else None):
            field = path + rule.get("fieldPath", "")
            errors.append(f"{field}: Invalid value: {rule['message']}")
    if isinstance(new, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in new:
                sub_old = old.get(name) if isinstance(old, dict) else None
                errors += _cel_errors(sub, new[name], sub_old, f"{path}.{name}")
    elif isinstance(new, list) and "items" in schema:
        for i, item in enumerate(new):
            errors += _cel_errors(schema["items"], item, None, f"{path}[{i}]")
    return errors


def _re2_pattern(validator: Any, pattern: str, instance: Any, schema: dict[str, Any]) -> Any:
    """`pattern` as the API server's Go regexp reads it: `$` ends the text (Python's also matches
    before a final newline, so `gs://b/x\\n` would pass here and fail there)."""
    if isinstance(instance, str):
        python = pattern[:-1] + r"\Z" if pattern.endswith("$") and not pattern.endswith(r"\$") else pattern
        if not re.search(python, instance):
            yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


_Validator = jsonschema.validators.extend(jsonschema.Draft4Validator, {"pattern": _re2_pattern})


def validate(plural: str, obj: dict[str, Any], old: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
    """Default and validate `obj`; return (defaulted object, error messages naming their fields)."""
    schema = open_api_schema(plural)
    obj, _dropped = prune(schema, copy.deepcopy(obj))
    obj = apply_defaults(schema, obj)
    validator = _Validator(_strip_k8s(schema))
    errors = [
        f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
        for e in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))
    ]
    if not errors:
        errors = _cel_errors(schema, obj, old, "")
        errors = [e.lstrip(".") for e in errors]
    return obj, errors
