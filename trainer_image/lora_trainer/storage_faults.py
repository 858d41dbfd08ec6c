"""Storage exceptions -> the exit-code table: one verdict for every client the trainer reaches GCS with.

Why one table: a gs:// path is read and written by google-cloud-storage (`lora_trainer.storage`),
gcsfs (Orbax's directories, through etils.epath) and TensorStore (Orbax's arrays), and each states
the same fault its own way: an exception class with an HTTP status (`google.api_core`, gcsfs's
`HttpError`), a builtin (`FileNotFoundError`, `PermissionError`, `ConnectionError`), a transport
library's class (requests, aiohttp, urllib3), or a `ValueError` whose text holds an absl status
(`UNAVAILABLE: ... HTTP response code: 503`). Classified in one place, a fault exits 42 (the JobSet
restarts, the run resumes) or 3 (the message names the location and the fix) whichever client met
it, and anything else keeps its traceback as the bug it is.

The verdicts: throttling (429), request timeouts (408), server errors (5xx), dropped, refused or
timed-out connections, corrupted transfers and an exhausted retry deadline are retriable. A missing
bucket, a missing object read, a denied request (401, 403) and other refused requests (4xx) are the
user's to fix. An object missing while a write runs (a retried upload or delete whose first attempt
had already done the work, then found nothing) is retriable when the bucket exists. A full or
read-only local disk is the user's to fix. Pure: the caller says how to learn whether a bucket exists.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable

from lora_trainer.errors import RetriableError, TrainerError, UserError, is_device_oom, one_line

#: Environment variable: seconds one gs:// call keeps retrying a transient fault before giving up.
RETRY_DEADLINE_ENV = "LORA_STORAGE_RETRY_DEADLINE_S"
#: HTTP statuses after which the same request may succeed: request timeout, throttling, server errors.
RETRIABLE_STATUS = frozenset({408, 429, *range(500, 600)})
#: Packages whose exceptions are transport faults (a connection refused, reset or timed out, a body cut short).
_TRANSPORT_PACKAGES = frozenset({"requests", "urllib3", "aiohttp", "httpx", "httpcore"})
#: Class names of corrupted transfers (a checksum that does not match): google-cloud-storage, gcsfs.
_CORRUPTION = frozenset({"DataCorruption", "ChecksumError"})
#: How TensorStore (and Orbax re-raising it) states an HTTP status in its error text.
_HTTP_IN_TEXT = re.compile(r"HTTP response code: (\d{3})")
#: Markers of a transient fault in TensorStore's text: absl status codes, and its own words for a
#: GCS endpoint it could not reach ("All N retry attempts failed").
_TRANSIENT_TEXT = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED", "retry attempts failed", "Connection reset", "timed out")
#: Markers of a request GCS or TensorStore refused as malformed (a bucket name it cannot hold, ...).
_REFUSED_TEXT = ("INVALID_ARGUMENT", "Invalid GCS bucket name")
#: Markers of a refused request in TensorStore's and gcsfs's text (absl codes; gcsfs's 403 `OSError("Forbidden: ...")`).
_DENIED_TEXT = ("PERMISSION_DENIED", "UNAUTHENTICATED", "Forbidden:")
#: Markers of a missing object or directory in TensorStore's and Orbax's text (absl's code; Orbax's
#: `ValueError("Checkpoint directory does not exist: gs://...")`, met when a brownout hides the
#: directory its own save is finalizing).
_MISSING_TEXT = ("NOT_FOUND", "Checkpoint directory does not exist")
#: Local errors that the same run meets again: no space, over quota, a read-only file system.
_LOCAL_FULL = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exhausted", errno.EROFS: "the file system is read-only"}


def http_status(exc: BaseException) -> int | None:
    """The HTTP error status an exception carries (`status`, `code`, or its `response`'s), if any (>= 400).

    Read lazily, in that order: aiohttp warns when its deprecated `code` is touched.
    """
    response = getattr(exc, "response", None)
    lookups = ((exc, "status"), (exc, "code"), (response, "status_code"), (response, "status"))
    for owner, attr in lookups:
        value = getattr(owner, attr, None)
        if isinstance(value, bool):
            continue
        try:
            status = int(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            continue
        if 400 <= status < 600:
            return status
    return None


def _transport_fault(exc: BaseException) -> bool:
    """A connection refused, reset, dropped or timed out, or a transfer that arrived corrupted."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    names = {c.__name__ for c in type(exc).__mro__}
    if names & _CORRUPTION or ("TransportError" in names and type(exc).__module__.startswith("google.auth")):
        return True
    return any(c.__module__.split(".", 1)[0] in _TRANSPORT_PACKAGES for c in type(exc).__mro__)


def classify(
    exc: BaseException,
    uri: str,
    *,
    subject: str | None = None,
    writing: bool = False,
    bucket_missing: Callable[[], bool] = lambda: False,
    deadline_s: float | None = None,
) -> TrainerError | None:
    """The exit-code table's error for `exc`, raised while accessing `uri`; None when it is no storage fault.

    `subject` is how messages name what was accessed (default `uri`); `writing` says the call was
    writing or deleting; `bucket_missing()` is asked only for a 404, to tell a missing bucket (the
    user's) from a missing object; `deadline_s` is the retry deadline an exhausted retry ran for.
    """
    if isinstance(exc, TrainerError):
        return exc
    if is_device_oom(exc):  # XLA's RESOURCE_EXHAUSTED for accelerator memory (the CLI's), not GCS throttling
        return None
    subject = subject or uri
    if type(exc).__name__ == "RetryError" and type(exc).__module__.startswith("google.api_core"):
        cause = getattr(exc, "cause", None) or exc
        return RetriableError(
            f"storage unreachable for {deadline_s or 0:.0f}s ({RETRY_DEADLINE_ENV}) while accessing {subject}: {one_line(cause)}",
            uri=uri,
        )
    # The text of the kinds TensorStore and gcsfs state GCS faults in; other exceptions' text says nothing here.
    text = str(exc) if uri.startswith("gs://") and isinstance(exc, (ValueError, RuntimeError, OSError)) else ""
    status = http_status(exc)
    if status is None and (found := _HTTP_IN_TEXT.search(text)):
        status = int(found[1])
    detail = f"HTTP {status}: {one_line(exc)}" if status else one_line(exc)
    if status in RETRIABLE_STATUS or (status is None and _transport_fault(exc)):
        return RetriableError(f"storage fault while accessing {subject}: {detail}", uri=uri)
    if type(exc).__name__ == "RefreshError" and type(exc).__module__.startswith("google.auth"):
        return _credentials_refused(exc, uri)
    if status in (401, 403) or isinstance(exc, PermissionError) or any(m in text for m in _DENIED_TEXT):
        return _denied(uri, subject, detail)
    if status == 404 or (uri.startswith("gs://") and isinstance(exc, FileNotFoundError)) or any(m in text for m in _MISSING_TEXT):
        return _missing(exc, uri, subject, writing, bucket_missing)
    if status is not None and status < 500:
        return UserError(f"storage refused a request for {subject} ({detail}): check the URI", uri=uri)
    if any(m in text for m in _REFUSED_TEXT):
        return UserError(f"storage refused a request for {subject} ({detail}): check the URI", uri=uri)
    if isinstance(exc, OSError) and exc.errno in _LOCAL_FULL:
        return _disk_full(exc, uri, subject)
    if any(m in text for m in _TRANSIENT_TEXT):
        return RetriableError(f"storage fault while accessing {subject}: {detail}", uri=uri)
    return None


def _denied(uri: str, subject: str, detail: str) -> UserError:
    """401/403 or a local permission error, with what to fix."""
    fix = (
        "give the pod's service account (Workload Identity) read and write access to the bucket "
        "(roles/storage.objectUser), or fix the URI"
        if uri.startswith("gs://")
        else "make it readable (and its directory writable, for an output), or choose another path"
    )
    return UserError(f"access to {subject} was denied ({detail}): {fix}", uri=uri)


def _disk_full(exc: OSError, uri: str, subject: str) -> UserError:
    """A full or read-only local disk (`_LOCAL_FULL`)."""
    return UserError(
        f"cannot write {subject}: {_LOCAL_FULL[exc.errno]} ({exc.filename or exc}): free space, give the pod more "
        "ephemeral storage, or point the output at gs://",
        uri=uri,
    )


def _missing(exc: BaseException, uri: str, subject: str, writing: bool, bucket_missing: Callable[[], bool]) -> TrainerError:
    """A 404: the bucket's absence is the user's; an object gone under a write is a retried request's echo."""
    bucket = uri[len("gs://") :].split("/", 1)[0] if uri.startswith("gs://") else ""
    if bucket and bucket_missing():
        return UserError(
            f"{subject}: bucket {bucket!r} does not exist: create it (gcloud storage buckets create gs://{bucket}) "
            "or fix the URI",
            uri=uri,
        )
    if writing:
        return RetriableError(
            f"storage fault while writing {subject}: an object was gone when a retried request reached it "
            f"({one_line(exc)}), as when a first attempt had done the work but its answer was lost",
            uri=uri,
        )
    return UserError(f"{subject} does not exist: check the URI", uri=uri)


def _credentials_refused(exc: BaseException, uri: str) -> TrainerError:
    """Credentials that could not be refreshed: in a pod the metadata server may lag or blip (retriable);
    elsewhere the user's login has expired or was revoked."""
    if in_cluster():
        return RetriableError(
            f"could not refresh Google Cloud credentials to access {uri} ({one_line(exc)}); on GKE the Workload "
            "Identity metadata server may be briefly unavailable",
            uri=uri,
        )
    return UserError(
        f"Google Cloud credentials for {uri} were refused when refreshed ({one_line(exc)}): run `gcloud auth "
        "application-default login` again (or set GOOGLE_APPLICATION_CREDENTIALS to a valid key file)",
        uri=uri,
    )


def in_cluster() -> bool:
    """True in a Kubernetes pod, where a credential server that lags or blips is a transient fault."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
