"""`token_cache`: a restart reads the tokenized data an earlier start wrote, and never a stale or damaged entry."""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lora_trainer import data, token_cache
from lora_trainer.config import DatasetSpec
from lora_trainer.tiny_models import make_tiny_hf_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model("llama3", tmp_path_factory.mktemp("model"))


def _dataset(tmp_path: Path, rows: int = 12) -> DatasetSpec:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Question {i}?", "completion": f" Answer {i} " * (i % 3 + 1)}) + "\n" for i in range(rows)))
    return DatasetSpec(train=str(path), max_seq_len=16)


def _as_lists(ds: data.TokenizedDataset) -> tuple:
    return [(e.tokens.tolist(), e.loss_mask.tolist(), e.tokens.dtype, e.loss_mask.dtype) for e in ds.examples], ds.truncated, ds.skipped


class _CountingLoads:
    """`data.load_tokenizer`, counting its calls; `refuse` makes a call fail the test."""

    def __init__(self, refuse: bool = False) -> None:
        self.calls, self.refuse, self.real = 0, refuse, data.load_tokenizer

    def __call__(self, model_dir: Path):  # noqa: ANN204
        self.calls += 1
        assert not self.refuse, "the tokenizer was loaded although every dataset was in the cache"
        return self.real(model_dir)


def test_a_restart_reads_what_the_first_start_tokenized_without_loading_the_tokenizer(tmp_path, model_dir, monkeypatch, caplog) -> None:
    spec = _dataset(tmp_path)
    want = data.tokenize_file(spec.train, spec, data.load_tokenizer(model_dir))
    loads = _CountingLoads()
    monkeypatch.setattr(data, "load_tokenizer", loads)
    first, pad_id = token_cache.TokenCache(str(tmp_path / "out" / "tokenized"), model_dir, spec, data.Share(), primary=True).tokenized(spec.train)
    assert loads.calls == 1 and _as_lists(first) == _as_lists(want) and want.truncated > 0
    assert [p.suffix for p in (tmp_path / "out" / "tokenized").iterdir()] == [".npz"]  # no temporary left behind

    monkeypatch.setattr(data, "load_tokenizer", _CountingLoads(refuse=True))
    with caplog.at_level(logging.INFO, logger="lora_trainer.token_cache"):
        again, again_pad = token_cache.TokenCache(str(tmp_path / "out" / "tokenized"), model_dir, spec, data.Share(), primary=True).tokenized(spec.train)
    assert _as_lists(again) == _as_lists(want) and again_pad == pad_id == data.padding_id(data.load_tokenizer.real(model_dir))
    assert "12 examples read from" in caplog.text


def test_an_entry_is_named_by_everything_tokenizing_reads() -> None:
    spec = DatasetSpec(train="a.jsonl", max_seq_len=16)
    files, versions = {"tokenizer.json": b"{}", "config.json": b"{}"}, {"tokenizers": "1", "data.py": "x"}
    name = token_cache.entry_name(token_cache.content_id(b"rows"), files, spec, versions)
    assert name.endswith(".npz")
    changed = [
        token_cache.entry_name(token_cache.content_id(b"rows!"), files, spec, versions),
        token_cache.entry_name(token_cache.content_id(b"rows"), {**files, "tokenizer.json": b"{ }"}, spec, versions),
        token_cache.entry_name(token_cache.content_id(b"rows"), {**files, "chat_template.jinja": b"t"}, spec, versions),
        token_cache.entry_name(token_cache.content_id(b"rows"), files, spec.model_copy(update={"max_seq_len": 17}), versions),
        token_cache.entry_name(token_cache.content_id(b"rows"), files, spec.model_copy(update={"format": "text"}), versions),
        token_cache.entry_name(token_cache.content_id(b"rows"), files, spec, {**versions, "data.py": "y"}),
    ]
    assert len({name, *changed}) == 1 + len(changed)
    # Where the file lies, the eval file and packing do not change its tokens.
    same = spec.model_copy(update={"train": "elsewhere/b.jsonl", "eval": "e.jsonl", "packing": True})
    assert token_cache.entry_name(token_cache.content_id(b"rows"), files, same, versions) == name


