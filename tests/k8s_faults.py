"""An HTTP proxy in front of the emulator that answers some requests the way an API server under
load, in an upgrade or behind a flaky load balancer does.

Faults, each on a random share of the requests of the operator (never of the test's own, which
carry the harness's User-Agent):
- `429`: Too Many Requests with `Retry-After: 1`, before the request reaches the server;
- `500`: an internal error (etcd timing out), before it reaches the server;
- `lost`: the request is served, then its answer replaced by a 500: a write that happened although
  the client was told it failed (only the operator's own client's requests: kopf's JSON patches
  would then fail their `test` on the retry, a fault this test does not aim at);
- `409`: Conflict for every eighth write that names the resourceVersion it expects (the
  operator's status writes and finalizer patches), as another writer would cause;
- watches: `410` Gone (resource version too old) as the stream's first event, or the stream
  dropped after a moment.
`counts` says how many of each were injected.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
from typing import Any

import aiohttp
import aiohttp.web

from k8s_harness import HARNESS_AGENT

#: The operator's own client (lora_operator.kube over the kubernetes client) as it names itself.
OPERATOR_CLIENT = "OpenAPI-Generator"


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "code": code, "reason": reason,
            "message": f"{message} (fault injected by the test proxy)"}


class FaultProxy:
    """`async with FaultProxy(target, rng) as proxy:` then point the operator at `proxy.url`."""

    def __init__(self, target: str, rng: random.Random, *, rate: float = 0.06, watch_rate: float = 0.5) -> None:
        """`rate`: share of requests answered with a fault; `watch_rate`: of watches (kopf opens one
        per resource and keeps it, so a fault each needs a larger share to happen at all)."""
        self.target = target.rstrip("/")
        self.rng = rng
        self.rate = rate
        self.watch_rate = watch_rate
        self.enabled = True
        self.counts: collections.Counter[str] = collections.Counter()
        self._conditional = 0
        self.url = ""
        self._runner: aiohttp.web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> FaultProxy:
        app = aiohttp.web.Application(client_max_size=64 * 1024**2)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = aiohttp.web.AppRunner(app, shutdown_timeout=1)  # open watch streams end with the test
        await self._runner.setup()
        site = aiohttp.web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        self._session = aiohttp.ClientSession(auto_decompress=False)
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._runner is not None and self._session is not None
        await self._session.close()
        await self._runner.cleanup()

    def _fault(self, request: aiohttp.web.Request, body: bytes) -> str | None:
        agent = request.headers.get("User-Agent", "")
        if not self.enabled or agent.startswith(HARNESS_AGENT):
            return None
        conditional = agent.startswith(OPERATOR_CLIENT) and request.method == "PATCH" and b"resourceVersion" in body
        if conditional:  # every eighth one conflicts, so that each run of the test meets some
            self._conditional += 1
            if self._conditional % 8 == 0:
                return "409"
        watch = request.query.get("watch") in ("true", "1")
        if self.rng.random() >= (self.watch_rate if watch else self.rate):
            return None
        if watch:
            return self.rng.choice(["410", "drop"])
        return self.rng.choice(["429", "500", *(["lost"] if agent.startswith(OPERATOR_CLIENT) else [])])

    async def _handle(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        body = await request.read()
        fault = self._fault(request, body)
        if fault is not None:
            self.counts[fault] += 1
        if fault == "429":
            return aiohttp.web.json_response(_status(429, "TooManyRequests", "the server is handling too many requests"),
                                             status=429, headers={"Retry-After": "1"})
        if fault == "500":
            return aiohttp.web.json_response(_status(500, "InternalError", "etcdserver: request timed out"), status=500)
        if fault == "409":
            return aiohttp.web.json_response(_status(409, "Conflict", "the object has been modified"), status=409)
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "accept", "user-agent", "authorization")}
        assert self._session is not None
        async with self._session.request(request.method, self.target + request.path_qs, data=body or None, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=None)) as upstream:
            if request.query.get("watch") in ("true", "1"):
                return await self._stream(request, upstream, fault)
            data = await upstream.read()
            if fault == "lost":
                return aiohttp.web.json_response(_status(500, "InternalError", "the answer was lost"), status=500)
            return aiohttp.web.Response(body=data, status=upstream.status, content_type="application/json")

    async def _stream(self, request: aiohttp.web.Request, upstream: aiohttp.ClientResponse, fault: str | None) -> aiohttp.web.StreamResponse:
        response = aiohttp.web.StreamResponse(status=upstream.status, headers={"Content-Type": "application/json"})
        await response.prepare(request)
        if fault == "410":
            gone = _status(410, "Expired", "too old resource version")
            await response.write(json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n")
            return response
        deadline = asyncio.get_running_loop().time() + (self.rng.uniform(0.3, 2.0) if fault == "drop" else float("inf"))
        try:
            while True:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    break  # dropped: the client sees the stream end without a reason
                try:
                    chunk = await asyncio.wait_for(upstream.content.readany(), timeout=min(left, 3600))
                except TimeoutError:
                    continue
                if not chunk:
                    break
                await response.write(chunk)
        except (ConnectionResetError, aiohttp.ClientError):
            pass
        return response
