"""The real operator (kopf, our handlers, the official kubernetes client) over HTTP against KMock.

`Harness` serves `kmock.KubernetesEmulator` on loopback with our CRDs (from `crds/`) and the
resources the operator touches registered for discovery, runs `lora_operator.runner.operate`
in-process, and gives tests a small API: create/patch CRs (validated like the API server would:
structural defaults, schema, CEL rules incl. transition rules), read objects, and emulate the
JobSet and Job controllers by patching only their `status` subresource.

RBAC evidence: every request the operator sends is recorded in `harness.requests` as
`(verb, resource)` with RBAC verbs (get/list/watch/create/patch/update/delete) and resources as
`<apiGroup>/<plural>[/<subresource>]` (`""` group for core, e.g. `/configmaps`). When env var
`LORA_RBAC_USAGE_FILE` is set, the union over all harnesses of the run is written there as
JSON: `[{"verb": ..., "apiGroup": ..., "resource": ...}, ...]` (sorted).

Real cluster: with `KUBECONFIG` set and `LORA_E2E_REAL_CLUSTER=1`, `real_cluster()` says so and
the scenarios that only make sense there can run; everything here needs only the emulator.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import datetime
import io
import itertools
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import aiohttp.web
import jsonpatch
import kmock
import kopf
import kubernetes.client
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent / "operator"))
from crdcheck import validate  # noqa: E402
from jobset_controller import PodEnd, after_pod_failure  # noqa: E402

from lora_operator.handlers import build_registry  # noqa: E402
from lora_operator.kube import Kube  # noqa: E402
from lora_operator.metrics import OperatorMetrics  # noqa: E402
from lora_operator.runner import operate  # noqa: E402
from lora_operator.settings import OperatorSettings  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CRD_DIR = ROOT / "crds"
HARNESS_AGENT = "lora-harness"
ALL_VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}

#: (group/version/plural, kind, namespaced, subresources) of the built-in resources in play.
BUILTINS = [
    ("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition", False, set()),
    ("v1/namespaces", "Namespace", False, set()),
    ("v1/events", "Event", True, set()),
    ("v1/configmaps", "ConfigMap", True, set()),
    ("v1/secrets", "Secret", True, set()),
    ("batch/v1/jobs", "Job", True, {"status"}),
    ("jobset.x-k8s.io/v1alpha2/jobsets", "JobSet", True, {"status"}),
    ("coordination.k8s.io/v1/leases", "Lease", True, set()),
]
PATHS = {
    "LoraFinetune": "/apis/lora-operator.dev/v1alpha1/namespaces/{ns}/lorafinetunes",
    "AdapterConversion": "/apis/lora-operator.dev/v1alpha1/namespaces/{ns}/adapterconversions",
    "JobSet": "/apis/jobset.x-k8s.io/v1alpha2/namespaces/{ns}/jobsets",
    "Job": "/apis/batch/v1/namespaces/{ns}/jobs",
    "ConfigMap": "/api/v1/namespaces/{ns}/configmaps",
    "Secret": "/api/v1/namespaces/{ns}/secrets",
    "Event": "/api/v1/namespaces/{ns}/events",
    "Lease": "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases",
}
PLURAL_OF_KIND = {"LoraFinetune": "lorafinetunes", "AdapterConversion": "adapterconversions"}
_RUN_USAGE: set[tuple[str, str]] = set()


_RESOURCE_VERSIONS = itertools.count(1)
_SERVING: contextvars.ContextVar[kmock.Request | None] = contextvars.ContextVar("serving", default=None)


class _DirectDispatch(kmock.RawHandler):
    """Serves Kubernetes resource requests with the emulator's own fallback reaction for the action,
    skipping KMock's generic matching of every request against every reaction (milliseconds each,
    which made the emulator, not the operator, the bottleneck of the 200-CR benchmark)."""

    async def _handle(self, request: kmock.Request) -> Any:
        if request.resource is not None and request.resource.plural and request.action is not None:
            served = {
                kmock.action.LIST: self._serve_list, kmock.action.WATCH: self._serve_watch,  # type: ignore[attr-defined]
                kmock.action.FETCH: self._serve_fetch, kmock.action.CREATE: self._serve_create,  # type: ignore[attr-defined]
                kmock.action.UPDATE: self._serve_update, kmock.action.DELETE: self._serve_delete,  # type: ignore[attr-defined]
            }[request.action]
            for reaction in self._payloads:
                if getattr(reaction.response.payload, "__func__", None) is served.__func__:
                    return await reaction.response(request)
        return await super()._handle(request)


class ApiServerEmulator(kmock.KubernetesEmulator, _DirectDispatch):
    """KMock plus what kopf relies on from a real API server: a fresh `resourceVersion` on every
    write (kopf uses it to tell its own patches from stale watch events, and as a JSON-patch
    `test` for optimistic concurrency, answered 422 when stale), `generateName`, and `uid`,
    `generation` and `creationTimestamp` on creation."""

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # The cluster-scoped Namespace list, which kopf reads when it watches chosen namespaces:
        # KMock cannot parse its path. Answer as the API server does for the operator's account
        # there, which the chart grants no rights on namespaces: 403, after which kopf serves
        # exactly the namespaces it was given.
        if raw_request.path.rstrip("/") == "/api/v1/namespaces":
            await raw_request.read()
            return aiohttp.web.json_response({
                "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403,
                "message": 'namespaces is forbidden: User "system:serviceaccount:lora-system:lora-operator" '
                           'cannot list resource "namespaces" in API group "" at the cluster scope',
            }, status=403)
        return await super().__call__(raw_request)

    def __iter__(self) -> Iterator[kmock.Request]:
        # KMock matches a request to its reactions by scanning the whole request history for it
        # (quadratic over a run); while a request is being served, its own history is just itself.
        current = _SERVING.get()
        if current is not None:
            yield current
            return
        yield from super().__iter__()

    def _KubernetesEmulator__get_obj(self, request: kmock.Request, strict: bool) -> kmock.Object | None:
        # KMock scans every stored object for a named GET/PATCH; look the name up directly first.
        if request.name is not None and request.resource is not None:
            obj = self.objects._objects.get((request.resource, request.namespace, request.name))
            if obj is not None:
                return obj
        return super()._KubernetesEmulator__get_obj(request, strict)  # type: ignore[attr-defined]

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        #: (plural, name) -> uids of every object the operator (not the test) created, in order: a
        #: name created twice is a child made again.
        self.created: collections.defaultdict[tuple[str, str], list[str]] = collections.defaultdict(list)

    async def _handle(self, request: kmock.Request) -> Any:
        _SERVING.set(request)
        response = await self._serve(request)
        if (request.action == kmock.action.CREATE and request.resource is not None and isinstance(request.data, dict)
                and not request.headers.get("User-Agent", "").startswith(HARNESS_AGENT)):
            self.created[request.resource.plural, request.data["metadata"]["name"]].append(request.data["metadata"]["uid"])
        return response

    def _bump_on_delete(self, request: kmock.Request) -> None:
        """Deleting an object that has finalizers sets its deletionTimestamp: a change, so a new
        resourceVersion (KMock keeps the old one, and a client that skips versions it has seen
        would miss the deletion)."""
        stored = self.objects._objects.get((request.resource, request.namespace, request.name))
        if stored is not None and not stored.deleted and stored.get("metadata", {}).get("finalizers"):
            if not stored.get("metadata", {}).get("deletionTimestamp"):
                stored.patch({"metadata": {"resourceVersion": str(next(_RESOURCE_VERSIONS))}})

    async def _serve(self, request: kmock.Request) -> Any:
        if request.resource is not None and request.action == kmock.action.UPDATE and isinstance(request.data, dict):
            self._check_precondition(request)
        if request.resource is not None and request.action == kmock.action.DELETE and request.name is not None:
            self._bump_on_delete(request)
        if request.resource is not None and request.action in (kmock.action.CREATE, kmock.action.UPDATE):
            version = str(next(_RESOURCE_VERSIONS))
            if isinstance(request.data, list):  # JSON patch
                request.data.append({"op": "add", "path": "/metadata/resourceVersion", "value": version})
            elif isinstance(request.data, dict):
                meta = request.data.setdefault("metadata", {})
                meta["resourceVersion"] = version
                if request.action == kmock.action.CREATE:
                    if "name" not in meta and "generateName" in meta:
                        meta["name"] = meta["generateName"] + uuid.uuid4().hex[:8]
                    meta.setdefault("uid", str(uuid.uuid4()))
                    meta.setdefault("generation", 1)
                    meta.setdefault("creationTimestamp", _now())
        try:
            return await super()._handle(request)
        except jsonpatch.JsonPatchTestFailed as e:
            raise kmock.KubernetesError(status=422, reason="Invalid", message=f"the object has been modified: {e}") from e

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        """KMock's watch without its gap. KMock lists the objects, releases its lock, streams them,
        and only then subscribes to their changes: a write in between reached the client neither
        in the listing nor as an event, where a real API server's watch misses no change. A client
        that reconnects in that moment (a dropped watch) then waits for its resync. Here the
        subscription is taken with the listing, under the lock that every write holds while it
        publishes its event: each write is in the listing or in the stream, never in both."""
        yield b""  # the headers: the stream is open even if nothing happens
        assert request.resource is not None
        bus = self._buses[request.resource]  # type: ignore[attr-defined]
        async with self._lock:  # type: ignore[attr-defined]
            objects = [o for o in self._KubernetesEmulator__get_objs(request, strict=False) if not o.deleted]  # type: ignore[attr-defined]
            listed = [{"type": "ADDED", "object": o.raw} for o in objects]
            marker = await bus.mark()
        try:
            for event in listed:
                yield event
            async for event in bus.stream(since=marker):
                meta = event.get("object", {}).get("metadata", {})
                if self._KubernetesEmulator__check(request, request.resource, meta.get("namespace"), meta.get("name"),  # type: ignore[attr-defined]
                                                   strict=False):
                    yield event
        finally:
            await bus.unmark(marker)

    def _check_precondition(self, request: kmock.Request) -> None:
        """A merge patch carrying `metadata.resourceVersion` applies only to that version (409
        otherwise), as the API server's optimistic concurrency does."""
        expected = (request.data.get("metadata") or {}).get("resourceVersion")
        if expected is None or request.name is None:
            return
        stored = self.objects._objects.get((request.resource, request.namespace, request.name))
        if stored is not None and not stored.deleted and stored.get("metadata", {}).get("resourceVersion") != expected:
            raise kmock.KubernetesError(status=409, reason="Conflict", message=(
                f"Operation cannot be fulfilled on {request.resource.plural} \"{request.name}\": the object has been modified; "
                "please apply your changes to the latest version and try again"))


