"""Leader election over a `coordination.k8s.io/v1` Lease, as client-go's leaderelection does it,
so that of several operator replicas exactly one reconciles.

Every replica tries to hold the Lease; the holder renews it every `retryPeriodSeconds`, the
others wait. A holder that could not renew for `renewDeadlineSeconds` stops reconciling (and the
process exits, for Kubernetes to restart it as a candidate); a candidate takes the Lease once its
record has not changed for `leaseDurationSeconds` of the candidate's own clock (never by
comparing the holder's timestamps with its own, so clock skew cannot make two leaders). Every
write is conditional on the Lease's resourceVersion (a JSON-patch `test`), so two candidates
cannot both take it. A replica that stops cleanly (an upgrade) releases the Lease at once.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import socket
import time
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp.web
from kubernetes.client.exceptions import ApiException

from lora_operator.kube import Kube
from lora_operator.settings import LeaderElection

LEASE_API = "coordination.k8s.io/v1"
log = logging.getLogger(__name__)


def default_identity() -> str:
    """This replica's name in the Lease: unique even for two processes on one host."""
    return f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def _micro_time(now: datetime.datetime) -> str:
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_spec(current: dict[str, Any], identity: str, duration: float, now: datetime.datetime) -> dict[str, Any]:
    """The spec that makes `identity` the holder as of `now` (a renewal keeps acquireTime and the transition count)."""
    renewing = current.get("holderIdentity") == identity
    return {
        "holderIdentity": identity,
        "leaseDurationSeconds": max(1, round(duration)),
        "acquireTime": current.get("acquireTime") if renewing else _micro_time(now),
        "renewTime": _micro_time(now),
        "leaseTransitions": int(current.get("leaseTransitions") or 0) + (0 if renewing or not current.get("holderIdentity") else 1),
    }


@dataclass(slots=True)
class _Seen:
    """The Lease record as last read, and when (this process's monotonic clock) it last changed."""

    record: tuple[Any, ...]
    at: float


