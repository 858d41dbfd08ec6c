"""The compiled train step kept beside a fingerprint of everything it was traced from, so that a
restart of the run calls it without tracing or lowering the step again.

Why: JAX's persistent cache is keyed by a hash of the lowered program, so even a restart that
finds its step there traces and lowers it first, only to compute that key. On a v5e host that was
the warm restart's critical path: 6.5 s of tracing and 1.6 s of lowering the 1B step, while the
compiled program itself had long been loaded (`step_preload`) and the base read (docs/benchmarks.md,
"A restart that compiles before it reads the base"). MaxText skips them the same way, by loading a
serialized train step (`compiled_trainstep_file`), but leaves it to the user to know that the
file still fits; here the fingerprint does.

The fingerprint stands in for the lowered program. It covers the trainer's own source, the version
of every installed distribution, Python's version, the backend (platform and its version, device
kinds and count, processes), XLA's flag variables, JAX's trace-time configuration, the run's
configuration less where its inputs and outputs lie, the base model's `config.json`, and every
argument's shape, dtype and sharding (devices included). A change to any of them gives another
fingerprint and the step is traced as before: a miss costs the trace, never a wrong program.

Like JAX's cache, a record is trusted code (it is a pickle): records are kept only in the run's own
cache, which only the run writes (`compile_cache`). A cache holds one record: a restart needs the
newest, so writing one removes the others.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import pickle
import re
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import jax
from etils import epath
from jax._src import config as jax_config  # trace_context: the configuration a trace depends on
from jax.experimental import serialize_executable

from lora_trainer import step_preload, storage
from lora_trainer.background import in_background
from lora_trainer.config import TrainConfig

log = logging.getLogger(__name__)

RECORDS = "train-step-*.jaxstep"
_PREFIX, _SUFFIX = "train-step-", ".jaxstep"
#: The record's layout, first in the pickle: a record of another layout is not read.
FORMAT = 1
#: Variables that change XLA's compilation (not the pod's identity: TPU_WORKER_* differ between restarts).
FLAG_VARIABLES = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")

_lock = threading.Lock()
#: Records being or already read ahead, by file name (`preload`); taken by `take`, the rest dropped there.
_ahead: dict[str, Future[jax.stages.Compiled]] = {}


@dataclasses.dataclass(frozen=True)
class Records:
    """Where a run keeps its train step's record, what the step is traced from besides its
    arguments (`run_description`), and whether this process writes the record (one process does)."""

    cache: str
    traced_from: Mapping[str, Any]
    write: bool


def run_description(cfg: TrainConfig, hf_config: Mapping[str, Any], kernel: str) -> dict[str, Any]:
    """The run as far as it shapes the train step: its configuration less where its inputs and
    outputs lie (a project moved keeps its record), the base model's configuration, and the
    attention kernel chosen. Pure."""
    wire = cfg.to_wire()
    wire.pop("output", None)
    wire["model"].pop("source", None)
    wire["dataset"].pop("train", None)
    wire["dataset"]["eval"] = "eval" in wire["dataset"]
    wire["lora"]["restoreFrom"] = "restoreFrom" in wire["lora"]  # its values are loaded into the step's arguments
    wire["training"].pop("compilationCache", None)
    return {"config": wire, "model": {k: v for k, v in hf_config.items() if k != "_name_or_path"}, "kernel": kernel}


def fingerprint(arguments: Any, traced_from: Mapping[str, Any]) -> str:
    """A hash of what a step's program follows from: its arguments (their tree, shapes, dtypes and
    shardings) and `traced_from` (`environment()` and the run's configuration). Pure."""
    text = json.dumps({
        "traced_from": traced_from,
        "structure": str(jax.tree.structure(arguments)),
        "arguments": [_describe(leaf) for leaf in jax.tree.leaves(arguments)],
    }, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _describe(leaf: Any) -> Any:
    if not hasattr(leaf, "shape"):
        return _ADDRESS.sub("", repr(leaf))
    sharding = getattr(leaf, "sharding", None)
    devices = None if sharding is None else [d.id for d in sharding._device_assignment]
    return [list(leaf.shape), str(leaf.dtype), bool(getattr(leaf, "weak_type", False)), repr(sharding), devices]


def environment() -> dict[str, Any]:
    """What a trace depends on outside the run's configuration and the step's arguments. Call it
    where the step is traced: JAX's trace-time configuration includes the thread's mesh context."""
    devices = jax.devices()
    client = devices[0].client
    return {
        "trainer": _trainer_source(),
        "distributions": _distributions(),
        "python": sys.version,
        "backend": [client.platform, client.platform_version, sorted({d.device_kind for d in devices}),
                    len(devices), jax.process_count()],
        "flags": {name: os.environ.get(name) for name in FLAG_VARIABLES},
        # Object addresses (JAX's axis environment) differ between processes, never the program.
        "jax": _ADDRESS.sub("", repr(jax_config.trace_context())),
    }


@functools.cache
def _trainer_source() -> str:
    """A hash of the lora_trainer package's Python files (their paths and bytes)."""
    root = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.cache
def _distributions() -> list[str]:
    """Every installed distribution, as its metadata folder is named (`name-version.dist-info`): the
    folders are listed, not their METADATA files parsed (`importlib.metadata`). On a v5e host
    `environment()` took 3.1 s of a restart's compile thread while it parsed them, beside the
    start-up's other threads; on the CPU host 175 distributions take 0.4 ms listed, 74 ms parsed."""
    found: set[str] = set()
    for entry in sys.path:
        try:
            with os.scandir(entry or ".") as listing:
                found.update(e.name for e in listing if e.name.endswith((".dist-info", ".egg-info")))
        except OSError:  # a zip or a missing directory on the path holds no folders
            continue
    return sorted(found)


def record_name(key: str) -> str:
    return f"{_PREFIX}{key}{_SUFFIX}"


def save(cache: str, key: str, compiled: jax.stages.Compiled) -> None:
    """Keep `compiled` as the record of fingerprint `key` in `cache` (written whole or not at all),
    then remove the cache's other records."""
    began = time.perf_counter()
    payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    name = record_name(key)
    storage.write_bytes(storage.join(cache, name), pickle.dumps((FORMAT, payload, in_tree, out_tree)))
    for other in epath.Path(cache).glob(RECORDS):
        if other.name != name:
            other.unlink(missing_ok=True)
    log.info("kept the compiled train step (%.0f MiB) as %s in %.1fs: a restart calls it without tracing the step",
             len(payload) / 2**20, name, time.perf_counter() - began)


def load(uri: str) -> jax.stages.Compiled:
    """The record at `uri`, loaded on this process's devices."""
    began = time.perf_counter()
    layout, payload, in_tree, out_tree = pickle.loads(storage.read_bytes(uri))
    if layout != FORMAT:
        raise ValueError(f"record layout {layout}, this trainer reads {FORMAT}")
    compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
    log.info("loaded the compiled train step %s (%.0f MiB) in %.1fs", uri.rsplit("/", 1)[-1], len(payload) / 2**20,
             time.perf_counter() - began)
    return compiled


def preload(cache: str) -> bool:
    """Begin loading `cache`'s newest record on a thread (for `take`); False when there is none.
    Its load is slow native work (seconds for a 1B step on a v5e chip) that overlaps the start.
    A cache that cannot be listed is logged and left: the step is then traced as usual."""
    try:
        record = step_preload.newest(cache, RECORDS)
    except Exception as e:  # noqa: BLE001  (a head start only)
        log.info("did not look for a compiled train step in %s (%s: %s)", cache, type(e).__name__, e)
        return False
    if record is None:
        return False

    def environment_then_load() -> jax.stages.Compiled:
        _trainer_source(), _distributions()  # `environment`'s file reads, cached for the compile thread
        return load(str(record))

    with _lock:
        _ahead[record.name] = in_background(environment_then_load, "step-record-preload")
    return True


def take(cache: str, key: str, arguments: Any, layouts: Any = None) -> jax.stages.Compiled | None:
    """The compiled step of fingerprint `key` for `arguments` (see `mismatch`): loaded ahead, else read
    now. None (the step is traced) when there is none, or it cannot be read or does not take
    `arguments` (logged). Whatever else was loaded ahead is dropped."""
    name = record_name(key)
    with _lock:
        pending = _ahead.pop(name, None)
        _ahead.clear()
    uri = storage.join(cache, name)
    try:
        if pending is None and not storage.exists(uri):
            return None
        compiled = pending.result() if pending is not None else load(uri)
        if (problem := mismatch(compiled, arguments, layouts)) is not None:
            raise ValueError(problem)
    except Exception as e:  # noqa: BLE001  (the step is traced instead)
        log.warning("did not use the compiled train step %s (%s: %s); the step is traced and compiled as usual", name,
                    type(e).__name__, e)
        return None
    log.info("the train step is the one compiled earlier (%s): not traced again", name)
    return compiled


def keep(cache: str, key: str, compiled: jax.stages.Compiled) -> None:
    """`save` on a daemon thread, errors logged: the run goes on without a record (its next start
    traces the step). A process that ends mid-write leaves no record (`storage.write_bytes`)."""

    def guarded() -> None:
        try:
            save(cache, key, compiled)
        except Exception as e:  # noqa: BLE001  (a head start for a restart, not the run's work)
            log.warning("did not keep the compiled train step in %s (%s: %s); a restart traces the step", cache,
                        type(e).__name__, e)

    in_background(guarded, "step-record-save", finish_first=True)


def mismatch(compiled: jax.stages.Compiled, arguments: Any, layouts: Any = None) -> str | None:
    """How `compiled` does not take `arguments` (abstract or real arrays), or None when it does: their
    tree, shapes, dtypes, shardings, and the layouts of real arrays (or `layouts`, one per abstract
    array), as JAX's call checks them: a jitted function passes what a compiled program refuses (on
    CPU, QLoRA's 4-bit weights lie unpacked, while the program's own layout packs them). The
    fingerprint covers all but the layouts; this makes sure a record never meets arguments it was
    not built for."""
    if jax.tree.structure(compiled.args_info) != jax.tree.structure((tuple(arguments), {})):
        return "its arguments are of another tree than the step's"
    # An argument the program does not use has no format (None), which `leaves` would drop.
    formats = jax.tree.leaves(compiled.input_formats[0], is_leaf=lambda x: x is None)
    leaves = jax.tree.leaves(arguments)
    layouts = [getattr(getattr(x, "format", None), "layout", None) for x in leaves] if layouts is None else layouts
    for i, (info, fmt, arg, layout) in enumerate(zip(jax.tree.leaves(compiled.args_info), formats, leaves, layouts, strict=True)):
        aval = info._aval
        if (aval.shape, aval.dtype) != (arg.shape, arg.dtype):
            return f"argument {i} is {arg.dtype}{list(arg.shape)}, the record's {aval.str_short()}"
        if fmt is None:
            continue
        if not fmt.sharding.is_equivalent_to(arg.sharding, len(arg.shape)):
            return f"argument {i} {aval.str_short()} is on {arg.sharding}, the record's on {fmt.sharding}"
        if layout is not None and fmt.layout is not None and layout != fmt.layout:
            return f"argument {i} {aval.str_short()} has the layout {layout}, the program's {fmt.layout}"
    return None
