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

from lora_operator.api import MAX_SHORT, MAX_STATUS_URI, LoraFinetuneStatus
from lora_trainer import storage
from lora_trainer.errors import TrainerError
from lora_trainer.progress_record import ProgressRecord

PROGRESS_FILE = "progress.json"
#: Seconds a caller waits for one read (the timer, and the last read when training ends).
READ_TIMEOUT = 5.0
#: Reads in flight at most; more are skipped (they would only queue behind a stalled bucket).
READ_SLOTS = 8

log = logging.getLogger(__name__)


def read_progress(output_uri: str) -> ProgressRecord | None:
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
    return ProgressRecord.parse(record)


class ProgressReader:
    """Bounded, non-blocking reads of progress records (see the module docstring)."""

    def __init__(self, *, slots: int = READ_SLOTS, timeout: float = READ_TIMEOUT) -> None:
        self.timeout = timeout
        self._slots = slots
        self._lock = threading.Lock()
        self._inflight: dict[str, concurrent.futures.Future[ProgressRecord | None]] = {}

    def _start(self, output_uri: str) -> concurrent.futures.Future[ProgressRecord | None] | None:
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

    def read(self, output_uri: str) -> ProgressRecord | None:
        """The record, waiting at most `timeout` (for a worker thread: the last read of a run)."""
        future = self._start(output_uri)
        try:
            return None if future is None else future.result(self.timeout)
        except concurrent.futures.TimeoutError:
            log.warning("no answer from storage for %s within %.0fs; the status keeps its last progress", output_uri, self.timeout)
            return None

    async def aread(self, output_uri: str) -> ProgressRecord | None:
        """The record, awaited at most `timeout` in the event loop (the progress timer)."""
        future = self._start(output_uri)
        if future is None:
            return None
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.timeout)
        except TimeoutError:
            log.warning("no answer from storage for %s within %.0fs; the status keeps its last progress", output_uri, self.timeout)
            return None


def _fmt(value: float | None, digits: int) -> str | None:
    return None if value is None else f"{value:.{digits}g}"


def progress_fields(record: ProgressRecord, total_steps: int) -> LoraFinetuneStatus:
    """The partial status a progress record sets (only the fields present and well-typed)."""
    fields: dict[str, Any] = {}
    total = record.total_steps if record.total_steps is not None else total_steps
    if record.step is not None:
        fields.update(step=record.step, total_steps=total, progress=f"{record.step}/{total}")
    fields.update(loss=_fmt(record.loss, 4), tokens_per_second=_fmt(record.tokens_per_second, 4), mfu=_fmt(record.mfu, 3))
    # Strings from the record are the trainer's: bounded as the status schema bounds them.
    if record.eta is not None and len(record.eta) <= MAX_SHORT:
        fields["eta"] = record.eta
    if record.last_checkpoint is not None and len(record.last_checkpoint) <= MAX_STATUS_URI:
        fields["last_checkpoint"] = record.last_checkpoint
    return LoraFinetuneStatus(**{k: v for k, v in fields.items() if v is not None})


def progress_status(record: ProgressRecord | dict[str, Any], total_steps: int) -> dict[str, Any]:
    """Status fields (wire names) from a progress record (its decoded JSON or the typed record)."""
    typed = record if isinstance(record, ProgressRecord) else ProgressRecord.parse(record) or ProgressRecord()
    return progress_fields(typed, total_steps).to_patch()
