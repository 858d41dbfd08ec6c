"""Orbax checkpoints of a LoRA run, local or on gs://, that become visible only when complete.

Layout (docs/dev/contracts.md): `<output>/checkpoints/<step>/` written by an Orbax
`CheckpointManager` with the items
  - `lora`: `{module_path: {"<weight>_lora_a": array, "<weight>_lora_b": array}}`,
  - `optimizer`: the optax state of the LoRA parameters (training checkpoints only),
  - `data`: the data iterator's position (JSON; training checkpoints only),
  - `metadata`: what the adapter is (family, base model, rank, alpha, target regex, ...),
so that export, conversion and resume need no repeated flags. An adapter-only checkpoint
(`write_lora`, e.g. made by `convert hf-peft -> orbax`) has just `lora` and `metadata`, and
stores its `lora` item layer-stacked (see `_stack_layers`); `read_lora` undoes that, so every
caller sees the same per-path tree whichever layout a checkpoint has.

Why only Orbax's own completion check decides what exists: locally Orbax writes into a
temporary directory and renames it; on gs:// it writes in place and adds
`commit_success.txt` last, so a listed step directory there proves nothing. Every reader
(resume, export, the operator's progress) goes through `committed_steps`.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import flags
from etils import epath
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

from lora_trainer import storage
from lora_trainer.checkpoint_metadata import LAYOUT, METADATA_KEYS, check_item_keys, check_layout, check_required, valid_metadata
from lora_trainer.errors import UserError, one_line

LORA = "lora"
OPTIMIZER = "optimizer"
DATA = "data"
METADATA = "metadata"

#: What stands for the layer index in the key of a layer-stacked group (as in the families' templates).
LAYER = "{i}"

LoraTree = dict[str, dict[str, Any]]


def checkpoint_root(output_uri: str) -> str:
    """`<output>/checkpoints`: where a run's steps live."""
    return storage.join(output_uri, "checkpoints")


def _path(uri: str) -> epath.Path:
    """An etils path for Orbax: gs:// stays a URI (gcsfs/TensorStore), `file://` becomes a plain path."""
    # Absolute: TensorStore refuses a relative path with `..` in it ("Invalid file path").
    return epath.Path(uri if storage.is_gcs(uri) else storage.absolute_local_path(uri))


def _bound_tensorstore_retries() -> None:
    """Give every TensorStore context Orbax builds from now on the storage retry deadline.

    Orbax 0.12 builds its TensorStore contexts itself, each a copy of the two module-level
    dicts set here, and has no parameter for them; see `storage.tensorstore_gcs_retries`.
    Set again on every Orbax call because the deadline is read from the environment per call.
    """
    retries = storage.tensorstore_gcs_retries(storage.retry_deadline())
    for context in (ts_utils._BASE_TS_CONTEXT, ts_utils._DEFAULT_OCDBT_TS_CONTEXT):
        context["gcs_request_retries"] = retries


@contextlib.contextmanager
def _storage_faults(uri: str, *, writing: bool = False) -> Iterator[None]:
    """Map storage faults under Orbax (gcsfs, TensorStore) onto the exit-code table (`storage.faults`),
    after bounding how long TensorStore retries one (`_bound_tensorstore_retries`). `writing` marks
    saves and deletions, where an object gone under a retried request is transient."""
    _bound_tensorstore_retries()
    with storage.faults(uri, subject=f"checkpoints at {uri}", writing=writing):
        yield


def committed_steps(root: str) -> list[int]:
    """Steps under `root` that Orbax has committed (ascending); half-written ones are ignored.

    On gs:// gcsfs's listing cache is dropped first: another process (a previous attempt of
    this run, or the exporter) may have written or deleted steps since this one last looked.
    """
    path = _path(root)
    with _storage_faults(root):
        if storage.is_gcs(root):
            epath.backend.fsspec_backend.fs(root).invalidate_cache()
        return sorted(ocp.path.step.checkpoint_steps(path))


def latest_committed_step(root: str) -> int | None:
    """The newest committed step under `root`, or None when there is none."""
    steps = committed_steps(root)
    return steps[-1] if steps else None


