"""Data: formats and loss masks, truncation, packing, bad rows, deterministic sharded resumable stream."""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lora_trainer import data, host_memory
from lora_trainer.config import DatasetSpec
from lora_trainer.errors import UserError
from lora_trainer.tiny_models import CHAT_TEMPLATE, build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(272)


def _spec(**kw) -> DatasetSpec:
    return DatasetSpec(train="unused.jsonl", **kw)


def _write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _masked_text(tok, ex: data.Example) -> str:
    return tok.decode(ex.tokens[ex.loss_mask.astype(bool)])


def test_prompt_completion_loss_only_on_completion(tok):
    ex = data.tokenize_row({"prompt": "Question: two plus two?", "completion": " Answer: four."}, _spec(), tok, "f line 1")
    assert ex.tokens[0] == tok.bos_token_id and ex.loss_mask[0] == 0
    assert ex.tokens[-1] == tok.eos_token_id and ex.loss_mask[-1] == 1
    assert _masked_text(tok, ex) == " Answer: four.<|eos|>"
    n_prompt = len(tok("Question: two plus two?", add_special_tokens=False)["input_ids"])
    assert ex.loss_mask[: 1 + n_prompt].sum() == 0


def test_text_format_loss_on_every_token_and_custom_field(tok):
    ex = data.tokenize_row({"body": "the lazy dog"}, _spec(format="text", text_field="body"), tok, "f line 1")
    assert ex.loss_mask.tolist() == [0] + [1] * (len(ex.tokens) - 1)
    assert tok.decode(ex.tokens[1:-1]) == "the lazy dog"


MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "fine, thank you"},
    {"role": "user", "content": "two plus two?"},
    {"role": "assistant", "content": "four"},
]


def test_chat_loss_only_on_assistant_turns(tok):
    ex = data.tokenize_row({"messages": MESSAGES}, _spec(format="chat"), tok, "f line 1")
    assert _masked_text(tok, ex) == "fine, thank you<|end|>four<|end|>"
    rendered = tok.apply_chat_template(MESSAGES, tokenize=True, return_dict=True)["input_ids"]
    assert ex.tokens.tolist() == list(rendered)


def test_chat_without_generation_markers_finds_the_same_assistant_tokens(tok):
    plain = build_tokenizer(272)
    # Jinja's trim_blocks eats the newline after `{% endgeneration %}`; drop it too so both render alike.
    plain.chat_template = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}\n", "")
    a = data.tokenize_row({"messages": MESSAGES}, _spec(format="chat"), tok, "f")
    b = data.tokenize_row({"messages": MESSAGES}, _spec(format="chat"), plain, "f")
    assert a.tokens.tolist() == b.tokens.tolist()
    assert a.loss_mask.tolist() == b.loss_mask.tolist()


#: Qwen3's rule, in the tiny tokenizer's tokens: the reply after the last user turn gets an (empty)
#: `<think>` block, earlier replies none, so a render that stops after an earlier reply is no prefix
#: of the whole conversation's.
QWEN3_LIKE = (
    "{% set ns = namespace(last_user=0) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and loop.index0 > ns.last_user %}"
    "{{ '<|start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m.content | trim + '<|end|>\\n' }}"
    "{% else %}{{ '<|start|>' + m.role + '\\n' + m.content | trim + '<|end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant\\n' }}{% endif %}"
)


def test_chat_finds_replies_that_render_differently_as_the_last_turn(tok):
    qwen3 = build_tokenizer(272)
    qwen3.chat_template = QWEN3_LIKE
    ex = data.tokenize_row({"messages": MESSAGES}, _spec(format="chat"), qwen3, "f")
    rendered = qwen3.apply_chat_template(MESSAGES, tokenize=True, return_dict=True)["input_ids"]
    assert ex.tokens.tolist() == list(rendered)
    runs, current = [], []
    for t, m in zip(ex.tokens.tolist(), ex.loss_mask.tolist(), strict=True):
        if m:
            current.append(t)
        elif current:
            runs, current = [*runs, qwen3.decode(current)], []
    assert runs + ([qwen3.decode(current)] if current else []) == [
        "fine, thank you<|end|>",
        "<think>\n\n</think>\n\nfour<|end|>",
    ]


