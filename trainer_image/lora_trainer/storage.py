"""Local paths and `gs://` URIs behind one small set of functions.

Why one module: the trainer, the exporter and the operator's progress reader all move
bytes between a bucket and a local disk, and each output must appear only when complete.
Keeping that in one place gives one answer to "is this written yet?" and one place that
turns storage faults into the exit-code table (missing things are the user's to fix;
outages are retriable).

`gs://` goes through google-cloud-storage, which honours `STORAGE_EMULATOR_HOST` (tests
point it at a gcp-storage-emulator on loopback). `hf://ORG/NAME[@REVISION][/FILE]` is
read-only and goes through huggingface_hub (token from `HF_TOKEN`, which the operator
mounts from `spec.hfTokenSecretRef`; its cache honours `HF_HUB_CACHE`/`HF_HUB_OFFLINE`).
Both clients are imported lazily so that a local-only run never needs credentials.
Nothing here imports JAX.

Every gs:// call retries transient faults (5xx, 429, refused or dropped connections) with
google-cloud-storage's backoff until `LORA_STORAGE_RETRY_DEADLINE_S` seconds have passed
(default 120, the client's own deadline), then raises RetriableError: a blip costs nothing,
an outage ends the process with exit 42 within about that time, and the restarted run
resumes from its last committed checkpoint. Uploads are retried too: every object here is
written whole and overwriting it with the same bytes is harmless. `classify` is the one table
from storage exceptions (google-cloud-storage, gcsfs, TensorStore, local) to exit codes.

Names are confined (`confined_name`): a file or object name mapped onto a destination directory
is a relative path of plain components, and a local source's symbolic links point to files inside
it, so that no copy here writes, or carries into an output, anything outside the two directories.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

from lora_trainer.errors import RetriableError, UserError
from lora_trainer.storage_faults import RETRY_DEADLINE_ENV, classify, in_cluster

GS = "gs://"
HF = "hf://"
#: What a base model needs from a hub repository: weights, configs, tokenizer files.
HF_MODEL_FILES = ["*.safetensors", "*.json", "*.model", "*.txt", "*.jinja"]
#: google-cloud-storage's own deadline: long enough to ride out blips without a restart (which
#: costs a model reload and a recompilation), short enough that an outage ends in exit 42.
DEFAULT_RETRY_DEADLINE_S = 120.0
#: google-cloud-storage's per-request timeout; a shorter retry deadline caps it.
_REQUEST_TIMEOUT_S = 60.0
#: TensorStore's own backoff between GCS attempts (its defaults): from 1 s, doubling, at most 32 s.
_TS_FIRST_DELAY_S, _TS_MAX_DELAY_S = 1.0, 32.0


def is_gcs(uri: str) -> bool:
    """True for `gs://bucket/...` URIs."""
    return str(uri).startswith(GS)


def is_hf(uri: str) -> bool:
    """True for `hf://org/name...` URIs (read-only)."""
    return str(uri).startswith(HF)


def split_hf(uri: str) -> tuple[str, str | None, str]:
    """`hf://org/name@rev/sub/file` -> ("org/name", "rev", "sub/file"); revision None means the default branch."""
    parts = uri[len(HF) :].strip("/").split("/")
    if len(parts) < 2 or not all(parts[:2]):
        raise UserError(f"{uri!r} is not a hub repository: write hf://ORG/NAME (optionally @REVISION)")
    name, _, revision = parts[1].partition("@")
    return f"{parts[0]}/{name}", revision or None, "/".join(parts[2:])


@contextlib.contextmanager
def _hf_errors(uri: str) -> Iterator[None]:
    """Map huggingface_hub failures onto the exit-code table, naming the URI."""
    from huggingface_hub import errors as hf_errors

    # LocalEntryNotFoundError subclasses EntryNotFoundError: test it first.
    try:
        yield
    except hf_errors.LocalEntryNotFoundError as e:
        raise RetriableError(
            f"cannot download {uri}: the hub is unreachable and the files are not in the local cache ({e}); "
            "retry, or copy the checkpoint to gs://BUCKET/PATH and use that URI"
        ) from e
    except (hf_errors.RepositoryNotFoundError, hf_errors.RevisionNotFoundError, hf_errors.EntryNotFoundError) as e:
        raise UserError(
            f"{uri} was not found on the hub (or is gated and no token was given): check the name and revision, "
            "and set spec.hfTokenSecretRef to a Secret holding a token with access"
        ) from e
    except hf_errors.HfHubHTTPError as e:
        raise RetriableError(f"hub error while downloading {uri}: {e}") from e


def _hf_download(uri: str, dest: Path | None = None) -> Path:
    """Download a hub file or (model files of a) repository; returns the local file or snapshot directory."""
    import huggingface_hub

    repo, revision, path = split_hf(uri)
    with _hf_errors(uri):
        if path:
            return Path(huggingface_hub.hf_hub_download(repo, path, revision=revision))
        # Through the hub cache (shared across runs, honours HF_HUB_OFFLINE), then copied if asked.
        snapshot = Path(huggingface_hub.snapshot_download(repo, revision=revision, allow_patterns=HF_MODEL_FILES))
    if dest is None:
        return snapshot
    # A cached snapshot may hold more than this download asked for; copy the model files only.
    names = [n for n in local_files(snapshot, uri) if any(fnmatch.fnmatch(n.rsplit("/", 1)[-1], p) for p in HF_MODEL_FILES)]
    _copy_files(snapshot, names, dest)
    return dest


def local_path(uri: str | os.PathLike[str]) -> Path:
    """The filesystem path of a local URI (`file:///x` or a plain path)."""
    s = os.fspath(uri)
    if is_gcs(s):
        raise ValueError(f"{s} is not a local path")
    return Path(s[len("file://") :] if s.startswith("file://") else s)


def absolute_local_path(uri: str | os.PathLike[str]) -> Path:
    """`local_path`, absolute, with `.` and `..` resolved by name (`Path.parent` of `out/..` is
    `out`, not the directory `..` names); symlinks are kept, as the user wrote them."""
    return Path(os.path.abspath(local_path(uri)))


def absolute_uri(uri: str) -> str:
    """`uri` as a reader elsewhere can use it: gs:// as is, a local path made absolute (see
    `absolute_local_path`). For paths that are recorded (a checkpoint's base model, an adapter's
    `base_model_name_or_path`): relative, they named another directory once read from another one."""
    return uri if is_gcs(uri) else str(absolute_local_path(uri))


def join(uri: str, *parts: str) -> str:
    """Join path parts onto a local path or a gs:// URI."""
    s = os.fspath(uri)
    if is_gcs(s):
        return "/".join([s.rstrip("/"), *(p.strip("/") for p in parts)])
    return str(local_path(s).joinpath(*parts))