def _handlers(*items: str) -> dict[str, ocp.CheckpointHandler]:
    """Orbax handlers per item. Arrays are written one zarr array each, without OCDBT or zstd.

    Why not OCDBT (Orbax's default): all arrays of an item then share one `manifest.ocdbt`
    updated with conditional writes, and against gcp-storage-emulator (the only GCS the
    tests can reach) saving a few dozen arrays fails with "Malformed StorageGeneration".
    LoRA checkpoints hold hundreds, not millions, of small arrays, so plain zarr costs
    little, and tests and production then share one code path. Why no zstd: trained float
    weights barely compress (random fp32: 155 of 168 MB) and compressing costs more time
    than the bytes it saves. Readers detect the format (zarr records each array's
    compressor), so OCDBT or compressed checkpoints written by other tools or earlier
    versions still load.
    """
    table: dict[str, ocp.CheckpointHandler] = {
        LORA: _array_handler(),
        OPTIMIZER: _array_handler(),
        DATA: ocp.JsonCheckpointHandler(),
        METADATA: ocp.JsonCheckpointHandler(),
    }
    return {k: table[k] for k in items}


def _write_lora_handler() -> ocp.PyTreeCheckpointHandler:
    """`write_lora`'s `lora` handler: `_handlers`' format, without Orbax's defensive copy.

    Orbax deep-copies every numpy array before writing, so that the caller of an async save
    may change it meanwhile. `write_lora` saves synchronously from numpy arrays nobody
    changes, so that copy would only add a pass over every byte (a third of `convert`'s time).
    """
    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False))
    )
    return _array_handler(type_handler_registry=registry)


def _array_handler(**options: Any) -> ocp.PyTreeCheckpointHandler:
    """The one array format of every item (see `_handlers`): plain zarr, no OCDBT, no zstd."""
    return ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_compression=False, **options)


#: Orbax warnings (through absl) about what this module does on purpose: OCDBT off (`_handlers`; one
#: per item of every save), `write_lora`'s numpy-only handler registry (`_write_lora_handler`),
#: read-only managers for readers (three per read), and the items an adapter-only read skips (two
#: per read: "Item "optimizer" was found ... but could not be restored", which reads like a
#: failure on an export that succeeded).
_EXPECTED_ORBAX_WARNINGS = (
    "Skipping merge of OCDBT checkpoints",
    "No jax.Array in TypeHandlerRegistry",
    "CheckpointManagerOptions.read_only=True",
    "Given directory is read only",
    "was found in the checkpoint, but could not be restored",
)


