"""Tokenized datasets kept under the run's output, so that a restart neither loads the tokenizer nor tokenizes again.

Why: a run restarted after a preemption tokenized its whole dataset again before its first
step, on every host: 6.2 s of a 50 s restart on a v5e host for 12,000 rows (3.4 s of them
importing transformers for the tokenizer), minutes for a large file (issue 21).

An entry is named by a digest of everything its tokens depend on: the data file's content (its
MD5 and size, which GCS keeps for an object, so a restart reads a gs:// file's from its metadata
and never downloads the file when its entry is there), the files of the model directory other
than weights (the tokenizer and its chat template live there), the dataset settings tokenizing
reads, the tokenizer libraries' versions and the source of `data`, which does the tokenizing.
Any change is a new name, so an entry is never stale; the entries of earlier settings are left
where they are. Entries are written whole (`storage.write_bytes`: a temporary and a rename, or
one GCS upload) by the first process, after the data was tokenized without error, and an
unreadable entry is tokenized again; one that cannot be written is a warning (only a restart's
time is at stake).

Every process of a run decides together: each reads the entry, and only when every one of
them could does the run skip tokenizing; otherwise all of them tokenize their shares and pool
them (`data.tokenize_file`), as they must, since pooling is collective. Hosts that do not
share `output.uri` (local paths on several hosts) therefore tokenize at every start.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import io
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from lora_trainer import data, storage
from lora_trainer.config import DatasetSpec

log = logging.getLogger(__name__)

#: Files of a model directory that tokenizing never reads (and that are too large to hash at every start).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")
#: The dataset settings that do not change what a file tokenizes to.
_NOT_TOKENIZING = {"train", "eval", "packing"}


def content_id(data_bytes: bytes) -> str:
    """A data file's content in an entry's name: its MD5 (base64, as GCS keeps it) and its size. Pure.
    MD5 identifies content here, as GCS uses it; it guards nothing (FIPS builds allow it so)."""
    return _content_id(base64.b64encode(hashlib.md5(data_bytes, usedforsecurity=False).digest()).decode(), len(data_bytes))


def _content_id(md5_base64: str, size: int) -> str:
    return f"{md5_base64}:{size}"


def entry_name(data_id: str, model_files: dict[str, bytes], spec: DatasetSpec, versions: dict[str, str]) -> str:
    """The cache entry's file name: a digest of everything the tokenized examples depend on (`data_id`:
    the data file's `content_id`). Pure."""
    digest = hashlib.sha256()
    for part in (
        json.dumps(spec.model_dump(mode="json", exclude=_NOT_TOKENIZING), sort_keys=True),
        json.dumps(versions, sort_keys=True),
        *(f"{name}:{hashlib.sha256(content).hexdigest()}" for name, content in sorted(model_files.items())),
        data_id,
    ):
        digest.update(part.encode() + b"\0")
    return f"{digest.hexdigest()}.npz"


def encode(dataset: data.TokenizedDataset, pad_id: int) -> bytes:
    """An entry: the examples as flat arrays (`data.example_arrays`), their counts and the tokenizer's padding id."""
    buf = io.BytesIO()
    np.savez(buf, counts=np.asarray([dataset.truncated, dataset.skipped, pad_id], np.int64), **data.example_arrays(dataset.examples))
    return buf.getvalue()


def decode(blob: bytes) -> tuple[data.TokenizedDataset, int]:
    """`encode`'s examples and padding id; ValueError (or the npz reader's error) for a damaged entry."""
    with np.load(io.BytesIO(blob), allow_pickle=False) as z:
        lengths, tokens, masks, counts = z["lengths"], z["tokens"], z["loss_mask"], z["counts"]
    if counts.shape != (3,) or not len(lengths):
        raise ValueError("the entry's counts are damaged or it holds no example")
    truncated, skipped, pad_id = (int(x) for x in counts)
    return data.TokenizedDataset(data.examples_from_arrays(lengths, tokens, masks), truncated, skipped), pad_id


def _versions() -> dict[str, str]:
    """What else decides the ids: the tokenizer libraries and the trainer's own tokenizing code."""
    versions = {"data.py": hashlib.sha256(Path(data.__file__).read_bytes()).hexdigest()}
    for package in ("tokenizers", "transformers"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "none"
    return versions


def _model_files(model_dir: Path) -> dict[str, bytes]:
    return {
        f.name: f.read_bytes()
        for f in sorted(model_dir.iterdir())
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES)
    }


def _agreed(share: data.Share, ok: bool) -> bool:
    """True when `ok` holds on every process (one collective round)."""
    return all(flag == b"1" for flag in share.allgather(b"1" if ok else b"0"))


class TokenCache:
    """The tokenized datasets of one run: read from `root` when every process can, else tokenized and written.

    The tokenizer is loaded on the first miss only, so a restart whose entries are all there
    never imports transformers.
    """

    def __init__(self, root: str, model_dir: Path, spec: DatasetSpec, share: data.Share, *, primary: bool) -> None:
        self.root = root
        self.model_dir = model_dir
        self.spec = spec
        self.share = share
        self.primary = primary
        self._tokenizer: Any = None
        self._model_files = _model_files(model_dir)
        self._versions = _versions()

    def tokenized(self, uri: str) -> tuple[data.TokenizedDataset, int]:
        """`uri`'s tokenized examples and the tokenizer's padding id."""
        raw: bytes | None = None
        known = storage.md5_and_size(uri)  # a gs:// object's, from its metadata: no download
        if known is None:
            raw = storage.read_bytes(uri)
            entry = self._entry(content_id(raw))
        else:
            entry = self._entry(_content_id(*known))
        found = self._read(entry)
        if _agreed(self.share, found is not None):
            assert found is not None
            log.info("%s: %d examples read from %s (tokenized at an earlier start of this run)", uri,
                     len(found[0].examples), entry)  # fmt: skip
            return found
        if self._tokenizer is None:
            self._tokenizer = data.load_tokenizer(self.model_dir)
        tokenizer = self._tokenizer
        if raw is None:  # named from the object's metadata: download it, and name the entry by the bytes tokenized
            raw = storage.read_bytes(uri)
            entry = self._entry(content_id(raw))
        dataset = data.tokenize_file(uri, self.spec, tokenizer, self.share, raw=raw)
        pad_id = data.padding_id(tokenizer)
        if self.primary:
            try:
                storage.write_bytes(entry, encode(dataset, pad_id))
            except Exception as e:  # only a restart's time is lost; a broken output fails the checkpoints, by name
                log.warning("could not keep the tokenized dataset in %s (%s); a restart tokenizes it again", entry, e)
        self.share.allgather(b"")  # all go on once it is written: a later read of the same file finds it on every process
        return dataset, pad_id

    def _entry(self, data_id: str) -> str:
        return storage.join(self.root, entry_name(data_id, self._model_files, self.spec, self._versions))

    @staticmethod
    def _read(entry: str) -> tuple[data.TokenizedDataset, int] | None:
        if not storage.exists(entry):
            return None
        try:
            return decode(storage.read_bytes(entry))
        except Exception as e:  # a damaged entry of any kind is tokenized again, and replaced
            log.warning("the tokenized dataset %s is unreadable (%s); tokenizing again", entry, e)
            return None