def split_gcs(uri: str) -> tuple[str, str]:
    """`gs://bucket/a/b` -> ("bucket", "a/b")."""
    bucket, _, blob = uri[len(GS) :].partition("/")
    if not bucket:
        raise UserError(f"{uri!r} has no bucket name; write gs://BUCKET/PATH")
    return bucket, blob.strip("/")


@lru_cache(maxsize=1)
def _client() -> Any:
    """One google-cloud-storage client per process (it honours STORAGE_EMULATOR_HOST)."""
    from google.cloud import storage

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(project="local", credentials=AnonymousCredentials())
    from google.auth.exceptions import DefaultCredentialsError

    try:
        return storage.Client()
    except DefaultCredentialsError as e:
        if in_cluster():  # GKE's metadata server can lag a pod's start: retry
            raise RetriableError(
                f"no Google Cloud credentials for gs:// ({e}); on GKE the Workload Identity metadata server may not "
                "be ready yet (the pod restarts); if this repeats, bind the pod's service account to a Google service "
                "account with access to the buckets (docs/tutorial.md)"
            ) from e
        raise UserError(
            "gs:// paths need Google Cloud credentials and none were found: run `gcloud auth application-default "
            "login` (or set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file), or use local paths"
        ) from e


def retry_deadline() -> float:
    """Seconds a gs:// call retries transient faults (`LORA_STORAGE_RETRY_DEADLINE_S`, default 120)."""
    raw = os.environ.get(RETRY_DEADLINE_ENV, "").strip()
    if not raw:
        return DEFAULT_RETRY_DEADLINE_S
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise UserError(f"{RETRY_DEADLINE_ENV}={raw!r} is not a positive number of seconds; unset it for the default 120")
    return value