class _ExpectedOrbaxWarnings(logging.Filter):
    """Drops `_EXPECTED_ORBAX_WARNINGS`: noise, not faults; every other Orbax warning passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in _EXPECTED_ORBAX_WARNINGS)


def _prepare_orbax() -> None:
    """What every checkpoint manager here needs first: the expected warnings dropped, and Orbax's
    barriers between processes kept off the devices.

    Orbax finishes an async save on its own thread, at a barrier. By default that barrier is a
    device collective, and it ran beside the step loop's collectives (the stop check's allgather,
    a multi-host step) in an order that differed between hosts: two CPU processes died at their first
    save mid-run with gloo's "collective mismatch" (`test_multihost`), where a TPU slice may hang
    instead. The JAX distributed client's barriers are keyed, so any thread may wait at one (what
    Orbax's `experimental_orbax_use_distributed_barrier` selects; one process has none either way).
    """
    absl = logging.getLogger("absl")
    if not any(isinstance(f, _ExpectedOrbaxWarnings) for f in absl.filters):
        absl.addFilter(_ExpectedOrbaxWarnings())
    barrier = flags.FLAGS["experimental_orbax_use_distributed_barrier"]
    if not barrier.present:  # as if given on the command line, which Orbax's reads of it require
        barrier.parse("true")


def _split_step_dir(root: str, step: int | None) -> tuple[str, int | None]:
    """Accept a step directory (`.../checkpoints/120`) wherever a root is expected."""
    path = _path(root)
    # An adapter-only root may be named with digits too (`adapters/777`); a step holds the items.
    if step is None and path.name.isdigit() and ocp.path.step.is_path_finalized(path) and (path / METADATA).exists():
        parent = root.rstrip("/").rsplit("/", 1)[0] if storage.is_gcs(root) else str(path.parent)
        return parent, int(path.name)
    return root, step


#: How TensorStore's errors start when the bytes it read are missing or malformed (absl status codes).
_DAMAGE = ("NOT_FOUND", "FAILED_PRECONDITION", "INVALID_ARGUMENT", "DATA_LOSS", "OUT_OF_RANGE")


@contextlib.contextmanager
def _unreadable_step(root: str, step: int) -> Iterator[None]:
    """A committed step with an item missing or damaged (deleted or edited by hand): a UserError naming it."""
    try:
        yield
    except (KeyError, json.JSONDecodeError, UnicodeDecodeError, RecursionError, FileNotFoundError, ValueError) as e:
        # TensorStore's ValueError: only the absl codes of a damaged file, not the transient ones (`storage.faults`).
        if isinstance(e, ValueError) and not isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)) and not str(e).startswith(_DAMAGE):
            raise
        raise UserError(
            f"checkpoint {step_uri(root, step)} is committed but incomplete or damaged ({one_line(e)}); delete that step "
            "directory so that the run resumes from the step before it, or read another step (export --step)"
        ) from e


#: Orbax's record of a PyTree item's structure, inside the item's directory.
_TREE_RECORD = "_METADATA"


def _check_stored_names(step_dir: str) -> None:
    """The names under a step's `lora` item, from its tree record, before Orbax opens any array by them
    (`check_item_keys`). Checkpoints without the record (older Orbax) have nothing to check here."""
    record = storage.join(step_dir, LORA, _TREE_RECORD)
    if storage.exists(record):
        check_item_keys(json.loads(storage.read_text(record)), step_dir)


def _resolve_step(root: str, step: int | None) -> int:
    """The step to read: the one asked for if committed, else the latest; UserError if none."""
    steps = committed_steps(root)
    if not steps:
        raise UserError(
            f"no committed checkpoint under {root}: point at a run's `<output>/checkpoints` directory "
            "(or one step inside it) that a finished or checkpointed training wrote"
        )
    if step is None:
        return steps[-1]
    if step not in steps:
        raise UserError(f"step {step} is not a committed checkpoint under {root}; committed steps: {steps}")
    return step


def _numpy_restore_args(item_metadata: Any) -> Any:
    """Restore every array of a saved tree as a host numpy array (no devices or shardings needed)."""
    return jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item_metadata.tree)


def read_metadata(root: str, step: int | None = None) -> dict[str, Any]:
    """The `metadata` item of a committed step (latest by default), its keys checked (`valid_metadata`)."""
    root, step = _split_step_dir(root, step)
    step = _resolve_step(root, step)
    with _storage_faults(root), _unreadable_step(root, step), _reader(root, METADATA) as mgr:
        raw = mgr.restore(step, args=ocp.args.Composite(metadata=ocp.args.JsonRestore()))[METADATA]
    return valid_metadata(raw, step_uri(root, step))


def read_lora(root: str, step: int | None = None) -> tuple[LoraTree, dict[str, Any]]:
    """LoRA params (numpy) and metadata of a committed step (latest by default).

    `root` is a checkpoint root (`<output>/checkpoints`, or an adapter-only checkpoint made
    by `write_lora`) or one committed step directory inside it. The tree is per module path
    whatever the stored layout; layer-stacked groups come back as views of their stacked
    arrays (no copies), and the returned metadata lacks the layout record. Metadata and layout that
    are not what the format promises (`checkpoint_metadata`) are a UserError naming the item and key,
    and the `lora` item's names are checked before any array is read. Whether the tree is the
    adapter its metadata describes is for readers that need an adapter (`check_lora_tree`).
    """
    root, step = _split_step_dir(root, step)
    step = _resolve_step(root, step)
    where = step_uri(root, step)
    with _storage_faults(root), _unreadable_step(root, step), _reader(root, LORA, METADATA) as mgr:
        _check_stored_names(where)
        meta = mgr.item_metadata(step)[LORA]
        restored = mgr.restore(
            step,
            args=ocp.args.Composite(
                lora=ocp.args.PyTreeRestore(restore_args=_numpy_restore_args(meta)),
                metadata=ocp.args.JsonRestore(),
            ),
        )
    metadata = valid_metadata(restored[METADATA], where)
    stacked, axes = check_layout(metadata.pop(LAYOUT, None) or {}, restored[LORA], where)
    return _unstack_layers(restored[LORA], stacked, axes), metadata


def write_lora(root: str, step: int, tree: Mapping[str, Mapping[str, Any]], metadata: Mapping[str, Any]) -> None:
    """Write an adapter-only checkpoint (items `lora` + `metadata`) and wait until it is committed.

    The `lora` item is stored layer-stacked (`_stack_layers`) and `metadata[LAYOUT]` records
    which groups were stacked, and in which axis order; `read_lora` restores the per-path tree.
    """
    check_required(metadata, root)
    stored, stacked, axes = _stack_layers(_as_dict_tree(tree))
    _prepare_orbax()
    with _storage_faults(root, writing=True):
        mgr = ocp.CheckpointManager(
            _path(root),
            options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True),
            item_handlers={**_handlers(METADATA), LORA: _write_lora_handler()},
        )
        try:
            mgr.save(
                step,
                args=ocp.args.Composite(
                    lora=ocp.args.PyTreeSave(stored),
                    metadata=ocp.args.JsonSave({**metadata, "step": step, LAYOUT: {"stacked": stacked, "axes": axes}}),
                ),
                force=True,
            )
            mgr.wait_until_finished()
        finally:
            mgr.close()


def _as_dict_tree(tree: Mapping[str, Mapping[str, Any]]) -> LoraTree:
    """Plain nested dicts of numpy arrays, so the saved structure never depends on the caller's
    mapping or array types (jax arrays are fetched to the host once, here)."""
    return {str(k): {str(n): np.asarray(v) for n, v in sub.items()} for k, sub in tree.items()}


def _layer_of(path: str) -> tuple[str, int] | None:
    """`layers/3/attn/q_proj` -> (`layers/{i}/attn/q_proj`, 3): the first all-digit component is the layer.

    None when the path has no such component, when it is not written the way `str(int)`
    writes it back (`03`), or when the path already holds `{i}`, so that `_unstack_layers`
    always restores the exact path.
    """
    if LAYER in path:
        return None
    parts = path.split("/")
    for k, part in enumerate(parts):
        if part.isascii() and part.isdigit():
            if str(int(part)) != part:
                return None
            return "/".join([*parts[:k], LAYER, *parts[k + 1 :]]), int(part)
    return None


def _stackable(members: list[dict[str, np.ndarray]]) -> bool:
    """True when every member has the same parameter names, each with one shape and dtype."""
    first = members[0]
    return all(
        m.keys() == first.keys() and all(m[n].shape == first[n].shape and m[n].dtype == first[n].dtype for n in first)
        for m in members[1:]
    )


def _stack(arrays: list[np.ndarray]) -> np.ndarray:
    """One array with a new leading axis, filled in place: one copy of each member, no temporaries."""
    out = np.empty((len(arrays), *arrays[0].shape), dtype=arrays[0].dtype)
    for k, a in enumerate(arrays):
        out[k] = a
    return out


def _memory_order(a: np.ndarray) -> list[int]:
    """The axis order in which `a`'s elements lie contiguously in memory (identity if none does).

    An imported PEFT adapter arrives as views of its file: Qwix's `[in, r]` A is PEFT's
    contiguous `[r, in]` transposed, and a `[r, heads, head_dim]` B is PEFT's `[out, r]`
    transposed and split. Storing each in the order its bytes already have makes stacking a
    plain copy instead of a transposing one, and `export` gets PEFT's layout back as views.
    """
    if a.flags.c_contiguous or a.ndim < 2:
        return list(range(a.ndim))
    order = sorted(range(a.ndim), key=lambda i: -a.strides[i])
    return order if np.transpose(a, order).flags.c_contiguous else list(range(a.ndim))


def _stack_layers(tree: LoraTree) -> tuple[LoraTree, dict[str, list[int]], dict[str, dict[str, list[int]]]]:
    """Group module paths that differ only by their layer index into one array per parameter.

    Why: Orbax and TensorStore spend a fixed cost per array, which dominates for LoRA's many
    small arrays (an 8B Llama adapter: 448 arrays, ~7x slower to write and ~8x slower to
    read than the same bytes as 14 stacked arrays, both uncompressed). A group `layers/{i}/attn/q_proj` holds
    `{name: array[n_layers, ...]}` with the layers in ascending order; the returned
    `{template: [layer, ...]}` is the layout record. Each parameter is stacked in its members'
    memory order (`_memory_order`): `{template: {name: axes}}` records every order that is not
    the identity, the stored array being `stack([transpose(member, axes), ...])`. Groups of one
    path, of unequal names, shapes or dtypes, or whose template is itself a path, stay per path.
    """
    groups: dict[str, dict[int, str]] = {}
    for path in tree:
        found = _layer_of(path)
        if found is not None:
            groups.setdefault(found[0], {})[found[1]] = path
    stored: LoraTree = {}
    stacked: dict[str, list[int]] = {}
    axes: dict[str, dict[str, list[int]]] = {}
    for template, members in sorted(groups.items()):
        layers = sorted(members)
        params = [tree[members[i]] for i in layers]
        if len(layers) < 2 or template in tree or not _stackable(params):
            continue
        stored[template] = {}
        for name in params[0]:
            order = _memory_order(params[0][name])
            if any(_memory_order(p[name]) != order for p in params[1:]):
                order = list(range(params[0][name].ndim))
            if order != sorted(order):
                axes.setdefault(template, {})[name] = order
            stored[template][name] = _stack([np.transpose(p[name], order) for p in params])
        stacked[template] = layers
    grouped = {members[i] for t, members in groups.items() if t in stacked for i in members}
    stored.update({p: v for p, v in tree.items() if p not in grouped})
    return stored, stacked, axes


def _unstack_layers(tree: LoraTree, stacked: Mapping[str, list[int]], axes: Mapping[str, Mapping[str, list[int]]]) -> LoraTree:
    """The per-path tree of a stored `lora` item; each stacked group becomes views of its arrays."""
    out: LoraTree = {p: v for p, v in tree.items() if p not in stacked}
    for template, layers in stacked.items():
        params = tree[template]
        inverse = {n: np.argsort(order).tolist() for n, order in axes.get(template, {}).items()}
        for k, layer in enumerate(layers):
            out[template.replace(LAYER, str(layer), 1)] = {
                n: (np.transpose(a[k], inverse[n]) if n in inverse else a[k]) for n, a in params.items()
            }
    return dict(sorted(out.items()))


@contextlib.contextmanager
def _reader(root: str, *items: str) -> Iterator[ocp.CheckpointManager]:
    _prepare_orbax()
    mgr = ocp.CheckpointManager(
        _path(root), options=ocp.CheckpointManagerOptions(read_only=True), item_handlers=_handlers(*items)
    )
    try:
        yield mgr
    finally:
        mgr.close()


class TrainingCheckpoints:
    """The training run's side of the format: periodic async saves, keep-N, full restore.

    Every process of a multi-host run constructs one and calls `save`/`read` together
    (Orbax coordinates the hosts); only committed steps are ever read.
    """

    def __init__(self, root: str, *, keep: int) -> None:
        self.root = root
        _prepare_orbax()
        with _storage_faults(root, writing=True):
            self._mgr = ocp.CheckpointManager(
                _path(root),
                # cleanup_tmp_directories: a step a killed process left half-written (a `*.orbax-checkpoint-tmp`
                # directory, or on gs:// a step without commit_success.txt) is removed, not kept forever.
                options=ocp.CheckpointManagerOptions(
                    max_to_keep=keep, create=True, enable_async_checkpointing=True, cleanup_tmp_directories=True
                ),
                item_handlers=_handlers(LORA, OPTIMIZER, DATA, METADATA),
            )

    def latest_step(self) -> int | None:
        """Newest committed step (re-listed from storage, so another writer's steps count too)."""
        return latest_committed_step(self.root)

    def save(
        self,
        step: int,
        *,
        lora: Any,
        optimizer: Any,
        data: Mapping[str, Any],
        metadata: Mapping[str, Any],
    ) -> None:
        """Start saving `step` in the background (arrays are copied off the devices first)."""
        check_required(metadata, self.root)
        with _storage_faults(self.root, writing=True):
            self._mgr.save(
                step,
                args=ocp.args.Composite(
                    lora=ocp.args.PyTreeSave(lora),
                    optimizer=ocp.args.PyTreeSave(optimizer),
                    data=ocp.args.JsonSave(dict(data)),
                    metadata=ocp.args.JsonSave({**metadata, "step": step}),
                ),
                force=True,
            )

    def saving(self) -> bool:
        """Whether a started save has yet to commit (this process's part of it)."""
        return bool(self._mgr.is_saving_in_progress())

    def wait(self) -> None:
        """Block until every started save has committed; raises a save's error."""
        with _storage_faults(self.root, writing=True):
            self._mgr.wait_until_finished()

    def read(self, step: int) -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
        """(lora, optimizer, data position, metadata) of a committed step, its arrays on the host.

        Why on the host: the read then needs nothing from the trainer, so a resume starts it before
        the step's compile, not after the optimizer is placed and its arrays found, and places them
        at the end (`placed_like`, 0.12 s for a 1B adapter on a v5e). That took 0.4-0.5 s off a 1B
        restart on the chip; the read (3.1-3.2 s, 675 arrays) still ends last. Every host reads
        every array whole: the adapter and its optimizer state (about 0.5 GB at 8B, rank 16), never
        the base.
        """
        with _storage_faults(self.root), _unreadable_step(self.root, step):
            stored = self._mgr.item_metadata(step)
            r = self._mgr.restore(
                step,
                args=ocp.args.Composite(
                    lora=ocp.args.PyTreeRestore(restore_args=_numpy_restore_args(stored[LORA])),
                    optimizer=ocp.args.PyTreeRestore(restore_args=_numpy_restore_args(stored[OPTIMIZER])),
                    data=ocp.args.JsonRestore(),
                    metadata=ocp.args.JsonRestore(),
                ),
            )
        return r[LORA], r[OPTIMIZER], dict(r[DATA]), dict(r[METADATA])

    def close(self) -> None:
        """Wait for pending saves, then release Orbax's threads."""
        with _storage_faults(self.root, writing=True):
            self._mgr.wait_until_finished()
            self._mgr.close()


def step_uri(root: str, step: int) -> str:
    """The URI of one step directory (what progress.json reports as lastCheckpoint)."""
    return storage.join(root, str(step))


def placed_like(host: Any, like: Any, where: str) -> Any:
    """`host`'s arrays (a `read` item) as arrays shaped, typed and sharded like `like`'s, the trainer's own.

    A compiled step refuses arguments placed otherwise than it was compiled for, so every array takes
    its counterpart's sharding (`placed`). A tree that is not the trainer's is a UserError naming
    the step `where`.
    """
    stored, wanted = _key_paths(host), _key_paths(like)
    if stored != wanted:
        raise UserError(
            f"checkpoint {where} does not hold this run's arrays (missing {sorted(wanted - stored)[:4]}, not this "
            f"run's {sorted(stored - wanted)[:4]}); resume with the settings that wrote it, or use a new output.uri"
        )

    def place(a: np.ndarray, target: Any) -> jax.Array:
        if tuple(a.shape) != tuple(target.shape):
            raise UserError(
                f"checkpoint {where} holds an array of shape {list(a.shape)} where this run has {list(target.shape)}; "
                "resume with the settings that wrote it, or use a new output.uri"
            )
        return placed(a, target)

    return jax.tree.map(place, host, like)


def placed(value: Any, like: jax.Array) -> jax.Array:
    """One host array (or a fetchable one) typed and sharded like `like`, each process giving only
    its own devices' parts: `device_put` of a host array onto devices of several processes first
    compares it across them, one collective per array."""
    a = np.asarray(value, dtype=like.dtype)
    return jax.make_array_from_callback(a.shape, like.sharding, lambda index: a[index])


def _key_paths(tree: Any) -> set[str]:
    return {jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}


__all__ = [
    "LAYER",
    "LAYOUT",
    "METADATA_KEYS",
    "TrainingCheckpoints",
    "checkpoint_root",
    "committed_steps",
    "latest_committed_step",
    "placed",
    "placed_like",
    "read_lora",
    "read_metadata",
    "step_uri",
    "write_lora",
]
