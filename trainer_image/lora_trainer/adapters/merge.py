"""Merge a LoRA adapter into an HF base checkpoint: `W + (alpha / r) * B @ A`, shard by shard.

Why in HF space and not in JAX: the merged model is for `transformers` and vLLM, which
read HF safetensors; adding the PEFT-layout delta to each HF weight is exactly what
`peft`'s `merge_and_unload` does, needs no model code, and reads the base through memory
maps and writes one output shard at a time, so an 8B base merges in a few GB of host memory. The update is computed in float32 and
cast back to each weight's stored dtype.
"""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from lora_trainer import storage
from lora_trainer.adapters.peft_format import PeftLoraAdapter
from lora_trainer.errors import UserError
from lora_trainer.models.registry import FAMILIES, get_family
from lora_trainer.models.safetensors_io import INDEX_FILE, SafetensorsCheckpoint

#: Shard size of the merged output (transformers' own default is 5 GB; smaller shards upload in parallel).
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
#: Files of the base checkpoint that are weights (never copied as-is into the merged output).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")


def check_fits(key: str, weight_shape: tuple[int, ...], a: np.ndarray, b: np.ndarray) -> None:
    """The update `b @ a` must have the base weight's [out, in] shape."""
    if tuple(weight_shape) != (b.shape[0], a.shape[1]):
        raise UserError(
            f"base weight {key!r} has shape {list(weight_shape)} but the adapter's update is "
            f"[{b.shape[0]}, {a.shape[1]}]: the adapter was made for a different base model"
        )


def merged_weight(weight: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    """`weight + scale * b @ a` in float32, cast back to the weight's dtype."""
    delta = (b.astype(np.float32) @ a.astype(np.float32)) * np.float32(scale)
    return (weight.astype(np.float32) + delta).astype(weight.dtype)


class _ShardWriter:
    """Packs tensors into shards of at most `max_bytes` (one tensor per shard if larger) and writes the index."""

    def __init__(self, out_dir: Path, max_bytes: int) -> None:
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.pending: dict[str, np.ndarray] = {}
        self.pending_bytes = 0
        self.written: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, key: str, arr: np.ndarray) -> None:
        if self.pending and self.pending_bytes + arr.nbytes > self.max_bytes:
            self.flush()
        self.pending[key] = np.ascontiguousarray(arr)
        self.pending_bytes += arr.nbytes
        self.total += arr.nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        path = self.out_dir / f".shard-{len(self.written):05d}.tmp"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.written.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """Name shards `model-0000i-of-0000n.safetensors` now that n is known, and write the index."""
        self.flush()
        n = len(self.written)
        weight_map: dict[str, str] = {}
        for i, (tmp, keys) in enumerate(self.written, start=1):
            name = f"model-{i:05d}-of-{n:05d}.safetensors"
            tmp.rename(self.out_dir / name)
            weight_map.update(dict.fromkeys(keys, name))
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


@functools.cache
def _stored_prefixes() -> tuple[tuple[str, str], ...]:
    """(module-name prefix, another prefix its tensors are stored under) of the families' multimodal
    checkpoints (`NestedText`): e.g. Gemma 3's decoder `model.language_model.*`, saved as `language_model.model.*`."""
    nested = [n for n in (get_family(f).nested_text for f in FAMILIES) if n is not None]
    return tuple((n.module_prefix, p) for n in nested for p in n.tensor_prefixes if p != n.module_prefix)


def stored_weight_key(module: str, keys: set[str]) -> str:
    """The key of an HF module's weight in a checkpoint holding `keys`: `<module>.weight`, or its
    stored name under another prefix (`_stored_prefixes`) when only that exists."""
    key = f"{module}.weight"
    for prefix, stored in _stored_prefixes():
        other = stored + key[len(prefix) :]
        if key.startswith(prefix) and key not in keys and other in keys:
            return other
    return key


def merge_adapter_into_checkpoint(
    base_dir: Path,
    adapter: PeftLoraAdapter,
    out_dir: Path,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write the base checkpoint with the adapter merged into `out_dir` (sharded safetensors + index).

    Config, tokenizer and generation files are copied unchanged. Every adapter module must
    name a weight of the base (`<module>.weight`), else a UserError names it.
    """
    base = SafetensorsCheckpoint(base_dir)
    # Checked before any work, as every copy checks names and links (a link to a file elsewhere would be carried along).
    extras = [n for n in storage.local_files(base_dir) if "/" not in n and n != INDEX_FILE and not n.endswith(_WEIGHT_SUFFIXES)]
    keys = set(base.keys())
    pending: Mapping[str, tuple[np.ndarray, np.ndarray]] = {stored_weight_key(m, keys): ab for m, ab in adapter.modules.items()}
    unmerged = sorted(set(pending) - keys)
    if unmerged:
        raise UserError(
            f"the base model in {base_dir} has no weight {unmerged[0]!r} that the adapter targets "
            f"({len(unmerged)} missing): the adapter was made for a different base model"
        )
    for key, (a, b) in pending.items():
        check_fits(key, base.shape(key), a, b)
    writer = _ShardWriter(out_dir, max_shard_bytes)
    for key in base.keys():
        weight = base.get(key)
        if key in pending:
            a, b = pending[key]
            weight = merged_weight(weight, a, b, adapter.hyper.scale)
        writer.add(key, weight)
    writer.finish()
    for name in extras:
        shutil.copy2(base_dir / name, out_dir / name)