def tensorstore_gcs_retries(deadline: float) -> dict[str, Any]:
    """TensorStore's `gcs_request_retries` context resource for a retry deadline of `deadline` seconds.

    Why: TensorStore, which writes and reads Orbax's array data, keeps its own schedule (32
    attempts, backoff doubling from 1 s up to 32 s: about a quarter of an hour) and reads it
    only from its context, never from the environment. Keeping its backoff and giving it the
    fewest attempts whose waits cover `deadline` makes a checkpoint save caught by an outage
    fail about when google-cloud-storage's calls do, instead of holding a slice for 15 minutes.
    """
    attempts, waited, delay = 0, 0.0, _TS_FIRST_DELAY_S
    while waited < deadline:
        attempts, waited, delay = attempts + 1, waited + delay, min(2 * delay, _TS_MAX_DELAY_S)
    return {"max_retries": max(attempts, 1), "initial_delay": f"{_TS_FIRST_DELAY_S:g}s", "max_delay": f"{_TS_MAX_DELAY_S:g}s"}


def _call() -> dict[str, Any]:
    """`retry` and `timeout` arguments for one google-cloud-storage call (read per call: tests change the env)."""
    from google.cloud.storage.retry import DEFAULT_RETRY

    deadline = retry_deadline()
    return {"retry": DEFAULT_RETRY.with_timeout(deadline), "timeout": min(_REQUEST_TIMEOUT_S, deadline)}


@contextlib.contextmanager
def faults(uri: str, *, subject: str | None = None, writing: bool = False) -> Iterator[None]:
    """Raise what `storage_faults.classify` makes of a storage exception in the block (about `uri`); others pass.

    `subject` names what was accessed in the message (default `uri`); `writing` marks a block that
    writes or deletes, where an object gone under a retried request is a transient fault.
    """
    try:
        yield
    except Exception as e:
        error = classify(
            e, uri, subject=subject, writing=writing, bucket_missing=lambda: _bucket_missing(uri), deadline_s=_deadline_or_none()
        )
        if error is None or error is e:
            raise
        raise error from e


def _deadline_or_none() -> float | None:
    """The retry deadline for a message; None when its setting is itself invalid (that error comes first elsewhere)."""
    try:
        return retry_deadline()
    except UserError:
        return None


def _bucket_missing(uri: str) -> bool:
    """True when the bucket of gs:// `uri` certainly does not exist (one listing, no retries: asked after a 404)."""
    from google.api_core import exceptions as gexc

    bucket, _ = split_gcs(uri)
    try:
        next(iter(_client().list_blobs(bucket, max_results=1, retry=None, timeout=10)), None)
    except gexc.NotFound:
        return True
    except Exception:  # cannot tell now: no verdict against the bucket
        return False
    return False


def _blob(uri: str) -> Any:
    bucket, name = split_gcs(uri)
    return _client().bucket(bucket).blob(name)


def read_bytes(uri: str) -> bytes:
    """Whole file or object; a missing one is a UserError naming it."""
    if is_gcs(uri):
        with faults(uri):
            return _blob(uri).download_as_bytes(**_call())
    if is_hf(uri):
        return _hf_download(uri).read_bytes()
    path = local_path(uri)
    try:
        return path.read_bytes()
    except FileNotFoundError as e:
        raise UserError(f"{path} does not exist: check the path") from e
    except IsADirectoryError as e:
        raise UserError(f"{path} is a directory, not a file: name the file itself") from e
    except PermissionError as e:
        raise UserError(f"{path} cannot be read (permission denied): make it readable") from e


