"""Merge a LoRA adapter into an HF base checkpoint: `W + (alpha / r) * B @ A`, shard by shard.

Why in HF space and not in JAX: the merged model is for `transformers` and vLLM, which
read HF safetensors; adding the PEFT-layout delta to each HF weight is exactly what
`peft`'s `merge_and_unload` does, needs no model code, and streams one shard at a time,
so an 8B base merges in a few GB of host memory. The update is computed in float32 and
cast back to each weight's stored dtype.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from lora_trainer.adapters.peft_format import PeftLoraAdapter
from lora_trainer.errors import UserError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: Shard size of the merged output (transformers' own default is 5 GB; smaller shards upload in parallel).
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
#: Files of the base checkpoint that are weights (never copied as-is into the merged output).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")


def base_shards(base_dir: Path) -> list[Path]:
    """The base checkpoint's safetensors files, in index order; a missing one is a UserError naming it."""
    index = base_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UserError(f"{index} is not a safetensors index (no weight_map): {e}") from e
        files = list(dict.fromkeys(weight_map.values()))
    elif (base_dir / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        raise UserError(f"{base_dir} holds neither {SINGLE_FILE} nor {INDEX_FILE}: the base must be an HF safetensors checkpoint")
    paths = [base_dir / f for f in files]
    for p in paths:
        if not p.is_file():
            raise UserError(f"{p} is listed in {INDEX_FILE} but does not exist: copy the whole base checkpoint")
    return paths


def _read_shard(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    try:
        with safe_open(str(path), framework="np") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield key, f.get_tensor(key)
    except (SafetensorError, OSError) as e:
        raise UserError(f"{path} is not a readable safetensors file ({e}); it may be truncated: copy it again") from e


def merged_weight(key: str, weight: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    """`weight + scale * b @ a` in float32, cast back to the weight's dtype; shapes must fit."""
    if weight.shape != (b.shape[0], a.shape[1]):
        raise UserError(
            f"base weight {key!r} has shape {list(weight.shape)} but the adapter's update is "
            f"[{b.shape[0]}, {a.shape[1]}]: the adapter was made for a different base model"
        )
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
    pending: Mapping[str, tuple[np.ndarray, np.ndarray]] = {f"{m}.weight": ab for m, ab in adapter.modules.items()}
    unmerged = set(pending)
    writer = _ShardWriter(out_dir, max_shard_bytes)
    for shard in base_shards(base_dir):
        for key, weight in _read_shard(shard):
            if key in pending:
                a, b = pending[key]
                weight = merged_weight(key, weight, a, b, adapter.hyper.scale)
                unmerged.discard(key)
            writer.add(key, weight)
    if unmerged:
        raise UserError(
            f"the base model in {base_dir} has no weight {sorted(unmerged)[0]!r} that the adapter targets "
            f"({len(unmerged)} missing): the adapter was made for a different base model"
        )
    writer.finish()
    for p in sorted(base_dir.iterdir()):
        if p.is_file() and p.name != INDEX_FILE and not p.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(p, out_dir / p.name)
