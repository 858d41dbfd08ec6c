"""`/metrics` in Prometheus format: runs by phase, admission wait, restarts and preemptions,
each run's last step, tokens/s and MFU, reconcile errors, and which replica leads.

Everything per run comes from the LoraFinetune objects themselves, as the operator's watch
sees them (a kopf event handler keeps a table of the last status of every run), so the figures
are what `kubectl get lft` shows, whichever handler wrote them. Reconcile errors are what kopf
reports as a failed handler (its ERROR log records "Handler 'x' failed ..."): kopf catches
what a handler raises and retries it, so the log is where every failure surfaces.
"""

from __future__ import annotations

import datetime
import logging
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import kopf
import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from lora_operator.api import GROUP, VERSION, Phase

PREFIX = "lora_operator"
RUN_LABELS = ("namespace", "name")
#: Seconds a run may wait for Kueue and TPU nodes: seconds (warm pool) to a day (flex-start, a busy queue).
ADMISSION_BUCKETS = (10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400, 28800, 86400)
#: kopf's message when a handler, timer or daemon failed (kopf/_core/actions/execution.py).
_FAILED = re.compile(r"^(?:Handler|Timer|Daemon) '(?P<handler>[^']+)' failed (?P<how>temporarily|permanently|with an exception)")


def _time(value: Any) -> datetime.datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def _number(value: Any) -> float | None:
    try:
        return float(value) if value is not None and not isinstance(value, bool) else None
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True, slots=True)
class RunRecord:
    """What the metrics need of one LoraFinetune, from its status."""

    phase: str | None
    since: datetime.datetime | None
    """When the phase's Running condition last changed (or the object's creation): the start of a wait."""
    step: float | None
    total_steps: float | None
    tokens_per_second: float | None
    mfu: float | None
    restarts: float
    preemptions: float

    @classmethod
    def of(cls, body: dict[str, Any]) -> RunRecord:
        status = body.get("status") or {}
        running = next((c for c in status.get("conditions") or [] if c.get("type") == "Running"), {})
        since = _time(running.get("lastTransitionTime")) or _time((body.get("metadata") or {}).get("creationTimestamp"))
        return cls(status.get("phase"), since, _number(status.get("step")), _number(status.get("totalSteps")),
                   _number(status.get("tokensPerSecond")), _number(status.get("mfu")),
                   _number(status.get("restarts")) or 0.0, _number(status.get("preemptions")) or 0.0)