def md5_and_size(uri: str) -> tuple[str, int] | None:
    """A gs:// object's MD5 (base64, as GCS keeps it) and size, from its metadata: no download.
    None for other locations, a missing object (reading it says so) and an object without an MD5 (a composite)."""
    if not is_gcs(uri):
        return None
    bucket, name = split_gcs(uri)
    with faults(uri):
        blob = _client().bucket(bucket).get_blob(name, **_call())
    return (blob.md5_hash, int(blob.size)) if blob is not None and blob.md5_hash else None


def read_text(uri: str) -> str:
    """Whole file or object as UTF-8 text."""
    return read_bytes(uri).decode("utf-8")


def write_bytes(uri: str, data: bytes) -> None:
    """Write atomically: readers see the old content or the new, never a torn file.

    Locally via a temporary sibling and `os.replace`; a GCS object upload is atomic by itself.
    """
    if is_gcs(uri):
        with faults(uri, writing=True):
            _blob(uri).upload_from_string(data, **_call())
        return
    path = local_path(uri)
    if path.is_dir():
        raise UserError(f"{path} is a directory: name a file to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(uri: str, text: str) -> None:
    """`write_bytes` for UTF-8 text."""
    write_bytes(uri, text.encode("utf-8"))


def exists(uri: str) -> bool:
    """A file/object exists, or (gs://) any object lies under the prefix."""
    if is_hf(uri):
        try:
            _hf_download(uri)
        except UserError:
            return False
        return True
    if not is_gcs(uri):
        return local_path(uri).exists()
    bucket, name = split_gcs(uri)
    with faults(uri):
        if name and _blob(uri).exists(**_call()):
            return True
        prefix = f"{name}/" if name else ""
        return any(True for _ in _client().list_blobs(bucket, prefix=prefix, max_results=1, **_call()))


def listdir(uri: str) -> list[str]:
    """Names directly under a directory (gs://: the next path component of every object)."""
    if not is_gcs(uri):
        path = local_path(uri)
        return sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    bucket, name = split_gcs(uri)
    prefix = f"{name}/" if name else ""
    with faults(uri):
        names = {b.name[len(prefix) :].split("/", 1)[0] for b in _client().list_blobs(bucket, prefix=prefix, **_call())}
    return sorted(n for n in names if n)


def _walk_gcs(uri: str) -> Iterator[tuple[str, Any]]:
    """(relative path, blob) for every object under a gs:// directory."""
    bucket, name = split_gcs(uri)
    prefix = f"{name}/" if name else ""
    with faults(uri):
        for blob in _client().list_blobs(bucket, prefix=prefix, **_call()):
            rel = blob.name[len(prefix) :]
            if rel and not rel.endswith("/"):
                yield rel, blob


def confined_name(name: str, source: str) -> str:
    """`name`, a file's `/`-separated path relative to the directory `source`, when it stays inside any
    directory it is copied to; else a UserError naming both.

    Why: an object name is any string, and an object store has no directories to stop a path. Listed
    under `gs://b/adapter`, the object `adapter//tmp/x` is `/tmp/x` and `adapter/../../tmp/x` is
    `../../tmp/x`; joined onto a local directory either writes wherever it points. Only relative
    paths of plain components pass: none empty (a leading `/`, `//`, a trailing `/`), `.` or `..`, and
    no backslash (a separator on other systems) or control character (GCS refuses CR and LF).
    """
    parts = name.split("/")
    problem = (
        "an empty component (a leading '/' or a '//')" if "" in parts
        else "a '.' or '..' component" if {".", ".."} & set(parts)
        else "a backslash" if "\\" in name
        else "a control character" if any(ord(c) < 32 or ord(c) == 127 for c in name)
        else None
    )
    if problem is not None:
        raise UserError(
            f"{source.rstrip('/')}/{name} is named {name!r} below {source}, a name with {problem}: copied as named it "
            "would land outside the directory it is copied to, so nothing was copied. Names below a source must be "
            "relative paths of plain components: rename or delete that object or file",
            uri=source,
        )
    return name


def _link_root(directory: Path) -> Path:
    """Where the symbolic links under a local source may point: inside it, or for a snapshot of the hub's
    cache (`models--ORG--NAME/snapshots/REV`) inside its repository folder, whose `blobs/` its links name."""
    real = directory.resolve()
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith(("models--", "datasets--")):
        return real.parent.parent
    return real


def local_files(directory: Path, source: str | None = None) -> list[str]:
    """The `/`-separated names of every file under a local directory, each confined (`confined_name`).

    A symbolic link is followed only to a file inside the directory (`_link_root`); any other is a
    UserError naming it (`source`, default the directory, names the source): copied, it would carry
    a file from elsewhere on the machine (a token, a key) into an output. Directory links are not
    descended into, and other special files (sockets, pipes) are skipped.
    """
    source = source or str(directory)
    root = _link_root(directory)
    names = []
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(directory).as_posix()
        if path.is_symlink():
            target = path.resolve()
            if not (target.is_file() and target.is_relative_to(root)):
                raise UserError(
                    f"{source} holds {rel!r}, a symbolic link to {target}: only links to files inside {root} are "
                    "followed (a copy would carry what it points to into the output), so nothing was copied: replace "
                    "the link by the file itself",
                    uri=source,
                )
        if path.is_file():
            names.append(confined_name(rel, source))
    return names


def _copy_files(src: Path, names: list[str], dest: Path) -> None:
    """Copy the files `names` (checked by `local_files`) from `src` into `dest`, keeping their relative paths."""
    for name in names:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / name, target)


