"""kopf handlers: every trigger runs the same level-triggered reconcile. Thin on purpose.

Registered into a fresh `kopf.OperatorRegistry` by `build_registry(settings)` because the
timers' interval comes from the operator settings. A CR's create, resume (every CR, each time the
operator starts) and any change of its spec, each of its children's events (deletions included),
and a resync timer all call `Controller.reconcile`, which reads the CR and its children afresh
and decides from them and the CR's durable record (lora_operator.reconcile): no handler relies on
having seen a change happen. The sync handlers run in kopf's thread pool; the progress timer is
async, so a stalled bucket never holds one of those threads. Handlers return None, so nothing
lands in `status.<handler>`; kopf's own state lives in annotations (see `configure`). Secrets are
only checked for existence: their data is never logged, posted or copied.
"""

from __future__ import annotations

import asyncio
from typing import Any

import kopf

from lora_operator.api import GROUP, JOBSET_GROUP, JOBSET_VERSION, VERSION, Phase
from lora_operator.controller import Controller
from lora_operator.labels import ADC_LABEL, COMPONENT_LABEL, LFT_LABEL
from lora_operator.settings import OperatorSettings

LFT = "lorafinetunes"
ADC = "adapterconversions"
#: Retry delay of a reconcile that failed (an API outage): kopf's default of 60 s is long for a user waiting.
RETRY_SECONDS = 5


def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    """kopf bookkeeping in annotations (the status schema is pruned), one replica, and no events
    from kopf's log: the reconcile posts every event itself, once each (kopf would add one per
    retried failure)."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.posting.enabled = False
    settings.watching.server_timeout = 300
    settings.execution.max_workers = 16
    # kopf re-checks this often whether a timer has exited; a CR being deleted waits for that.
    settings.background.cancellation_polling = 1


def reconcile_run(meta: kopf.Meta, memo: kopf.Memo, **_: Any) -> None:
    """A LoraFinetune was created, resumed, changed, or is due for a resync."""
    memo.controller.reconcile("LoraFinetune", meta["namespace"], meta["name"])


def reconcile_conversion(meta: kopf.Meta, memo: kopf.Memo, **_: Any) -> None:
    """An AdapterConversion was created, resumed, changed, or is due for a resync."""
    memo.controller.reconcile("AdapterConversion", meta["namespace"], meta["name"])


def run_child_event(body: kopf.Body, type: str | None, memo: kopf.Memo, **_: Any) -> None:
    """A LoraFinetune's JobSet or export Job changed or went: the run is reconciled at once."""
    memo.controller.child_changed(dict(body), "LoraFinetune", LFT_LABEL, type)


def conversion_child_event(body: kopf.Body, type: str | None, memo: kopf.Memo, **_: Any) -> None:
    """A conversion Job changed or went."""
    memo.controller.child_changed(dict(body), "AdapterConversion", ADC_LABEL, type)


async def read_progress(meta: kopf.Meta, spec: kopf.Spec, memo: kopf.Memo, **_: Any) -> None:
    """Timer while Running: copy `<output.uri>/progress.json` into status (the pods have no API
    rights). Awaited in the event loop with a bounded wait, the status written off it."""
    controller: Controller = memo.controller
    record = await controller.reader.aread(spec["output"]["uri"])
    if record is not None:
        await asyncio.to_thread(controller.record_progress, meta["namespace"], meta["name"], record)


def _in_flight(status: kopf.Status, **_: Any) -> bool:
    return status.get("phase") in (Phase.PENDING, Phase.RUNNING, Phase.SUSPENDED, Phase.EXPORTING)


def _converting(status: kopf.Status, **_: Any) -> bool:
    return status.get("phase") in (Phase.PENDING, Phase.RUNNING)


def _running(status: kopf.Status, **_: Any) -> bool:
    return status.get("phase") == Phase.RUNNING


def build_registry(settings: OperatorSettings) -> kopf.OperatorRegistry:
    """Every handler of the operator, with the timer interval from the settings."""
    registry = kopf.OperatorRegistry()
    kopf.on.startup(registry=registry)(configure)
    for decorator in (kopf.on.create, kopf.on.resume, kopf.on.update):
        decorator(GROUP, VERSION, LFT, registry=registry, id="reconcile", backoff=RETRY_SECONDS)(reconcile_run)
        decorator(GROUP, VERSION, ADC, registry=registry, id="reconcile", backoff=RETRY_SECONDS)(reconcile_conversion)
    interval = settings.progress_poll_seconds
    kopf.timer(GROUP, VERSION, LFT, interval=interval, when=_running, registry=registry, id="progress")(read_progress)
    # The resync's first read waits one interval: a new run's children were just made, and on a
    # restart the resume handlers and the children's watches already reconcile every CR.
    kopf.timer(GROUP, VERSION, LFT, interval=interval, initial_delay=interval, when=_in_flight, registry=registry,
               id="resync")(reconcile_run)
    kopf.timer(GROUP, VERSION, ADC, interval=interval, initial_delay=interval, when=_converting, registry=registry,
               id="resync")(reconcile_conversion)
    kopf.on.event(JOBSET_GROUP, JOBSET_VERSION, "jobsets", labels={LFT_LABEL: kopf.PRESENT}, registry=registry)(run_child_event)
    kopf.on.event("batch", "v1", "jobs", labels={LFT_LABEL: kopf.PRESENT, COMPONENT_LABEL: "export"}, registry=registry)(run_child_event)
    kopf.on.event("batch", "v1", "jobs", labels={ADC_LABEL: kopf.PRESENT, COMPONENT_LABEL: "convert"},
                  registry=registry)(conversion_child_event)
    return registry

