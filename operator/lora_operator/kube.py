"""The few Kubernetes calls the handlers make, over the official client's REST layer.

Plain JSON in and out (the children are rendered as dicts), one helper per verb, and
create-or-adopt for idempotent child creation: deterministic names mean a retried or restarted
operator gets 409 Conflict for what it already made, and adopts it if it owns it. Events get
deterministic names too (from the CR's uid and a key), so posting one twice, after a retry or a
restart, is a 409 and not a duplicate. Every request has a timeout, and transient answers (429,
5xx, a dropped connection) are retried a few times: each call here is idempotent, so a retry of a
request whose answer was lost is harmless (a create then finds its object, an event its name).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import time
from typing import Any

import urllib3

import kubernetes.client
from kubernetes.client.exceptions import ApiException

from lora_operator.api import API_VERSION, JOBSET_API

log = logging.getLogger(__name__)

#: (connect, read) seconds of one request: an API server that stalls cannot hold a worker for ever.
REQUEST_TIMEOUT = (5.0, 30.0)
#: Waits before each retry of a transient answer (Retry-After, when given, is used up to the last).
RETRY_WAITS = (0.2, 0.5, 1.0, 2.0)
TRANSIENT = {429, 500, 502, 503, 504}
#: A Kubernetes Event's message is cut to this many characters (as kopf does).
MAX_EVENT_MESSAGE = 1024

#: apiVersion + kind -> plural, for every kind the operator creates or reads.
PLURALS = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Secret"): "secrets",
    ("v1", "Event"): "events",
    ("batch/v1", "Job"): "jobs",
    (JOBSET_API, "JobSet"): "jobsets",
    (API_VERSION, "LoraFinetune"): "lorafinetunes",
    (API_VERSION, "AdapterConversion"): "adapterconversions",
    ("coordination.k8s.io/v1", "Lease"): "leases",
}


class CannotCreate(RuntimeError):
    """A child that retrying will not create as rendered; `reason` is the CR condition's reason."""

    reason = "InvalidSpec"


class NotOwned(CannotCreate):
    """A child name is taken by an object that this CR does not own."""

    reason = "NameConflict"


class Refused(CannotCreate):
    """The API server (schema, 400/422) or an admission webhook (e.g. JobSet's, 403 "admission
    webhook ... denied") refused the child: its verdict does not change on a retry."""


def refusal(e: ApiException) -> str | None:
    """The server's message when `e` is a refusal that retrying cannot change; None for any other
    error (an outage, RBAC being fixed), which the caller lets kopf retry."""
    try:
        message = str(json.loads(e.body or "{}").get("message") or e.reason)
    except (ValueError, AttributeError):
        message = str(e.reason)
    if e.status in (400, 422) or (e.status == 403 and "admission webhook" in message):
        return message
    return None