def _objects(uri: str) -> list[tuple[str, Any]]:
    """(relative name, blob) of every object under a gs:// directory, each name confined, read whole before
    any is copied; a name that is both an object and a directory of others is refused too."""
    objects = [(confined_name(rel, uri), blob) for rel, blob in _walk_gcs(uri)]
    names = {rel for rel, _ in objects}
    for rel in sorted(names):
        parent = rel.rsplit("/", 1)[0] if "/" in rel else ""
        while parent:
            if parent in names:
                raise UserError(
                    f"{uri} holds both an object named {parent!r} below it and objects below {parent}/: a local "
                    "directory cannot hold both, so nothing was copied: rename or delete one of them",
                    uri=uri,
                )
            parent = parent.rsplit("/", 1)[0] if "/" in parent else ""
    return objects


def download_dir(uri: str, dest: str | os.PathLike[str]) -> Path:
    """Copy every file under `uri` into the local directory `dest`; a missing source is a UserError.

    For `hf://` repositories only the model files (weights, JSON configs, tokenizer) are fetched.
    Every name is checked before anything is copied (`confined_name`, `local_files`).
    """
    dest_path = Path(dest)
    if is_hf(uri):
        return _hf_download(uri, dest_path)
    if not is_gcs(uri):
        src = local_path(uri)
        if not src.is_dir():
            raise UserError(f"{src} is not a directory: check the path")
        _copy_files(src, local_files(src, uri), dest_path)
        return dest_path
    objects = _objects(uri)
    if not objects:
        raise UserError(f"{uri} holds no files: check the URI", uri=uri)
    for rel, blob in objects:
        target = dest_path / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        with faults(f"{uri.rstrip('/')}/{rel}"):
            blob.download_to_filename(str(target), **_call())
    return dest_path


def upload_dir(src: str | os.PathLike[str], uri: str) -> None:
    """Copy every file under the local directory `src` to `uri` (a local path or gs://); names and links
    are checked first (`local_files`)."""
    src_path = Path(src)
    names = local_files(src_path)
    if not is_gcs(uri):
        _copy_files(src_path, names, local_path(uri))
        return
    for name in names:
        target_uri = join(uri, name)
        with faults(target_uri, writing=True):
            _blob(target_uri).upload_from_filename(str(src_path / name), **_call())


@contextlib.contextmanager
def local_dir(uri: str) -> Iterator[Path]:
    """A local directory holding the files of `uri`: the path itself when local, a temporary download otherwise."""
    if not (is_gcs(uri) or is_hf(uri)):
        path = local_path(uri)
        if not path.is_dir():
            raise UserError(f"{path} is not a directory: check the path")
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="lora-dl-") as tmp:
        yield download_dir(uri, tmp)