def test_a_damaged_entry_is_tokenized_again_and_replaced(tmp_path, model_dir, monkeypatch, caplog) -> None:
    spec = _dataset(tmp_path)
    root = tmp_path / "tokenized"
    want, _ = token_cache.TokenCache(str(root), model_dir, spec, data.Share(), primary=True).tokenized(spec.train)
    (entry,) = root.iterdir()
    entry.write_bytes(entry.read_bytes()[:100])  # cut short, as a copy interrupted outside the trainer would leave it
    loads = _CountingLoads()
    monkeypatch.setattr(data, "load_tokenizer", loads)
    with caplog.at_level(logging.WARNING, logger="lora_trainer.token_cache"):
        got, _ = token_cache.TokenCache(str(root), model_dir, spec, data.Share(), primary=True).tokenized(spec.train)
    assert loads.calls == 1 and "is unreadable" in caplog.text and _as_lists(got) == _as_lists(want)
    assert _as_lists(token_cache.decode(entry.read_bytes())[0]) == _as_lists(want)


def _two_processes(roots: list[Path], spec: DatasetSpec, model_dir: Path) -> list[data.TokenizedDataset]:
    """Two participants, each with its own cache location (hosts whose outputs are local disks),
    pooling through a real exchange: threads meeting at barriers, as processes do in
    `distributed.allgather_bytes`."""
    inbox: list[bytes] = [b"", b""]
    posted, read = threading.Barrier(2), threading.Barrier(2)

    def run(k: int) -> data.TokenizedDataset:
        def allgather(blob: bytes) -> list[bytes]:
            inbox[k] = blob
            posted.wait()
            gathered = list(inbox)
            read.wait()
            return gathered

        cache = token_cache.TokenCache(str(roots[k]), model_dir, spec, data.Share(k, 2, allgather), primary=k == 0)
        return cache.tokenized(spec.train)[0]

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(run, range(2)))


def test_processes_skip_tokenizing_only_when_every_one_has_the_entry(tmp_path, model_dir, monkeypatch) -> None:
    spec = _dataset(tmp_path, rows=9)
    want = _as_lists(data.tokenize_file(spec.train, spec, data.load_tokenizer(model_dir)))
    roots = [tmp_path / "host0", tmp_path / "host1"]
    loads = _CountingLoads()
    monkeypatch.setattr(data, "load_tokenizer", loads)
    assert [_as_lists(d) for d in _two_processes(roots, spec, model_dir)] == [want, want]
    assert loads.calls == 2 and len(list(roots[0].iterdir())) == 1 and not roots[1].exists()  # the first process writes
    # Only host 0 has the entry: both tokenize again, their shares pooled as before.
    assert [_as_lists(d) for d in _two_processes(roots, spec, model_dir)] == [want, want]
    assert loads.calls == 4
    # A shared location: both read it, and nobody loads a tokenizer.
    monkeypatch.setattr(data, "load_tokenizer", _CountingLoads(refuse=True))
    assert [_as_lists(d) for d in _two_processes([roots[0], roots[0]], spec, model_dir)] == [want, want]


def test_an_entry_that_cannot_be_written_is_a_warning(tmp_path, model_dir, caplog) -> None:
    spec = _dataset(tmp_path)
    (tmp_path / "a-file").write_text("")  # the cache's location lies under a file: nothing can be written there
    with caplog.at_level(logging.WARNING, logger="lora_trainer.token_cache"):
        got, _ = token_cache.TokenCache(str(tmp_path / "a-file" / "tokenized"), model_dir, spec, data.Share(), primary=True).tokenized(spec.train)
    assert _as_lists(got) == _as_lists(data.tokenize_file(spec.train, spec, data.load_tokenizer(model_dir)))
    assert "could not keep the tokenized dataset" in caplog.text