def harness_settings(**changes: Any) -> OperatorSettings:
    """The operator settings of the emulator tests: a fast resync, and local paths allowed anywhere
    (the tests stand local directories in for buckets: the operator reads their progress.json)."""
    return OperatorSettings(**{"progress_poll_seconds": 0.5, "allowed_local_paths": ["/"], **changes})


def real_cluster() -> bool:
    """True when the caller asked for a real cluster (KUBECONFIG + LORA_E2E_REAL_CLUSTER=1)."""
    return bool(os.environ.get("KUBECONFIG")) and os.environ.get("LORA_E2E_REAL_CLUSTER") == "1"


class Rejected(Exception):
    """The emulated API server refused an object (schema or CEL); `errors` name the fields."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("; ".join(errors))
        self.errors = errors


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _rbac_verb(req: kmock.Request) -> str | None:
    action = req.action
    if action is None:
        return None
    if action == kmock.action.UPDATE:
        return "update" if req.method == kmock.method.PUT else "patch"
    return {"LIST": "list", "WATCH": "watch", "FETCH": "get", "CREATE": "create", "DELETE": "delete"}[action.value]


class _ExceptionLog(logging.Handler):
    """Records the ERROR records that carry an exception (kopf's `logger.exception` for a handler
    that raised something other than kopf's Temporary/PermanentError)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            self.messages.append(f"{record.getMessage()} [{type(record.exc_info[1]).__name__}]")


class Harness:
    """Emulated API server + in-process operator. Use as `async with Harness() as h:`."""

    def __init__(self, emulator: ApiServerEmulator | None = None, *, expected_errors: tuple[str, ...] = ()) -> None:
        """`expected_errors`: regexes of the handler exceptions a test provokes on purpose; any
        other exception a handler raises fails the test when the harness exits."""
        self.emulator = emulator if emulator is not None else ApiServerEmulator(strict=False)
        self.expected_errors = expected_errors
        self._errors = _ExceptionLog()
        self.server: kmock.Server | None = None
        self.http: aiohttp.ClientSession | None = None
        self.url = ""
        self._operator: threading.Thread | None = None
        self._stop: threading.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._processes: list[OperatorProcess] = []

    # --- lifecycle ------------------------------------------------------------------------

    async def __aenter__(self) -> Harness:
        await self.emulator.__aenter__()
        for key, kind, namespaced, subresources in BUILTINS:
            self.emulator.resources[key] = kmock.ResourceInfo(
                kind=kind, singular=kind.lower(), verbs=ALL_VERBS, namespaced=namespaced, subresources=subresources
            )
        self.crds = [yaml.safe_load(p.read_text()) for p in sorted(CRD_DIR.glob("*.yaml"))]
        for crd in self.crds:
            spec = crd["spec"]
            for version in spec["versions"]:
                self.emulator.resources[f"{spec['group']}/{version['name']}/{spec['names']['plural']}"] = kmock.ResourceInfo(
                    kind=spec["names"]["kind"], singular=spec["names"]["singular"], verbs=ALL_VERBS, namespaced=True,
                    shortnames=set(spec["names"]["shortNames"]), categories=set(spec["names"]["categories"]),
                    subresources=set(version.get("subresources") or {}),
                )
        self.server = kmock.Server(self.emulator)
        await self.server.__aenter__()
        self.url = str(self.server.url).rstrip("/")
        self.http = aiohttp.ClientSession(headers={"User-Agent": HARNESS_AGENT})
        for crd in self.crds:
            await self._request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        for process in self._processes:
            if process.proc is not None and process.proc.poll() is None:
                process.kill()
        await self.stop_operator()
        for name in ("kopf", "lora_operator"):
            logging.getLogger(name).removeHandler(self._errors)
        assert self.http is not None and self.server is not None
        await self.http.close()
        await self.server.__aexit__(None, None, None)
        await self.emulator.__aexit__(None, None, None)
        _RUN_USAGE.update(self.requests)
        if path := os.environ.get("LORA_RBAC_USAGE_FILE"):
            write_rbac_usage(Path(path), _RUN_USAGE)
        if exc_type is None:  # a failing test keeps its own error
            unexpected = [m for m in self.handler_exceptions() if not any(re.search(e, m) for e in self.expected_errors)]
            assert not unexpected, f"the operator logged exceptions (kopf logs and goes on): {unexpected}"

    def handler_exceptions(self) -> list[str]:
        """Messages (with their exception) of every error the operator logged with a traceback:
        kopf catches what a handler or timer raises, logs it and retries or ignores it, so a test
        that only waits for states would not notice."""
        return list(self._errors.messages)

    async def start_operator(self, settings: OperatorSettings | None = None, *, metrics: OperatorMetrics | None = None,
                             url: str | None = None) -> None:
        """Run the real operator until `stop_operator`, in its own thread and event loop: kopf
        cancels every task created after its start when it stops, so it cannot share the test's loop.
        `metrics`: the operator's Prometheus registry, for a test to read (else a private one);
        `url`: where the operator reaches the API server (e.g. a fault-injecting proxy), default the emulator."""
        settings = settings or harness_settings()
        registry = build_registry(settings)
        url = url or self.url

        @kopf.on.login(registry=registry)
        def _login(**_: Any) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=url)

        kube = self.kube(url)
        self._stop, ready = threading.Event(), threading.Event()
        self._failure: BaseException | None = None

        async def operator() -> None:
            self._loop = asyncio.get_running_loop()
            await operate(settings, kube, registry, stop_flag=self._stop, ready_flag=ready, metrics=metrics)

        def run() -> None:
            try:
                asyncio.run(operator())
            except BaseException as e:  # reported by stop_operator
                self._failure = e

        for name in ("kopf", "lora_operator"):
            logger = logging.getLogger(name)
            if self._errors not in logger.handlers:
                logger.addHandler(self._errors)
        self._operator = threading.Thread(target=run, name="kopf-operator", daemon=True)
        self._operator.start()
        if not await asyncio.to_thread(ready.wait, 30):
            raise AssertionError(f"the operator did not become ready within 30s ({self._failure!r})")

    def kubeconfig(self, directory: Path) -> Path:
        """A kubeconfig file for the emulator, for `lora-operator run` processes."""
        path = directory / "kubeconfig"
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "emu",
            "clusters": [{"name": "emu", "cluster": {"server": self.url}}], "users": [{"name": "emu", "user": {}}],
            "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "emu", "namespace": "default"}}],
        }))
        return path

    def operator_process(self, directory: Path, args: list[str], log: Path, **env: str) -> subprocess.Popen[bytes]:
        """`lora-operator run ARGS` as a real process against the emulator (stderr appended to `log`). PYTHONPATH
        passes through: the operator under test is the checkout's, not an installed one."""
        return subprocess.Popen(
            [sys.executable, "-m", "lora_operator.cli", "run", *args],
            env={"KUBECONFIG": str(self.kubeconfig(directory)), "PATH": "/usr/bin:/bin", "HOME": str(directory),
                 **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"}, **env},
            stdout=subprocess.DEVNULL, stderr=log.open("a"), cwd=ROOT,
        )

    def kube(self, url: str | None = None) -> Kube:
        """The operator's own API client (`lora_operator.kube.Kube`), pointed at the emulator (or `url`)."""
        cfg = kubernetes.client.Configuration()
        cfg.host = url or self.url
        return Kube(kubernetes.client.ApiClient(cfg))

    def process(self, workdir: Path, settings: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> OperatorProcess:
        """`lora-operator run` as a real process against this emulator (see OperatorProcess); killed
        when the harness exits if the test left it running."""
        process = OperatorProcess(self, workdir, settings or {}, env or {})
        self._processes.append(process)
        return process

    async def stop_operator(self) -> None:
        """Set kopf's stop flag and wait for the operator thread to end."""
        if self._operator is None:
            return
        assert self._stop is not None
        thread, self._operator = self._operator, None
        self._stop.set()
        await asyncio.to_thread(thread.join, 30)
        if thread.is_alive():
            raise AssertionError(f"the operator did not stop within 30s of its stop flag; what it was doing:\n{self._operator_state()}")
        if self._failure is not None and not isinstance(self._failure, asyncio.CancelledError):
            raise self._failure

    def _operator_state(self) -> str:
        """The stack of every thread and every task left in the operator's loop: what a stop that
        never ends is waiting for (a task that ignores its cancellation, or an executor thread that
        asyncio.run's shutdown joins)."""
        names = {t.ident: t.name for t in threading.enumerate()}
        parts = [f"thread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}"
                 for ident, frame in sys._current_frames().items()]
        if self._loop is not None:
            for task in asyncio.all_tasks(self._loop):
                task.print_stack(file=(out := io.StringIO()))
                parts.append(out.getvalue())
        return "\n".join(parts)

    # --- observation ----------------------------------------------------------------------

    @property
    def requests(self) -> set[tuple[str, str]]:
        """(verb, `<group>/<plural>[/<sub>]`) of every request the operator (not the harness) sent."""
        out = set()
        for req in list(self.emulator):
            if req.headers.get("User-Agent", "").startswith(HARNESS_AGENT) or req.resource is None or not req.resource.plural:
                continue
            verb = _rbac_verb(req)
            if verb is None:
                continue
            resource = f"{req.resource.group or ''}/{req.resource.plural}"
            if req.subresource:
                resource += f"/{req.subresource}"
            out.add((verb, resource))
        return out

    def server_errors(self) -> list[Exception]:
        """Errors inside the emulator other than ordinary 404/409 answers (a bug in a request)."""
        return [e for e in self.emulator.errors if not isinstance(e, kmock.KubernetesError)]

    # --- HTTP -----------------------------------------------------------------------------

    async def _request(self, method: str, path: str, body: Any = None, *, merge: bool = False) -> tuple[int, Any]:
        assert self.http is not None
        headers = {"Content-Type": "application/merge-patch+json" if merge else "application/json"}
        async with self.http.request(method, self.url + path, data=json.dumps(body) if body is not None else None, headers=headers) as r:
            text = await r.text()
            return r.status, (json.loads(text) if text else None)

    async def get(self, kind: str, name: str, namespace: str = "default") -> dict[str, Any] | None:
        status, data = await self._request("GET", PATHS[kind].format(ns=namespace) + f"/{name}")
        return data if status == 200 else None

    async def list(self, kind: str, namespace: str = "default") -> list[dict[str, Any]]:
        status, data = await self._request("GET", PATHS[kind].format(ns=namespace))
        assert status == 200, data
        return data["items"]

    async def create(self, body: dict[str, Any]) -> dict[str, Any]:
        """Create like the API server: validate our CRs (defaults, schema, CEL), assign uid/generation."""
        body = json.loads(json.dumps(body))
        meta = body.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        if body["kind"] in PLURAL_OF_KIND:
            body, errors = validate(PLURAL_OF_KIND[body["kind"]], body)
            if errors:
                raise Rejected(errors)
            meta = body["metadata"]
            meta["generation"] = 1
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", _now())
        status, data = await self._request("POST", PATHS[body["kind"]].format(ns=meta["namespace"]), body)
        assert status in (200, 201), data
        return data

    async def delete(self, kind: str, name: str, namespace: str = "default") -> None:
        """`kubectl delete`: the server marks the object; it goes once its finalizers are removed."""
        status, data = await self._request("DELETE", PATHS[kind].format(ns=namespace) + f"/{name}")
        assert status in (200, 202), data

    async def gone(self, kind: str, name: str, namespace: str = "default", *, timeout: float = 30) -> None:
        """Wait until the object no longer exists."""

        async def probe() -> bool:
            return await self.get(kind, name, namespace) is None

        await self.wait_for(probe, timeout=timeout, what=f"{kind} {name} to be gone")

    async def replaced(self, kind: str, name: str, old_uid: str, namespace: str = "default") -> dict[str, Any]:
        """Wait until an object of that name exists again, a new one (another uid)."""

        async def probe() -> dict[str, Any] | None:
            obj = await self.get(kind, name, namespace)
            return obj if obj is not None and obj["metadata"]["uid"] != old_uid else None

        return await self.wait_for(probe, what=f"a new {kind} {name}")

    async def patch_spec(self, kind: str, name: str, spec_patch: dict[str, Any], namespace: str = "default") -> dict[str, Any]:
        """Update a CR's spec as a user would (transition rules checked, generation bumped)."""
        old = await self.get(kind, name, namespace)
        assert old is not None
        new = json.loads(json.dumps(old))
        new["spec"] = _merge(new["spec"], spec_patch)
        new, errors = validate(PLURAL_OF_KIND[kind], new, old=old)
        if errors:
            raise Rejected(errors)
        patch = {"spec": spec_patch, "metadata": {"generation": (old["metadata"].get("generation") or 1) + 1}}
        status, data = await self._request("PATCH", PATHS[kind].format(ns=namespace) + f"/{name}", patch, merge=True)
        assert status == 200, data
        return data

    async def patch_status(self, kind: str, name: str, status_patch: dict[str, Any], namespace: str = "default") -> dict[str, Any]:
        """What a controller does: merge-patch the status subresource (of an object that exists)."""
        await self.wait_for(lambda: self.get(kind, name, namespace), what=f"{kind} {name} to exist")
        status, data = await self._request(
            "PATCH", PATHS[kind].format(ns=namespace) + f"/{name}/status", {"status": status_patch}, merge=True
        )
        assert status == 200, data
        return data

    async def wait_for(
        self, probe: Callable[[], Awaitable[Any]], *, timeout: float = 30, what: str = "condition"
    ) -> Any:
        """Poll `probe` until it returns something truthy."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = await probe()
            if last:
                return last
            await asyncio.sleep(0.05)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")

    async def wait_for_status(self, kind: str, name: str, check: Callable[[dict[str, Any]], bool], *, timeout: float = 30,
                              namespace: str = "default") -> dict[str, Any]:
        async def probe() -> dict[str, Any] | None:
            obj = await self.get(kind, name, namespace)
            return obj if obj and check(obj.get("status") or {}) else None

        return await self.wait_for(probe, timeout=timeout, what=f"{kind} {name} status")

    async def events_for(self, name: str, namespace: str = "default") -> list[dict[str, Any]]:
        return [e for e in await self.list("Event", namespace) if e.get("involvedObject", {}).get("name") == name]

    # --- controller emulation -------------------------------------------------------------

    async def jobset_running(self, name: str, namespace: str = "default", *, restarts: int = 0, counted: int | None = None) -> None:
        """JobSet controller: all replicated Jobs active, after `restarts` restarts of which `counted`
        (default: all) count toward maxRestarts."""
        js = await self.wait_for(lambda: self.get("JobSet", name, namespace), what=f"JobSet {name}")
        assert js is not None
        rj = js["spec"]["replicatedJobs"][0]
        await self.patch_status("JobSet", name, {
            "restarts": restarts,
            "restartsCountTowardsMax": restarts if counted is None else counted,
            "replicatedJobsStatus": [{"name": rj["name"], "active": rj["replicas"], "ready": rj["replicas"],
                                      "succeeded": 0, "failed": 0, "suspended": 0}],
        }, namespace)

    async def pod_ended(self, name: str, pod: PodEnd, namespace: str = "default") -> dict[str, Any]:
        """Job and JobSet controllers: a trainer pod of JobSet `name` ended as `pod`; the JobSet's status
        follows from the failure policies the operator rendered into it (see jobset_controller).
        Returns the status patch (a restart leaves no Job active until the pods are back)."""
        js = await self.wait_for(lambda: self.get("JobSet", name, namespace), what=f"JobSet {name}")
        patch = after_pod_failure(js, pod)
        if "conditions" not in patch:
            rj = js["spec"]["replicatedJobs"][0]
            patch["replicatedJobsStatus"] = [{"name": rj["name"], "active": 0, "ready": 0, "succeeded": 0, "failed": 0, "suspended": 0}]
        await self.patch_status("JobSet", name, patch, namespace)
        return patch

    async def jobset_condition(self, name: str, ctype: str, reason: str, message: str, namespace: str = "default", **extra: Any) -> None:
        """JobSet controller: terminal condition (Completed/Failed) with its terminalState."""
        await self.patch_status("JobSet", name, {
            "conditions": [{"type": ctype, "status": "True", "reason": reason, "message": message,
                            "lastTransitionTime": _now()}],
            "terminalState": ctype,
            **extra,
        }, namespace)

    async def job_finished(self, name: str, *, failed: bool = False, message: str = "", namespace: str = "default") -> None:
        """Job controller: Complete, or Failed with the pod's reason, plus times."""
        now = _now()
        ctype, reason = ("Failed", "BackoffLimitExceeded") if failed else ("Complete", "")
        cond = {"type": ctype, "status": "True", "reason": reason, "message": message, "lastTransitionTime": now}
        status = {"startTime": now, "active": 0, "conditions": [cond], ("failed" if failed else "succeeded"): 1}
        if not failed:
            status["completionTime"] = now
        await self.patch_status("Job", name, status, namespace)


class OperatorProcess:
    """`lora-operator run` (Harness.operator_process) with a settings file and a liveness endpoint
    on a fresh port per start, no metrics endpoint: started, killed (SIGKILL) and started again as
    often as a test likes; its log accumulates in `workdir/operator.log`."""

    def __init__(self, harness: Harness, workdir: Path, settings: dict[str, Any], env: dict[str, str]) -> None:
        self.harness = harness
        self.workdir = workdir
        self.settings = workdir / "settings.yaml"
        self.settings.write_text(yaml.safe_dump(settings))
        self.log = workdir / "operator.log"
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    def start(self) -> None:
        from gcs_emulator import free_port

        self.port = free_port()
        self.proc = self.harness.operator_process(
            self.workdir, ["--settings", str(self.settings), "--liveness", f"http://127.0.0.1:{self.port}/healthz", "--metrics-port", "0"],
            self.log, **self.env)

    async def wait_live(self, timeout: float = 60) -> None:
        """Until the liveness endpoint answers (kopf is up and watching)."""
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < deadline:
                assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-3000:]
                try:
                    async with s.get(f"http://127.0.0.1:{self.port}/healthz") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
        raise AssertionError(f"the operator process was not live within {timeout}s")

    def kill(self) -> None:
        """SIGKILL: no handler, no cleanup, as a node loss or an OOM kill ends it."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    async def stop(self, timeout: float = 30) -> int:
        """SIGTERM and wait: the return code (0 for a graceful stop)."""
        assert self.proc is not None
        self.proc.terminate()
        try:
            return await asyncio.to_thread(self.proc.wait, timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the operator did not stop within {timeout}s of SIGTERM") from None


def _merge(base: Any, patch: Any) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = _merge(base.get(k), v)
        return out
    return patch


def write_rbac_usage(path: Path, usage: set[tuple[str, str]]) -> None:
    """Merge `usage` into the JSON file (the union over every harness of the run)."""
    rows = {(r["verb"], r["apiGroup"], r["resource"]) for r in (json.loads(path.read_text()) if path.exists() else [])}
    for verb, resource in usage:
        group, _, plural = resource.partition("/")
        rows.add((verb, group, plural))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([{"verb": v, "apiGroup": g, "resource": r} for v, g, r in sorted(rows)], indent=1) + "\n")
