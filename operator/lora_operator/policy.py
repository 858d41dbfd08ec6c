"""What the platform admin allows a CR to ask for: the checks that depend on the operator's settings.

The CRD schema and the API models refuse what is wrong for everyone (a malformed image, a
reserved env name, `..` in a gs:// path); this module refuses what this platform does not allow
(an image, service account, priority class or token Secret outside the admin's allowlists, a
local path in the cluster). Every problem is collected with its field before the CR is refused,
so one Failed condition names them all. Pure functions.
"""

from __future__ import annotations

import posixpath

from lora_operator.api import AdapterConversionSpec, LoraFinetuneSpec
from lora_operator.settings import OperatorSettings
from lora_trainer.storage import is_gcs, is_hf

#: (field, message) pairs, in the order the fields appear in the spec.
Problems = list[tuple[str, str]]


def _allowlisted(field: str, value: str | None, allowed: list[str], setting: str) -> Problems:
    if value is None or value in allowed:
        return []
    listed = ", ".join(allowed) if allowed else "none"
    return [(field, f"{value!r} is not one of the operator's {setting} ({listed}); use one of those, or ask the "
                    f"platform admin to add it to {setting}")]


def image_problems(field: str, image: str | None, settings: OperatorSettings) -> Problems:
    refusal = None if image is None else settings.image_refusal(image)
    if refusal is None:
        return []
    return [(field, f"{refusal} {settings.allowed_images}; use an image of one of those repositories (or ask the "
                    "platform admin to extend allowedImages)")]


def local_path_problem(uri: str, settings: OperatorSettings) -> str | None:
    """Why `uri` cannot be used in the cluster, or None. gs:// and hf:// are decided by the schema;
    a local path names the trainer pod's filesystem, so it must be absolute, free of `..`, and under
    one of the admin's `allowedLocalPaths` (a volume the platform mounts)."""
    if is_gcs(uri) or is_hf(uri):
        return None
    path = uri.removeprefix("file://")
    where = ("the operator allows no local paths (allowedLocalPaths is empty); use gs://BUCKET/PATH"
             if not settings.allowed_local_paths else
             f"use gs://BUCKET/PATH or a path under one of the operator's allowedLocalPaths ({', '.join(settings.allowed_local_paths)})")
    if not path.startswith("/") or ".." in path.split("/"):
        return f"{uri!r} is a relative path or climbs with '..'; in the cluster it names nothing you control: {where}"
    normal = posixpath.normpath(path)
    if not any(normal == root.rstrip("/") or normal.startswith(root.rstrip("/") + "/") for root in settings.allowed_local_paths):
        return f"{uri!r} is a local path of the trainer pod: {where}"
    return None


def _uris(uris: list[tuple[str, str | None]], settings: OperatorSettings) -> Problems:
    return [(field, problem) for field, uri in uris if uri is not None
            if (problem := local_path_problem(uri, settings)) is not None]


def _under(uri: str, root: str) -> bool:
    """Whether `uri` is `root` or lies below it (both already free of `..`, as the schema and `_uris` see to)."""
    return uri.rstrip("/") == root.rstrip("/") or uri.startswith(root.rstrip("/") + "/")


def compilation_cache_problems(spec: LoraFinetuneSpec, settings: OperatorSettings) -> Problems:
    """A compilation cache is trusted code: the trainer runs what it finds there. A CR may keep its
    own under its output (the default) or use one the admin shares (`sharedCompilationCaches`)."""
    uri = spec.training.compilation_cache.uri
    if uri is None or _under(uri, spec.output.uri) or any(_under(uri, shared) for shared in settings.shared_compilation_caches):
        return []
    shared = ", ".join(settings.shared_compilation_caches) or "none"
    return [("spec.training.compilationCache.uri",
             f"{uri!r} is neither under spec.output.uri nor one of the operator's sharedCompilationCaches ({shared}): "
             "whoever can write a compilation cache chooses what the trainer runs; leave uri empty (the run keeps "
             "its own under its output) or ask the platform admin to share a cache")]


def lora_finetune_problems(spec: LoraFinetuneSpec, settings: OperatorSettings) -> Problems:
    """Everything the admin's settings refuse in a LoraFinetune spec."""
    secret = spec.hf_token_secret_ref.name if spec.hf_token_secret_ref else None
    return [
        *_uris([("spec.model.source", spec.model.source), ("spec.dataset.train", spec.dataset.train),
                ("spec.dataset.eval", spec.dataset.eval), ("spec.lora.restoreFrom", spec.lora.restore_from),
                ("spec.output.uri", spec.output.uri),
                ("spec.training.compilationCache.uri", spec.training.compilation_cache.uri)], settings),
        *compilation_cache_problems(spec, settings),
        *image_problems("spec.image", spec.image, settings),
        *_allowlisted("spec.serviceAccountName", spec.service_account_name, settings.allowed_service_accounts,
                      "allowedServiceAccounts"),
        *_allowlisted("spec.priorityClassName", spec.priority_class_name, settings.allowed_priority_classes,
                      "allowedPriorityClasses"),
        *_allowlisted("spec.hfTokenSecretRef.name", secret, settings.allowed_token_secrets, "allowedTokenSecrets"),
    ]


def adapter_conversion_problems(spec: AdapterConversionSpec, settings: OperatorSettings) -> Problems:
    """Everything the admin's settings refuse in an AdapterConversion spec."""
    return [
        *_uris([("spec.source.uri", spec.source.uri), ("spec.target.uri", spec.target.uri),
                ("spec.model.source", spec.model.source)], settings),
        *image_problems("spec.image", spec.image, settings),
        *_allowlisted("spec.serviceAccountName", spec.service_account_name, settings.allowed_service_accounts,
                      "allowedServiceAccounts"),
    ]