class OperatorMetrics(Collector):
    """The operator's Prometheus registry; `collect` builds the per-run figures at scrape time."""

    def __init__(self) -> None:
        self.registry = prometheus_client.CollectorRegistry(auto_describe=True)
        self._runs: dict[tuple[str, str], RunRecord] = {}
        self._lock = threading.Lock()
        self.admission_wait = prometheus_client.Histogram(
            f"{PREFIX}_admission_wait_seconds",
            "Seconds a run waited in Pending (Kueue admission, TPU nodes, pods starting) before it ran, each time it started",
            buckets=ADMISSION_BUCKETS, registry=self.registry)
        self.reconcile_errors = prometheus_client.Counter(
            f"{PREFIX}_reconcile_errors", "Handler runs that failed (kopf retries them), by handler and how it failed",
            ("handler", "how"), registry=self.registry)
        self.leader = prometheus_client.Gauge(
            f"{PREFIX}_leader", "1 while this replica reconciles (it holds the leader lease, or runs alone), else 0",
            registry=self.registry)
        self.registry.register(self)
        prometheus_client.ProcessCollector(registry=self.registry)  # process_* : memory, CPU, open files

    # --- what the operator tells it ----------------------------------------------------------

    def observe(self, body: dict[str, Any], deleted: bool = False) -> None:
        """A LoraFinetune as the watch saw it (deleted: gone)."""
        meta = body.get("metadata") or {}
        key = (meta.get("namespace") or "", meta.get("name") or "")
        with self._lock:
            previous = self._runs.pop(key, None)
            if deleted:
                return
            record = self._runs[key] = RunRecord.of(body)
        if previous is not None and previous.phase == Phase.PENDING and record.phase == Phase.RUNNING:
            if previous.since is not None and record.since is not None and record.since >= previous.since:
                self.admission_wait.observe((record.since - previous.since).total_seconds())

    def count_failure(self, record: logging.LogRecord) -> None:
        """A kopf log record: counted when it reports a failed handler."""
        if record.levelno >= logging.ERROR and (m := _FAILED.match(record.getMessage())):
            how = {"temporarily": "temporary", "permanently": "permanent", "with an exception": "exception"}[m["how"]]
            self.reconcile_errors.labels(m["handler"], how).inc()

    # --- scrape ------------------------------------------------------------------------------

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        with self._lock:
            runs = dict(self._runs)
        now = datetime.datetime.now(tz=datetime.UTC)
        phases = GaugeMetricFamily(f"{PREFIX}_runs", "LoraFinetunes by phase", labels=["phase"])
        for phase in Phase:
            phases.add_metric([phase.value], sum(1 for r in runs.values() if r.phase == phase))
        yield phases
        per_run = {
            "step": GaugeMetricFamily(f"{PREFIX}_run_step", "Last optimizer step the trainer reported", labels=RUN_LABELS),
            "total_steps": GaugeMetricFamily(f"{PREFIX}_run_total_steps", "training.steps of the run", labels=RUN_LABELS),
            "tokens_per_second": GaugeMetricFamily(f"{PREFIX}_run_tokens_per_second",
                                                   "Training throughput over the last log interval", labels=RUN_LABELS),
            "mfu": GaugeMetricFamily(f"{PREFIX}_run_mfu", "Model FLOPs utilisation over the last log interval (0-1)",
                                     labels=RUN_LABELS),
        }
        restarts = CounterMetricFamily(f"{PREFIX}_run_restarts", "JobSet restarts counted toward spec.maxRestarts",
                                       labels=RUN_LABELS)
        preemptions = CounterMetricFamily(f"{PREFIX}_run_preemptions", "JobSet restarts after a preemption (not counted)",
                                          labels=RUN_LABELS)
        pending = GaugeMetricFamily(f"{PREFIX}_run_pending_seconds",
                                    "Seconds a Pending run has been waiting (for Kueue, nodes or pods)", labels=RUN_LABELS)
        phase_of = GaugeMetricFamily(f"{PREFIX}_run_phase", "1 for each run's current phase (to join per-run series on)",
                                     labels=[*RUN_LABELS, "phase"])
        for (namespace, name), r in sorted(runs.items()):
            labels = [namespace, name]
            if r.phase is not None:
                phase_of.add_metric([*labels, r.phase], 1)
            for field, family in per_run.items():
                if (value := getattr(r, field)) is not None:
                    family.add_metric(labels, value)
            restarts.add_metric(labels, r.restarts)
            preemptions.add_metric(labels, r.preemptions)
            if r.phase == Phase.PENDING and r.since is not None:
                pending.add_metric(labels, max(0.0, (now - r.since).total_seconds()))
        yield from (phase_of, *per_run.values(), restarts, preemptions, pending)

    # --- wiring ------------------------------------------------------------------------------

    def install(self, registry: kopf.OperatorRegistry) -> None:
        """Watch every LoraFinetune into the table (kopf calls this for each watch event)."""

        def run_event(body: kopf.Body, type: str | None, **_: Any) -> None:
            self.observe(dict(body), deleted=type == "DELETED")

        kopf.on.event(GROUP, VERSION, "lorafinetunes", registry=registry, id="metrics")(run_event)

    def serve(self, port: int, address: str = "0.0.0.0") -> Any:
        """Start `/metrics` on a thread of its own; returns the server (`.shutdown()` stops it)."""
        server, _ = prometheus_client.start_http_server(port, address, registry=self.registry)
        return server


class FailureLog(logging.Handler):
    """Feeds kopf's ERROR records to `OperatorMetrics.count_failure` (attach to the `kopf` logger)."""

    def __init__(self, metrics: OperatorMetrics) -> None:
        super().__init__(logging.ERROR)
        self.metrics = metrics

    def emit(self, record: logging.LogRecord) -> None:
        self.metrics.count_failure(record)
