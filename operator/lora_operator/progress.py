"""Training progress without Kubernetes rights for the trainer: read `<output.uri>/progress.json`.

Process 0 of the trainer writes the file atomically every log interval (see docs/dev/contracts.md,
"Progress channel"); the operator reads it on a timer for Running CRs with the same storage
module the trainer uses (local paths and gs://, Workload Identity on GKE) and copies the fields
into the CR status. The pods never talk to the API server.

Storage can stall (a GCS brownout answers nothing for minutes): `ProgressReader` runs each read
in a daemon thread of its own, at most `slots` at once and one per URI, and its callers wait a
bounded time, so a stalled bucket never holds kopf's workers, a new run's JobSet, or a graceful
stop; a read that has not answered in time counts as "no news" and the status keeps its numbers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
from typing import Any

from lora_operator.api import MAX_SHORT, MAX_STATUS_URI
from lora_trainer import storage
from lora_trainer.errors import TrainerError

PROGRESS_FILE = "progress.json"
#: Seconds a caller waits for one read (the timer, and the last read when training ends).
READ_TIMEOUT = 5.0
#: Reads in flight at most; more are skipped (they would only queue behind a stalled bucket).
READ_SLOTS = 8

log = logging.getLogger(__name__)


def read_progress(output_uri: str) -> dict[str, Any] | None:
    """The trainer's last progress record, or None while there is none (or it cannot be read now)."""
    uri = storage.join(output_uri, PROGRESS_FILE)
    try:
        text = storage.read_text(uri)
    except TrainerError as e:
        log.debug("no progress yet at %s: %s", uri, e)
        return None
    except Exception as e:  # e.g. missing cloud credentials: report, keep the timer alive
        log.warning("cannot read progress %s: %s: %s", uri, type(e).__name__, e)
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        log.warning("ignoring malformed progress record %s: %s", uri, e)
        return None
    return record if isinstance(record, dict) else None


class ProgressReader:
    """Bounded, non-blocking reads of progress records (see the module docstring)."""

    def __init__(self, *, slots: int = READ_SLOTS, timeout: float = READ_TIMEOUT) -> None:
        self.timeout = timeout
        self._slots = slots
        self._lock = threading.Lock()
        self._inflight: dict[str, concurrent.futures.Future[dict[str, Any] | None]] = {}

    def _start(self, output_uri: str) -> concurrent.futures.Future[dict[str, Any] | None] | None:
        """The read of `output_uri` in flight (a new one if none and a slot is free), or None."""
        with self._lock:
            if (future := self._inflight.get(output_uri)) is not None:
                return future
            if len(self._inflight) >= self._slots:
                log.warning("skipping the progress read of %s: %d reads are still waiting for storage", output_uri, self._slots)
                return None
            future = self._inflight[output_uri] = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(read_progress(output_uri))
            except BaseException as e:  # read_progress reports what it can; anything else ends here
                future.set_exception(e)
            finally:
                with self._lock:
                    self._inflight.pop(output_uri, None)

        threading.Thread(target=run, name=f"progress-{output_uri}", daemon=True).start()
        return future

    def read(self, output_uri: str) -> dict[str, Any] | None:
        """The record, waiting at most `timeout` (for a worker thread: the last read of a run)."""
        future = self._start(output_uri)
        try:
            return None if future is None else future.result(self.timeout)
        except concurrent.futures.TimeoutError:
            log.warning("no answer from storage for %s within %.0fs; the status keeps its last progress", output_uri, self.timeout)
            return None

    async def aread(self, output_uri: str) -> dict[str, Any] | None:
        """The record, awaited at most `timeout` in the event loop (the progress timer)."""
        future = self._start(output_uri)
        if future is None:
            return None
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.timeout)
        except TimeoutError:
            log.warning("no answer from storage for %s within %.0fs; the status keeps its last progress", output_uri, self.timeout)
            return None


def _fmt(value: Any, digits: int) -> str | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"{value:.{digits}g}"
    return None


def progress_status(record: dict[str, Any], total_steps: int) -> dict[str, Any]:
    """Status fields from a progress record (only the ones present and well-typed)."""
    out: dict[str, Any] = {}
    step = record.get("step")
    total = record.get("totalSteps") if isinstance(record.get("totalSteps"), int) else total_steps
    if isinstance(step, int) and not isinstance(step, bool):
        out["step"] = step
        out["totalSteps"] = total
        out["progress"] = f"{step}/{total}"
    if (loss := _fmt(record.get("loss"), 4)) is not None:
        out["loss"] = loss
    if (tps := _fmt(record.get("tokensPerSecond"), 4)) is not None:
        out["tokensPerSecond"] = tps
    if (mfu := _fmt(record.get("mfu"), 3)) is not None:
        out["mfu"] = mfu
    # Strings from the record are the trainer's: bounded as the status schema bounds them.
    if isinstance(record.get("eta"), str) and len(record["eta"]) <= MAX_SHORT:
        out["eta"] = record["eta"]
    if isinstance(record.get("lastCheckpoint"), str) and len(record["lastCheckpoint"]) <= MAX_STATUS_URI:
        out["lastCheckpoint"] = record["lastCheckpoint"]
    return out
