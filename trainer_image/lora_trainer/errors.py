"""Errors that map to the exit-code table: one paragraph that names the thing and the fix."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping

from lora_trainer import exit_codes


class TrainerError(Exception):
    """Base of errors the CLI turns into an exit code and a one-paragraph message."""

    exit_code = exit_codes.USER_ERROR

    def __init__(self, message: str, *, uri: str | None = None) -> None:
        super().__init__(message)
        self.uri = uri
        """The storage location the error is about, if any: `naming_fields` names the flag or field that gave it."""


class UserError(TrainerError):
    """Bad config, model files, data or adapter: retrying will not help; the message says what to change."""

    exit_code = exit_codes.USER_ERROR


class RetriableError(TrainerError):
    """A transient fault (storage outage): the JobSet restarts and the run resumes."""

    exit_code = exit_codes.RETRIABLE


class Preempted(TrainerError):
    """SIGTERM (preemption, node maintenance), after the checkpoint was committed: the JobSet restarts
    the run without counting it toward maxRestarts, and the run resumes."""

    exit_code = exit_codes.PREEMPTED


class Interrupted(TrainerError):
    """Ctrl-C (a run by hand), handled like a preemption (the checkpoint saved first): a rerun resumes."""

    exit_code = exit_codes.INTERRUPTED


def shown(value: object, limit: int = 80) -> str:
    """A value as an error message shows it: its repr, cut at `limit` characters (a hostile one may be huge)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def one_line(exc: BaseException, limit: int = 400) -> str:
    """An exception's text on one line, cut at `limit` characters (TensorStore and gcsfs put specs and HTTP
    bodies in theirs), so that the paragraph it ends up in stays one line."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[:limit] + "..."


@contextlib.contextmanager
def naming_fields(fields: Mapping[str, str | None]) -> Iterator[None]:
    """Start the message of an error about a storage location with the flag or config field that named it.

    `fields` maps each flag or field (`model.source`, `--base`) to the URI it holds. Why: storage
    code sees only URIs, deep down (`gs://b/run/checkpoints/4/lora`), while the person reading the
    error wrote a field; the field whose URI is the longest prefix of the error's (at a `/`) is named.
    """
    try:
        yield
    except TrainerError as e:
        field = _field_of(e.uri, fields)
        if field is not None and not str(e).startswith(field):
            e.args = (f"{field} {fields[field]}: {e}", *e.args[1:])
        raise


def _field_of(uri: str | None, fields: Mapping[str, str | None]) -> str | None:
    if not uri:
        return None
    holding = [(len(v), f) for f, v in fields.items() if v and (uri == v or uri.startswith(v.rstrip("/") + "/"))]
    return max(holding)[1] if holding else None


#: Class names XLA raises its runtime errors as (`jax.errors.JaxRuntimeError`; jaxlib < 0.5 `XlaRuntimeError`).
_XLA_ERROR_CLASSES = frozenset({"JaxRuntimeError", "XlaRuntimeError"})
#: XLA's status code for a failed allocation, at the start of the error message.
_XLA_OOM = "RESOURCE_EXHAUSTED:"
#: Sizes as XLA states them: "allocate 1234 bytes", "allocating 8589934592 bytes", "allocate 1.23G".
_ALLOCATION = re.compile(r"allocat\w*\s+(?:(\d+)\s*bytes|(\d+(?:\.\d+)?\s*[KMGT]i?B?)\b)", re.IGNORECASE)
#: How a train config lowers memory per chip, field by field (the CR's spec uses the same names).
_TRAIN_OOM_FIXES = (
    "a smaller training.globalBatchSize, or the same batch split into micro-batches with a larger "
    "training.gradientAccumulation; a shorter dataset.maxSeqLen; model.dtype bfloat16 if it is float32; "
    "QLoRA via lora.quantization (e.g. weightQtype: nf4); or more chips (spec.tpu.topology, spec.tpu.slices) "
    "with training.mesh.fsdp unset or raised so the weights are sharded over all of them"
)


def is_device_oom(exc: BaseException) -> bool:
    """True when `exc` is XLA running out of accelerator memory.

    Matched by class name so that classifying needs no JAX import (commands import it lazily)
    and older jaxlib's `XlaRuntimeError` matches too; RESOURCE_EXHAUSTED must also mention
    memory or an allocation, so that other exhausted resources (e.g. a gRPC limit between
    hosts) keep their traceback.
    """
    if not any(c.__name__ in _XLA_ERROR_CLASSES for c in type(exc).__mro__):
        return False
    text = str(exc).strip()
    return text.startswith(_XLA_OOM) and re.search(r"memory|allocat", text, re.IGNORECASE) is not None


def device_oom_message(exc: BaseException, command: str) -> str | None:
    """The fix-it paragraph when `exc` is XLA running out of accelerator memory (`is_device_oom`), else None.

    Why a user error: the same config allocates the same buffers again, so a JobSet restart
    would only burn `maxRestarts`.
    """
    if not is_device_oom(exc):
        return None
    text = str(exc).strip()
    found = _ALLOCATION.search(text)
    size = ""
    if found:
        size = f" of {_gib(int(found[1]))}" if found[1] else f" of {found[2]}"
    fixes = _TRAIN_OOM_FIXES if command == "train" else "run it on a machine with more accelerator memory"
    return (
        f"out of accelerator memory: XLA could not make an allocation{size} ({text.splitlines()[0][:300]}). "
        f"The same settings will run out again, so this is not retried. Lower the memory needed per chip: {fixes}."
    )


def _gib(n: int) -> str:
    """Bytes in the unit people size accelerators in."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**20 else f"{n} bytes"