#: Written last into a published gs:// directory; readers that need completeness check for it.
COMPLETE_MARKER = "_COMPLETE"


def check_output_location(uri: str, field: str) -> None:
    """Fail fast, before any work, when the output location (config field `field`) cannot hold a run.

    Locally the directory is created; on gs:// the bucket must exist (a listing, which needs only
    the object rights the run needs anyway, not bucket metadata rights).
    """
    if is_gcs(uri):
        from google.api_core import exceptions as gexc

        bucket, name = split_gcs(uri)
        with faults(uri):
            try:
                next(iter(_client().list_blobs(bucket, prefix=f"{name}/" if name else "", max_results=1, **_call())), None)
            except gexc.NotFound as e:
                raise UserError(
                    f"{field} {uri}: bucket {bucket!r} does not exist: create it (gcloud storage buckets create "
                    f"gs://{bucket}) or point {field} at an existing bucket"
                ) from e
        return
    path = absolute_local_path(uri)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{field} {uri}: cannot create the directory {path} ({e.strerror}); point {field} at a writable directory") from e


def check_replaceable(uri: str, names: set[str]) -> None:
    """Refuse to replace `uri` unless it is absent or holds only top-level entries named in `names`.

    An output is replaced whole, so an earlier output of the same kind (even a partial upload)
    may go, but nothing else may: an `--out` pointed at a run's own directory would otherwise
    delete its checkpoints.
    """
    if is_gcs(uri):
        found = {rel.split("/", 1)[0] for rel, _ in _walk_gcs(uri)}
    else:
        path = local_path(uri)
        if path.exists() and not path.is_dir():
            raise UserError(f"{path} is a file, not an output directory; nothing was written: choose another path")
        found = {p.name for p in path.iterdir()} if path.exists() else set()
    foreign = sorted(found - names - {COMPLETE_MARKER})
    if foreign:
        listed = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise UserError(
            f"{uri} already holds {listed}, which this output does not write, so it was left as it is and nothing "
            "was written: write to a new or empty directory, or remove those files first"
        )


@contextlib.contextmanager
def staged_output_dir(uri: str) -> Iterator[Path]:
    """Yield a local staging directory; publish it to `uri` only if the block succeeds.

    Locally the staging directory is a hidden sibling that is renamed into place, so the
    output appears whole or not at all (an earlier output of the same files is replaced; a
    directory holding anything else is refused, see `check_replaceable`). On gs:// the files
    are uploaded after success and a `_COMPLETE` marker object is written last; on failure
    nothing is uploaded. Either way a failed export leaves no directory that looks valid.
    """
    if is_gcs(uri):
        with tempfile.TemporaryDirectory(prefix="lora-stage-") as tmp:
            yield Path(tmp)
            check_replaceable(uri, {p.name for p in Path(tmp).iterdir()})
            if exists(uri):
                delete_tree(uri)
            upload_dir(tmp, uri)
            write_text(join(uri, COMPLETE_MARKER), "")
        return
    dest = absolute_local_path(uri)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{dest}: cannot create its parent directory ({e.strerror}); choose a writable location") from e
    stage = Path(tempfile.mkdtemp(prefix=f".{dest.name}.staging-", dir=dest.parent))
    # mkdtemp makes the directory 0700; the published output gets the usual umask-derived mode.
    umask = os.umask(0)
    os.umask(umask)
    stage.chmod(0o777 & ~umask)
    try:
        yield stage
        check_replaceable(str(dest), {p.name for p in stage.iterdir()})
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex}")
            os.replace(dest, old)
            try:
                os.replace(stage, dest)
            except BaseException:
                os.replace(old, dest)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(stage, dest)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def delete_tree(uri: str) -> None:
    """Remove a directory (every object under a gs:// prefix)."""
    if not is_gcs(uri):
        shutil.rmtree(local_path(uri), ignore_errors=True)
        return
    from google.api_core import exceptions as gexc

    for _rel, blob in list(_walk_gcs(uri)):
        with faults(uri, writing=True), contextlib.suppress(gexc.NotFound):  # a retried delete whose first attempt did it
            blob.delete(**_call())