def test_chat_template_errors_name_the_row(tmp_path, tok):
    strict = build_tokenizer(272)
    strict.chat_template = (
        "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "<|start|>{{ m.role }}\n{{ m.content }}<|end|>\n{% endfor %}"
    )
    rows = [{"messages": MESSAGES[1:3]}, {"messages": [MESSAGES[1], MESSAGES[1], MESSAGES[2]]}]
    with pytest.raises(UserError, match=r"t\.jsonl line 2: the model's chat template rejects field 'messages': Conversation roles"):
        data.tokenize_file(_write_jsonl(tmp_path / "t.jsonl", rows), _spec(format="chat"), strict)


def test_conversational_prompt_completion_points_at_chat(tok):
    row = {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}]}
    with pytest.raises(UserError, match=r"field 'prompt' \(dataset.promptField\) is a list of messages.*format: chat"):
        data.tokenize_row(row, _spec(), tok, "f line 1")


def test_truncation_is_counted_and_logged(tmp_path, tok, caplog):
    long = "the quick brown fox jumps over the lazy dog " * 10
    f = _write_jsonl(tmp_path / "t.jsonl", [{"prompt": "Q:", "completion": long}, {"prompt": "Q:", "completion": " four"}])
    with caplog.at_level(logging.INFO, logger="lora_trainer.data"):
        ds = data.tokenize_file(f, _spec(max_seq_len=16), tok)
    assert ds.truncated == 1 and ds.skipped == 0
    assert max(len(e.tokens) for e in ds.examples) == 16
    assert "1 truncated to maxSeqLen=16" in caplog.text


def test_examples_without_loss_tokens_after_truncation_are_skipped(tmp_path, tok):
    f = _write_jsonl(tmp_path / "t.jsonl", [{"prompt": "hello " * 20, "completion": " x"}, {"prompt": "Q", "completion": " four"}])
    ds = data.tokenize_file(f, _spec(max_seq_len=8), tok)
    assert ds.skipped == 1 and len(ds.examples) == 1
    only_long = _write_jsonl(tmp_path / "u.jsonl", [{"prompt": "hello " * 20, "completion": " x"}])
    with pytest.raises(UserError, match="raise maxSeqLen"):
        data.tokenize_file(only_long, _spec(max_seq_len=8), tok)


@pytest.mark.parametrize(
    ("rows", "spec", "match"),
    [
        ([{"prompt": "a", "completion": "b"}, {"prompt": "a"}], {}, r"t\.jsonl line 2: missing field 'completion' \(set by dataset\.completionField\)"),
        ([{"prompt": "a", "completion": 3}], {}, r"line 1: field 'completion' must be a str, got int"),
        ([{"text": "a"}], {"format": "chat"}, r"line 1: missing field 'messages'"),
        ([{"messages": [{"role": "user"}]}], {"format": "chat"}, r"line 1: field 'messages' item 0"),
        ([{"messages": [{"role": "user", "content": "x"}]}], {"format": "chat"}, "no assistant message"),
    ],
)
def test_bad_rows_name_file_line_and_field(tmp_path, tok, rows, spec, match):
    f = _write_jsonl(tmp_path / "t.jsonl", rows)
    with pytest.raises(UserError, match=match):
        data.tokenize_file(f, _spec(**spec), tok)