class LeaderElector:
    """One replica's side of the election; `try_acquire_or_renew` is one round (sync: it does I/O)."""

    def __init__(self, kube: Kube, config: LeaderElection, identity: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.kube, self.config, self.identity, self.clock = kube, config, identity, clock
        self._seen: _Seen | None = None

    def _get(self) -> dict[str, Any] | None:
        return self.kube.get(LEASE_API, "Lease", self.config.lease_namespace, self.config.lease_name)

    def try_acquire_or_renew(self) -> bool:
        """True when this replica holds the Lease after the round; False while another one's is live.
        Raises ApiException on API errors other than losing a race."""
        now = datetime.datetime.now(tz=datetime.UTC)
        lease = self._get()
        if lease is None:
            body = {"apiVersion": LEASE_API, "kind": "Lease",
                    "metadata": {"name": self.config.lease_name, "namespace": self.config.lease_namespace},
                    "spec": lease_spec({}, self.identity, self.config.lease_duration_seconds, now)}
            return self._won(lambda: self.kube.create(body))
        spec = lease.get("spec") or {}
        record = (spec.get("holderIdentity"), spec.get("renewTime"), spec.get("leaseTransitions"))
        if self._seen is None or self._seen.record != record:
            self._seen = _Seen(record, self.clock())
        holder = spec.get("holderIdentity")
        expired = self.clock() - self._seen.at >= float(spec.get("leaseDurationSeconds") or self.config.lease_duration_seconds)
        if holder and holder != self.identity and not expired:
            return False
        if holder and holder != self.identity:
            log.info("the Lease of %s expired; taking over as %s", holder, self.identity)
        version = lease["metadata"].get("resourceVersion")
        ops = [{"op": "test", "path": "/metadata/resourceVersion", "value": version},
               {"op": "replace", "path": "/spec", "value": lease_spec(spec, self.identity, self.config.lease_duration_seconds, now)}]
        return self._won(lambda: self.kube.json_patch(LEASE_API, "Lease", self.config.lease_namespace, self.config.lease_name, ops))

    def _won(self, write: Callable[[], dict[str, Any]]) -> bool:
        try:
            written = write()
        except ApiException as e:
            if e.status in (409, 422):  # another replica wrote first
                return False
            raise
        spec = written.get("spec") or {}
        self._seen = _Seen((spec.get("holderIdentity"), spec.get("renewTime"), spec.get("leaseTransitions")), self.clock())
        return True

    def release(self) -> None:
        """Give the Lease up (a clean stop), so a standby takes over without waiting for it to expire."""
        lease = self._get()
        if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
            return
        ops = [{"op": "test", "path": "/metadata/resourceVersion", "value": lease["metadata"].get("resourceVersion")},
               {"op": "replace", "path": "/spec/holderIdentity", "value": ""}]
        try:
            self.kube.json_patch(LEASE_API, "Lease", self.config.lease_namespace, self.config.lease_name, ops)
        except ApiException as e:
            log.warning("could not release the Lease %s: %s", self.config.lease_name, e.reason)


class LostLeadership(RuntimeError):
    """The Lease could not be renewed in time: this replica stopped reconciling and must restart as a candidate."""


Flag = Any  # threading.Event, asyncio.Event or None: what kopf takes as a stop flag


def _is_set(flag: Flag) -> bool:
    return flag is not None and flag.is_set()


async def _wait(flag: Flag, seconds: float, task: asyncio.Task[None] | None = None) -> bool:
    """Sleep up to `seconds`; True as soon as `flag` is set (early return too when `task` ends)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _is_set(flag):
            return True
        if task is not None and task.done():
            return False
        await asyncio.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
    return _is_set(flag)


def _round(elector: LeaderElector) -> bool:
    try:
        return elector.try_acquire_or_renew()
    except Exception as e:  # an API outage: the renew deadline decides, as in client-go
        log.warning("leader election round failed: %s: %s", type(e).__name__, e)
        return False


async def _serve_standby_liveness(url: str) -> aiohttp.web.AppRunner:
    """While a standby, answer the liveness probe kopf answers once this replica leads (same URL)."""
    parsed = urllib.parse.urlsplit(url)

    async def healthy(_: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response({"standby": True})

    app = aiohttp.web.Application()
    app.router.add_get(parsed.path or "/", healthy)
    runner = aiohttp.web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, parsed.hostname, parsed.port, reuse_address=True).start()
    return runner


async def lead(
    elector: LeaderElector,
    reconcile: Callable[[asyncio.Event], Awaitable[None]],
    *,
    stop_flag: Flag = None,
    liveness: str | None = None,
    on_leading: Callable[[bool], None] = lambda _: None,
) -> None:
    """Wait to hold the Lease, then `reconcile(stop)` while renewing it; stop reconciling when the Lease
    is lost (raising LostLeadership) or `stop_flag` is set (then the Lease is released)."""
    retry = elector.config.retry_period_seconds
    standby = await _serve_standby_liveness(liveness) if liveness else None
    try:
        log.info("candidate %s waiting for the Lease %s/%s", elector.identity, elector.config.lease_namespace, elector.config.lease_name)
        while not await asyncio.to_thread(_round, elector):
            if await _wait(stop_flag, retry):
                return
    finally:
        if standby is not None:
            await standby.cleanup()
    log.info("%s leads: reconciling", elector.identity)
    on_leading(True)
    stop = asyncio.Event()
    task = asyncio.create_task(reconcile(stop))
    renewed, lost = time.monotonic(), False
    try:
        while not task.done() and not await _wait(stop_flag, retry, task):
            if await asyncio.to_thread(_round, elector):
                renewed = time.monotonic()
            elif time.monotonic() - renewed > elector.config.renew_deadline_seconds:
                log.error("%s could not renew the Lease for %.0fs: stopping (another replica may lead now)",
                          elector.identity, elector.config.renew_deadline_seconds)
                lost = True
                break
    finally:
        stop.set()
        await task
        on_leading(False)
        if not lost:
            await asyncio.to_thread(elector.release)
    if lost:
        raise LostLeadership(f"{elector.identity} lost the Lease {elector.config.lease_name}")
