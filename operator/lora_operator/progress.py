"""Training progress without Kubernetes rights for the trainer: read `<output.uri>/progress.json`.

Process 0 of the trainer writes the file atomically every log interval (see docs/dev/contracts.md,
"Progress channel"); the operator reads it on a timer for Running CRs with the same storage
module the trainer uses (local paths and gs://, Workload Identity on GKE) and copies the fields
into the CR status. The pods never talk to the API server.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from lora_trainer import storage
from lora_trainer.errors import TrainerError

PROGRESS_FILE = "progress.json"

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
    if isinstance(record.get("eta"), str):
        out["eta"] = record["eta"]
    if isinstance(record.get("lastCheckpoint"), str):
        out["lastCheckpoint"] = record["lastCheckpoint"]
    return out