def test_unreadable_files_are_user_errors(tmp_path, tok):
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{not json\n')
    with pytest.raises(UserError, match=r"b\.jsonl line 2: not valid JSON"):
        data.tokenize_file(str(bad), _spec(), tok)
    bad.write_text('{"prompt": "a", "completion": "b"}\n["a list"]\n')
    with pytest.raises(UserError, match=r"b\.jsonl line 2: expected a JSON object, got list"):
        data.tokenize_file(str(bad), _spec(), tok)
    (tmp_path / "c.parquet").write_bytes(b"PAR1 garbage")
    with pytest.raises(UserError, match=r"c\.parquet is not a readable Parquet file"):
        data.tokenize_file(str(tmp_path / "c.parquet"), _spec(), tok)
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(UserError, match=r"\.jsonl.*\.parquet"):
        data.tokenize_file(str(tmp_path / "d.csv"), _spec(), tok)
    with pytest.raises(UserError, match="missing.jsonl"):
        data.tokenize_file(str(tmp_path / "missing.jsonl"), _spec(), tok)
    (tmp_path / "e.jsonl").write_text("\n \n")
    with pytest.raises(UserError, match=r"e\.jsonl holds no rows"):
        data.tokenize_file(str(tmp_path / "e.jsonl"), _spec(), tok)


def test_jsonl_lines_split_on_newlines_only(tmp_path, tok):
    rows = [{"text": "one\u2028two\u2029three\x85four"}, {"text": "plain"}]
    f = tmp_path / "u.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows).encode())
    ds = data.tokenize_file(str(f), _spec(format="text"), tok)
    assert [tok.decode(e.tokens[1:-1]) for e in ds.examples] == [r["text"] for r in rows]
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(UserError, match=r"latin1\.jsonl line 2: not valid UTF-8 \(byte 14 of the line\)"):
        data.tokenize_file(str(tmp_path / "latin1.jsonl"), _spec(format="text"), tok)


def _tokenize_in_shares(uri: str, spec: DatasetSpec, count: int) -> list[data.TokenizedDataset | UserError]:
    """`tokenize_file` run by `count` concurrent participants, each with its own tokenizer, pooling
    their shares through a real exchange (threads meeting at a barrier, as processes meet in
    `distributed.allgather_bytes`); each one's dataset, or the UserError it raised."""
    inbox: list[bytes] = [b""] * count
    barrier = threading.Barrier(count)

    def run(k: int) -> data.TokenizedDataset | UserError:
        def allgather(blob: bytes) -> list[bytes]:
            inbox[k] = blob
            barrier.wait()
            return list(inbox)

        try:
            return data.tokenize_file(uri, spec, build_tokenizer(272), data.Share(k, count, allgather))
        except UserError as e:
            return e

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(run, range(count)))


def _as_lists(ds: data.TokenizedDataset) -> tuple:
    return [(e.tokens.tolist(), e.loss_mask.tolist(), e.tokens.dtype, e.loss_mask.dtype) for e in ds.examples], ds.truncated, ds.skipped


def test_shares_tokenized_apart_pool_into_the_whole_file(tmp_path, tok, caplog):
    long = "the quick brown fox jumps over the lazy dog " * 4
    rows = [{"prompt": f"Q{i}:", "completion": long if i % 4 == 1 else f" answer {i}"} for i in range(10)]
    rows[6] = {"prompt": "hello " * 20, "completion": " x"}  # nothing left to learn after truncation: skipped
    f = _write_jsonl(tmp_path / "t.jsonl", rows)
    whole = data.tokenize_file(f, _spec(max_seq_len=24), tok)
    assert whole.truncated >= 2 and whole.skipped == 1
    with caplog.at_level(logging.INFO, logger="lora_trainer.data"):
        pooled = _tokenize_in_shares(f, _spec(max_seq_len=24), 3)
    assert [_as_lists(ds) for ds in pooled] == [_as_lists(whole)] * 3
    # Rows go round-robin: of 10 rows, process 0 tokenizes 4 (0, 3, 6, 9), processes 1 and 2 three each.
    assert "(this process tokenized 4 of them, process 0 of 3)" in caplog.text
    assert "(this process tokenized 3 of them, process 2 of 3)" in caplog.text
    # More processes than rows: the last process's share is empty and it still pools.
    two = _write_jsonl(tmp_path / "two.jsonl", rows[:2])
    assert [_as_lists(ds) for ds in _tokenize_in_shares(two, _spec(max_seq_len=24), 3)] == [_as_lists(data.tokenize_file(two, _spec(max_seq_len=24), tok))] * 3