def _path(api_version: str, kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{PLURALS[(api_version, kind)]}"
    if name:
        path += f"/{name}"
    if sub:
        path += f"/{sub}"
    return path


class Kube:
    """Synchronous JSON access to the API server (kopf runs sync handlers in a thread pool)."""

    def __init__(self, api_client: kubernetes.client.ApiClient) -> None:
        self.api = api_client

    def _call(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> dict[str, Any]:
        """One request, retried on a transient answer; other non-2xx answers raise ApiException with
        the status and the server's message."""
        for wait in (*RETRY_WAITS, None):
            try:
                return self._once(method, path, body, content_type)
            except ApiException as e:
                if e.status not in TRANSIENT or wait is None:
                    raise
                retry_after = str((e.headers or {}).get("Retry-After", ""))
                wait = min(float(retry_after), RETRY_WAITS[-1]) if retry_after.isdigit() else wait
                log.debug("%s %s answered %s; retrying in %.1fs", method, path, e.status, wait)
            except (urllib3.exceptions.HTTPError, OSError) as e:
                if wait is None:
                    raise
                log.debug("%s %s failed (%s); retrying in %.1fs", method, path, e, wait)
            time.sleep(wait)
        raise AssertionError("unreachable")

    def _once(self, method: str, path: str, body: Any, content_type: str) -> dict[str, Any]:
        _, url, headers, body, _ = self.api.param_serialize(
            method, path, header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body, auth_settings=["BearerToken"],
        )
        resp = self.api.call_api(method, url, header_params=headers, body=body, _request_timeout=REQUEST_TIMEOUT)
        data = resp.read()
        if not 200 <= resp.status < 300:
            raise ApiException(http_resp=resp)
        return json.loads(data) if data else {}

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return self._call("GET", _path(api_version, kind, namespace, name))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def create_or_adopt(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Create; on 409 adopt the existing object if it is owned by the same controller. Returns
        the object as the server holds it. Raises CannotCreate when retrying cannot help (refused,
        or the name is someone else's)."""
        meta = manifest["metadata"]
        path = _path(manifest["apiVersion"], manifest["kind"], meta["namespace"])
        try:
            return self._call("POST", path, manifest)
        except ApiException as e:
            if e.status != 409:
                message = refusal(e)
                if message is None:
                    raise
                raise Refused(
                    f"the API server refused {manifest['kind']} {meta['name']}: {message}; fix the spec (or the name) "
                    "and re-create the resource"
                ) from e
        existing = self.get(manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"])
        if existing is None:  # deleted between the two calls: let the handler retry
            raise RuntimeError(f"{manifest['kind']} {meta['name']} vanished after a conflict; retrying")
        owner_uids = {r.get("uid") for r in meta.get("ownerReferences", [])}
        theirs = {r.get("uid") for r in existing.get("metadata", {}).get("ownerReferences") or [] if r.get("controller")}
        if not owner_uids & theirs:
            raise NotOwned(
                f"a {manifest['kind']} named {meta['name']} already exists in {meta['namespace']} and is not owned by this "
                "resource; delete it or give the resource another name"
            )
        return existing

    def merge_patch(self, api_version: str, kind: str, namespace: str, name: str, patch: dict[str, Any], *, status: bool = False) -> dict[str, Any]:
        """A merge patch; with `metadata.resourceVersion` in it, the server refuses it (409) if the
        object changed since it was read."""
        return self._call(
            "PATCH", _path(api_version, kind, namespace, name, "status" if status else None), patch,
            content_type="application/merge-patch+json",
        )

    def set_finalizers(self, obj: dict[str, Any], finalizers: list[str]) -> dict[str, Any]:
        """Replace the object's finalizers if it has not changed since `obj` was read (a JSON patch
        whose `test` fails otherwise, 409 or 422), so another controller's finalizer is never lost."""
        meta = obj["metadata"]
        return self.json_patch(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"], [
            {"op": "test", "path": "/metadata/resourceVersion", "value": meta.get("resourceVersion")},
            {"op": "add", "path": "/metadata/finalizers", "value": finalizers},
        ])

    def json_patch(self, api_version: str, kind: str, namespace: str, name: str, ops: list[dict[str, Any]]) -> dict[str, Any]:
        """An RFC 6902 patch; a `test` op on /metadata/resourceVersion makes it conditional (409 or 422 when stale)."""
        return self._call("PATCH", _path(api_version, kind, namespace, name), ops, content_type="application/json-patch+json")

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Create; any non-2xx answer (409 when the name exists) raises ApiException."""
        meta = manifest["metadata"]
        return self._call("POST", _path(manifest["apiVersion"], manifest["kind"], meta["namespace"]), manifest)

    def post_event(self, owner: dict[str, Any], *, type: str, reason: str, message: str, key: str) -> bool:
        """Post an Event on `owner` named from its uid and `key`: once per key, however often it is
        posted (a second post is a 409). True when this call created it."""
        meta = owner["metadata"]
        digest = hashlib.sha256(f"{meta.get('uid')}/{key}".encode()).hexdigest()[:16]
        if len(message) > MAX_EVENT_MESSAGE:
            message = message[: MAX_EVENT_MESSAGE - 5] + " ..."
        now = datetime.datetime.now(tz=datetime.UTC).isoformat()
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{digest}", "namespace": meta["namespace"]},
            "type": type, "reason": reason, "message": message, "action": reason,
            "involvedObject": {"apiVersion": owner.get("apiVersion", API_VERSION), "kind": owner["kind"], "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta.get("uid")},
            "source": {"component": "lora-operator"}, "reportingComponent": "lora-operator", "reportingInstance": "lora-operator",
            "firstTimestamp": now, "lastTimestamp": now, "eventTime": now, "count": 1,
        }
        try:
            self._call("POST", _path("v1", "Event", meta["namespace"]), event)
        except ApiException as e:
            if e.status == 409:
                return False
            raise
        return True
