"""Read HF safetensors checkpoints (single file or sharded with an index) without copying.

A small reader instead of `safetensors.safe_open` because it memory-maps each tensor
straight into numpy (bfloat16 included, via ml_dtypes) and can say exactly which file
and key is truncated or corrupt.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from lora_trainer import storage
from lora_trainer.errors import UserError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}


def _header(path: Path) -> tuple[dict, int]:
    """(header without __metadata__, byte offset of the data section)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise UserError(f"{path} is not a safetensors file (only {size} bytes): re-upload the checkpoint")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise UserError(f"{path} is truncated or corrupt (header length {n} > file size {size}): re-upload it")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"{path} has a corrupt safetensors header ({e}): re-upload the checkpoint") from e
    if not isinstance(header, dict):
        raise UserError(f"{path} has a corrupt safetensors header (a JSON {type(header).__name__}, not an object): re-upload the checkpoint")
    header.pop("__metadata__", None)
    data_start = 8 + n
    for key, info in header.items():
        try:
            begin, end = info["data_offsets"]
            end = int(end)
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"{path} has a corrupt safetensors header: tensor {key!r} has no valid data_offsets; re-upload the checkpoint") from e
        if data_start + end > size:
            raise UserError(
                f"{path} is truncated: tensor {key!r} ends at byte {data_start + end} but the file has {size} bytes; "
                "re-upload the checkpoint"
            )
    return header, data_start


class SafetensorsCheckpoint:
    """The tensors of an HF checkpoint directory, by key, read lazily via memory maps."""

    def __init__(self, directory: Path):
        self.directory = directory
        index = directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
                if not all(isinstance(f, str) for f in files):
                    raise TypeError("weight_map values must be file names")
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
                raise UserError(
                    f"{index} is not a valid safetensors index ({e}); it must be a JSON object whose weight_map maps "
                    "tensor names to files: re-upload the checkpoint"
                ) from e
        elif (directory / SINGLE_FILE).is_file():
            files, weight_map = [SINGLE_FILE], {}
        else:
            found = sorted(p.name for p in directory.iterdir())
            raise UserError(
                f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE} (found: {found}); point model.source at an "
                "HF checkpoint saved with save_pretrained(safe_serialization=True)"
            )
        self._headers: dict[str, tuple[dict, int]] = {}
        self._where: dict[str, str] = {}
        for name in files:
            path = directory / storage.confined_name(name, str(directory))  # the index names files: keep them inside
            if not path.is_file():
                raise UserError(f"{path} is listed in {INDEX_FILE} but missing: re-upload the checkpoint")
            self._headers[name] = _header(path)
            for key in self._headers[name][0]:
                self._where[key] = name
        for key, name in weight_map.items():
            if self._where.get(key) != name:
                raise UserError(f"{INDEX_FILE} says {key!r} is in {name}, but that file does not hold it: re-upload")

    def keys(self) -> list[str]:
        return sorted(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def shape(self, key: str) -> tuple[int, ...]:
        header, _ = self._headers[self._file(key)]
        return tuple(header[key]["shape"])

    def _file(self, key: str) -> str:
        if key not in self._where:
            raise UserError(
                f"tensor {key!r} is missing from the checkpoint in {self.directory}: the checkpoint is incomplete "
                "or of another model family (check model.family / config.json)"
            )
        return self._where[key]

    def get(self, key: str) -> np.ndarray:
        """The tensor `key` as a read-only numpy array backed by the file."""
        name = self._file(key)
        header, data_start = self._headers[name]
        info = header[key]
        if info["dtype"] not in _DTYPES:
            raise UserError(f"{self.directory / name}: tensor {key!r} has unsupported dtype {info['dtype']}")
        dtype = _DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        count = int(np.prod(info["shape"], dtype=np.int64))
        if count * dtype.itemsize != end - begin:
            raise UserError(f"{self.directory / name}: tensor {key!r} has inconsistent offsets; re-upload the checkpoint")
        data = np.memmap(self.directory / name, dtype=dtype, mode="r", offset=data_start + begin, shape=(count,))
        return data.reshape(info["shape"])