def test_every_share_raises_the_earliest_bad_row_of_the_file(tmp_path, tok):
    rows = [{"prompt": "a", "completion": "b"} for _ in range(9)]
    rows[7] = {"prompt": "a"}  # process 1's share (row 7 of 3 processes), line 8
    rows[5] = {"prompt": "a", "completion": 5}  # process 2's share, line 6: the earliest
    lines = [json.dumps(r) for r in rows]
    lines[6] = "{not json"  # process 0's share, line 7: each process parses only its own lines
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError) as whole:
        data.tokenize_file(str(f), _spec(), tok)
    assert "line 6: field 'completion' must be a str" in str(whole.value)
    assert [str(e) for e in _tokenize_in_shares(str(f), _spec(), 3)] == [str(whole.value)] * 3
    lines[5] = json.dumps({"prompt": "a", "completion": "b"})
    f.write_text("\n".join(lines) + "\n")
    assert {str(e) for e in _tokenize_in_shares(str(f), _spec(), 3)} == {f"{f} line 7: not valid JSON (Expecting property name enclosed in double quotes); every line must be one JSON object"}


def test_parquet_reads_like_jsonl(tmp_path, tok):
    rows = [{"prompt": f"Q{i}", "completion": f" A{i}"} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    a = data.tokenize_file(str(tmp_path / "d.parquet"), _spec(), tok)
    b = data.tokenize_file(_write_jsonl(tmp_path / "d.jsonl", rows), _spec(), tok)
    assert [e.tokens.tolist() for e in a.examples] == [e.tokens.tolist() for e in b.examples]


def _examples(lengths: list[int]) -> list[data.Example]:
    return [data.Example(np.arange(1, n + 1, dtype=np.int32) + 100 * i, np.ones(n, np.int32)) for i, n in enumerate(lengths)]


def test_packing_keeps_segments_and_positions():
    seqs = data.pack(_examples([5, 3, 4, 2, 6]), 8)
    assert all(len(s.tokens) <= 8 for s in seqs)
    assert sum(int(s.tokens.size) for s in seqs) == 20 and len(seqs) == 3  # 5+3, 4+2, 6
    first = seqs[0]
    assert first.segment_ids.tolist() == [1] * 5 + [2] * 3
    assert first.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    batch = data.collate(seqs, 4, 8, pad_id=0)
    assert batch["input_tokens"].shape == (4, 8)
    assert batch["segment_ids"][3].tolist() == [0] * 8  # a padding row
    assert batch["segment_ids"][2].tolist() == [1] * 6 + [0, 0]


def test_packing_is_first_fit_in_file_order():
    def first_fit(lengths, cap):  # the plain quadratic scan
        bins, room = [], []
        for i, n in enumerate(lengths):
            for b, r in enumerate(room):
                if n <= r:
                    bins[b].append(i)
                    room[b] -= n
                    break
            else:
                bins.append([i])
                room.append(cap - n)
        return bins

    rng = np.random.default_rng(0)
    for cap, count in ((8, 1), (8, 2), (64, 300), (1024, 2000)):
        lengths = rng.integers(2, cap + 1, count).tolist()
        packed = data.pack(_examples(lengths), cap)
        expected = [[(100 * i + 1) for i in b] for b in first_fit(lengths, cap)]
        got = [s.tokens[s.positions == 0].tolist() for s in packed]
        assert got == expected


def _stream(seqs, **kw) -> data.BatchStream:
    base = {"global_batch": 4, "seq_len": 8, "seed": 0, "pad_id": 0}
    return data.BatchStream(seqs, **{**base, **kw})


def test_stream_is_seeded_and_resumable():
    seqs = [data._single(e) for e in _examples([3, 4, 5, 6, 7, 3, 4])]
    one = [next(s) for s in [_stream(seqs)] for _ in range(6)]
    again = [next(s) for s in [_stream(seqs)] for _ in range(6)]
    other = [next(s) for s in [_stream(seqs, seed=1)] for _ in range(6)]
    assert all(np.array_equal(a["input_tokens"], b["input_tokens"]) for a, b in zip(one, again, strict=True))
    assert not all(np.array_equal(a["input_tokens"], b["input_tokens"]) for a, b in zip(one, other, strict=True))
    # Every epoch is a permutation: the first 7 rows cover every sequence once.
    firsts = np.concatenate([b["input_tokens"][:, 0] for b in one])[:7]
    assert sorted(firsts.tolist()) == sorted(s.tokens[0] for s in seqs)

    # Resume: a new stream restored from the state after 2 batches continues with batch 3.
    s = _stream(seqs)
    next(s), next(s)
    state = json.loads(json.dumps(s.state()))
    resumed = _stream(seqs)
    resumed.restore(state)
    for k in range(2, 6):
        np.testing.assert_array_equal(next(resumed)["input_tokens"], one[k]["input_tokens"])


def test_tokenizer_comes_from_the_model_dir_only(tmp_path, tok):
    tok.save_pretrained(tmp_path / "model")
    loaded = data.load_tokenizer(tmp_path / "model")
    assert loaded("hello")["input_ids"] == tok("hello")["input_ids"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no tokenizer"):
        data.load_tokenizer(tmp_path / "empty")
    with pytest.raises(UserError, match="not a directory"):
        data.load_tokenizer(tmp_path / "nope")
    (tmp_path / "model" / "tokenizer.json").write_text('{"garbage": 1}')  # valid JSON, not a tokenizer
    with pytest.raises(UserError, match="cannot load the tokenizer"):
        data.load_tokenizer(tmp_path / "model")


class _CountingTokenizer:
    """A tokenizer that counts its calls: a batch (list) or one text."""

    def __init__(self, tok):
        self.tok, self.batches, self.texts = tok, 0, 0

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def __call__(self, text, **kwargs):
        if isinstance(text, list):
            self.batches += 1
        else:
            self.texts += 1
        return self.tok(text, **kwargs)


@pytest.mark.parametrize("one_arena", [False, True], ids=["arenas", "one-arena"])
@pytest.mark.parametrize("spec", [_spec(format="text"), _spec()], ids=["text", "prompt-completion"])
def test_a_files_texts_are_encoded_in_one_batch_with_the_same_ids(tmp_path, tok, spec, one_arena, monkeypatch):
    """The file's texts go to the tokenizer in one batch call (every core encodes), text by text where
    threads share one malloc arena; each example is what `tokenize_row` makes of its row alone either
    way, and a bad row still stops it at its line."""
    monkeypatch.setattr(host_memory, "one_arena", lambda: one_arena)
    rows = [{"text": f"row {i} " + "the quick brown fox " * (i % 7), "prompt": f"Question {i}?", "completion": f" Answer {i}."}
            for i in range(40)]
    uri = _write_jsonl(tmp_path / "d.jsonl", rows)
    counting = _CountingTokenizer(tok)
    got = data.tokenize_file(uri, spec, counting)
    texts = len(rows) * (1 if spec.format == "text" else 2)
    assert (counting.batches, counting.texts) == ((0, texts) if one_arena else (1, 0))
    want = [data.tokenize_row(r, spec, tok, f"{uri} line {n}") for n, r in enumerate(rows, 1)]
    assert [(e.tokens.tolist(), e.loss_mask.tolist()) for e in got.examples] == [(e.tokens.tolist(), e.loss_mask.tolist()) for e in want]
    bad = _write_jsonl(tmp_path / "bad.jsonl", [*rows[:3], {"other": 1}, *rows[3:]])
    with pytest.raises(UserError, match=r"bad\.jsonl line 4: missing field"):
        data.tokenize_file(bad, spec, tok)
