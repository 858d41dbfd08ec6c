"""Validate manifests against the Kubernetes API's own JSON schemas, offline.

The schemas come from the `kubernetes-validate` package (generated from the upstream OpenAPI
spec of each Kubernetes minor release). The `-strict` variants set `additionalProperties:
false` on every object, so a misspelt or misplaced field is an error, as `kubectl apply
--validate=strict` would report it.
"""

from __future__ import annotations

from typing import Any

import yaml
from kubernetes_validate import utils as kv

#: The oldest Kubernetes minor the chart supports (Chart.yaml kubeVersion) and a current GKE one.
KUBE_VERSIONS = ("1.29.0", "1.33.0")


class ManifestInvalid(AssertionError):
    """A manifest does not match the Kubernetes schema; the message names the object and field."""


def load_all(text: str) -> list[dict[str, Any]]:
    """Every non-empty YAML document of a rendered template."""
    return [d for d in yaml.safe_load_all(text) if d]


def validate(obj: dict[str, Any], kube_version: str = KUBE_VERSIONS[-1]) -> None:
    """Raise ManifestInvalid unless `obj` matches its kind's strict schema in `kube_version`."""
    name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    try:
        kv.validate(obj, kube_version, strict=True)
    except kv.ValidationError as e:
        where = ".".join(str(p) for p in e.path) or "<root>"
        raise ManifestInvalid(f"{name} (Kubernetes {e.version}): {where}: {e.message}") from None
    except kv.SchemaNotFoundError as e:
        raise ManifestInvalid(f"{name}: {e.message}") from None
