"""Training data: JSONL/Parquet rows -> tokenized, loss-masked, (packed) batches with a resumable position.

Why the stream is defined globally: each process tokenizes its share of the rows (every
process-count-th row, `Share`), the processes pool what they tokenized, and every process
then holds the same list of sequences, orders them by a seeded permutation per epoch, and
cuts the endless stream into global batches; each process places on its devices the rows
the mesh gives them (`tunix_trainer.on_mesh`). So the data a step sees does not depend on
how many hosts run it or how the mesh is laid out (a two-process run and a one-process run
train on identical batches), the iterator's whole position is one integer, `batches`, that
the checkpoint stores and a restarted run continues from, and tokenizing, the slow part of
loading data (a millisecond a row, minutes for a large file at every start or restart), is
split across the hosts instead of repeated on each.

Formats follow TRL's field names (`text`; `prompt`/`completion`; `messages`), configurable
in `DatasetSpec`. The loss mask is 1 only on tokens the model should learn to produce:
every token for `text`, the completion for `prompt-completion`, assistant turns for `chat`.
"""

from __future__ import annotations

import codecs
import io
import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lora_trainer import host_memory, storage
from lora_trainer.config import DatasetSpec
from lora_trainer.errors import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Example:
    """One tokenized example: token ids and a same-length 0/1 mask of tokens that carry loss."""

    tokens: np.ndarray
    loss_mask: np.ndarray


@dataclass(frozen=True)
class Sequence:
    """One row of a batch (one example, or several packed): ids, loss mask, segment ids, positions."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray

    def loss_targets(self) -> int:
        """Tokens the loss predicts, as `loss.lm_loss` weights them: in the loss mask, and predicted
        by a token of the same packed example."""
        return int(((self.loss_mask[1:] > 0) & (self.segment_ids[1:] == self.segment_ids[:-1])).sum())


# --------------------------------------------------------------------------- tokenizer


def load_tokenizer(model_dir: Path) -> Any:
    """The tokenizer stored with the base model, from local files only (never a model hub).

    `model_dir` is the local copy of the model (`models.load_model` downloads gs:// sources).
    """
    from transformers import AutoTokenizer

    if not model_dir.is_dir():
        raise UserError(f"model directory {model_dir} is not a directory: point model.source at an HF checkpoint directory")
    files = ("tokenizer.json", "tokenizer.model", "vocab.json")
    if not any((model_dir / f).is_file() for f in files):
        raise UserError(
            f"the model directory {model_dir} holds no tokenizer ({', '.join(files)}); copy in the tokenizer files "
            "that `save_pretrained` writes with the model (tokenizer.json, tokenizer_config.json)"
        )
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # transformers raises many types for damaged files (KeyError, TypeError, ...)
        raise UserError(
            f"cannot load the tokenizer from the model directory {model_dir} ({' '.join(str(e).split())}); the "
            "directory must hold the tokenizer files that `save_pretrained` writes (tokenizer.json, tokenizer_config.json)"
        ) from e


def padding_id(tokenizer: Any) -> int:
    """The id that pads batches: the tokenizer's pad token, else its end-of-sequence token, else 0."""
    return next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)


# --------------------------------------------------------------------------- rows


def _raw_rows(uri: str, data: bytes) -> list[tuple[int, str | dict[str, Any]]]:
    """(line or row number, row) of a JSONL or Parquet file's `data`, the number 1-based for
    messages: a JSONL line still unparsed (each process parses only the lines of its share,
    `_parsed`), a Parquet row as a dict."""
    name = uri.rstrip("/").rsplit("/", 1)[-1].lower()
    if name.endswith((".jsonl", ".json")):
        rows: list[tuple[int, str | dict[str, Any]]] = []
        # Split on newlines only: str.splitlines would also split inside strings at U+2028, U+0085, ...
        for n, raw in enumerate(data.removeprefix(codecs.BOM_UTF8).split(b"\n"), start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(
                    f"{uri} line {n}: not valid UTF-8 (byte {e.start + 1} of the line); save the file as UTF-8"
                ) from e
            if line.strip():
                rows.append((n, line))
        return rows
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(io.BytesIO(data))
        except Exception as e:  # pyarrow raises several unrelated types for corrupt files
            raise UserError(f"{uri} is not a readable Parquet file ({e})") from e
        return list(enumerate(table.to_pylist(), start=1))
    raise UserError(f"{uri}: unknown dataset file type; use a .jsonl (one JSON object per line) or a .parquet file")


def _parsed(uri: str, n: int, row: str | dict[str, Any]) -> dict[str, Any]:
    """A row from `_raw_rows` as a dict: a JSONL line parsed, a Parquet row as it is."""
    if isinstance(row, dict):
        return row
    try:
        value = json.loads(row)
    except json.JSONDecodeError as e:
        raise UserError(f"{uri} line {n}: not valid JSON ({e.msg}); every line must be one JSON object") from e
    if not isinstance(value, dict):
        raise UserError(f"{uri} line {n}: expected a JSON object, got {type(value).__name__}")
    return value


def _field(row: dict[str, Any], field: str, setting: str, where: str, kind: type) -> Any:
    if field not in row:
        raise UserError(
            f"{where}: missing field {field!r} (set by dataset.{setting}); the row has {sorted(row)}. "
            f"Rename the field in the data or set dataset.{setting}"
        )
    value = row[field]
    if not isinstance(value, kind):
        raise UserError(f"{where}: field {field!r} must be a {kind.__name__}, got {type(value).__name__}")
    return value


# --------------------------------------------------------------------------- tokenization


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _with_specials(tokenizer: Any, ids: list[int], mask: list[int]) -> tuple[list[int], list[int]]:
    """BOS in front (no loss) and EOS at the end (loss, so the model learns to stop), when the tokenizer has them."""
    if tokenizer.bos_token_id is not None and (not ids or ids[0] != tokenizer.bos_token_id):
        ids, mask = [tokenizer.bos_token_id, *ids], [0, *mask]
    if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
        ids, mask = [*ids, tokenizer.eos_token_id], [*mask, 1]
    return ids, mask


def _chat_example(tokenizer: Any, messages: list[Any], where: str, field: str) -> tuple[list[int], list[int]]:
    """Render with the tokenizer's chat template; loss on the assistant turns only."""
    from jinja2 import TemplateError

    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise UserError(f"{where}: field {field!r} item {i} must be an object with string `role` and `content`")
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: field {field!r} has no assistant message, so nothing would be learned from it")
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise UserError(
            "dataset.format is `chat` but the model's tokenizer has no chat template: use a model directory whose "
            "tokenizer_config.json has `chat_template`, or convert the data to prompt-completion"
        )
    try:
        if re.search(r"{%-?\s*generation\s*-?%}", template):
            out = tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            return list(out["input_ids"]), [int(x) for x in out["assistant_masks"]]
        return _assistant_mask_by_render(tokenizer, messages, where)
    except TemplateError as e:  # the template's own checks, e.g. Gemma's "roles must alternate"
        raise UserError(f"{where}: the model's chat template rejects field {field!r}: {e}") from e


def _assistant_mask_by_render(tokenizer: Any, messages: list[dict[str, str]], where: str) -> tuple[list[int], list[int]]:
    """Assistant tokens of a template without {% generation %} markers, located in the rendered text.

    A reply starts where the render of the turns before it, plus the generation prompt, ends
    (that render must be a prefix of the whole conversation's) and runs through its content and
    the end-of-turn text that follows it in both the whole render and the render that stops after
    it (whitespace after that text is the template's, never generated, so it carries no loss).
    Text, not tokens, is compared: templates such as Qwen3's render the last reply differently
    (an empty `<think>` block) from earlier ones, so a render that stops after an earlier reply is
    no prefix of the whole, but each reply's content is still found in place.
    """
    render = lambda msgs, gen: tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)  # noqa: E731
    full = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(messages[:i], True)
        reply = m["content"].strip()
        at = full.find(reply, len(before)) if full.startswith(before) else -1
        if at < 0:
            raise UserError(
                f"{where}: cannot find assistant turn {i} in the chat template's rendering of the conversation (the "
                "template rewrites it or renders earlier turns differently once later turns are added); use a model "
                "directory whose chat template marks replies with {% generation %} ... {% endgeneration %}"
            )
        end = at + len(reply)
        alone = render(messages[: i + 1], False)
        tail = alone[alone.rfind(reply) + len(reply) :] if reply else alone[len(before) :]
        end += len(os.path.commonprefix([full[end:], tail]).rstrip())  # the end-of-turn token, not the newline after it
        spans.append((len(before), end))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a <= start < b for a, b in spans)) for start, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def tokenize_row(row: dict[str, Any], spec: DatasetSpec, tokenizer: Any, where: str) -> Example:
    """One row -> Example (not yet truncated). `where` names the file and line in errors."""
    if spec.format == "text":
        text = _ids(tokenizer, _field(row, spec.text_field, "textField", where, str))
        ids, mask = _with_specials(tokenizer, text, [1] * len(text))
    elif spec.format == "prompt-completion":
        for setting, name in (("promptField", spec.prompt_field), ("completionField", spec.completion_field)):
            if isinstance(row.get(name), list):
                raise UserError(
                    f"{where}: field {name!r} (dataset.{setting}) is a list of messages; conversational "
                    "prompt-completion rows are not supported: join prompt and completion into one `messages` "
                    "list and set dataset.format: chat"
                )
        prompt = _ids(tokenizer, _field(row, spec.prompt_field, "promptField", where, str))
        completion = _ids(tokenizer, _field(row, spec.completion_field, "completionField", where, str))
        ids, mask = _with_specials(tokenizer, prompt + completion, [0] * len(prompt) + [1] * len(completion))
    else:
        ids, mask = _chat_example(tokenizer, _field(row, spec.messages_field, "messagesField", where, list), where, spec.messages_field)
    return Example(np.asarray(ids, np.int32), np.asarray(mask, np.int32))


@dataclass(frozen=True)
class TokenizedDataset:
    """Every usable example of a file, truncated, plus what was dropped (for the log and the fingerprint)."""

    examples: list[Example]
    truncated: int
    skipped: int


def _alone(blob: bytes) -> list[bytes]:
    return [blob]


@dataclass(frozen=True)
class Share:
    """Which rows this process tokenizes, and how the processes pool what they tokenized.

    Rows go round-robin, row i to process i mod `count`, so long and short rows spread
    evenly however the file is sorted. `allgather` returns every process's bytes in process
    order (`distributed.allgather_bytes` in a multi-host run); the default is one process.
    """

    index: int = 0
    count: int = 1
    allgather: Callable[[bytes], list[bytes]] = _alone


@dataclass(frozen=True)
class _Part:
    """What one process made of its share: kept examples with their row ordinals, the counts,
    and the first bad row's (ordinal, message) if one stopped it."""

    rows: list[int]
    examples: list[Example]
    truncated: int
    skipped: int
    error: tuple[int, str] | None


class _BatchEncoded:
    """`tokenizer`, answering `tokenizer(text, add_special_tokens=False)` for texts encoded beforehand in one batch.

    Why: called once per row, a fast tokenizer encodes on one core; given a batch it encodes on
    every core. Tokenizing is on every restart's path (a 12,000-row text file took 8.2 s of a TPU
    run's 60 s restart, docs/benchmarks.md). On a 2-core machine that file's encoding went from
    4.0 s to 2.3 s, the whole `tokenize_file` from 3.7 s to 2.9 s; a TPU host has 13 or more cores.
    The ids are the same: a batch is encoded text by text. Anything else (other texts, other
    options, the chat template) goes to the tokenizer as before. Not in a process whose threads
    share one malloc arena (`host_memory`, CPU training): there the encoding threads queue for
    its lock, and the batch took 6.6 s where text by text took 3.5 s (2 cores).
    """

    def __init__(self, tokenizer: Any, texts: list[str]) -> None:
        unique = [] if host_memory.one_arena() else list(dict.fromkeys(texts))
        encoded = tokenizer(unique, add_special_tokens=False)["input_ids"] if unique else []
        self._ids = dict(zip(unique, encoded, strict=True))
        self._tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __call__(self, text: Any, add_special_tokens: bool = True, **kwargs: Any) -> Any:
        if not add_special_tokens and not kwargs and isinstance(text, str) and text in self._ids:
            return {"input_ids": self._ids[text]}
        return self._tokenizer(text, add_special_tokens=add_special_tokens, **kwargs)


def _texts(parsed: list[tuple[int, dict[str, Any]]], spec: DatasetSpec) -> list[str]:
    """The strings `tokenize_row` will encode one by one (text and prompt-completion rows); a field
    that is not a string is left for `tokenize_row` to report, in file order."""
    fields = {"text": (spec.text_field,), "prompt-completion": (spec.prompt_field, spec.completion_field)}.get(spec.format, ())
    return [row[f] for _, row in parsed for f in fields if isinstance(row.get(f), str)]


def _tokenize_share(rows: list[tuple[int, str | dict[str, Any]]], uri: str, spec: DatasetSpec, tokenizer: Any, share: Share) -> _Part:
    kept, examples, truncated, skipped = [], [], 0, 0
    parsed, unparsable = [], None  # the share's rows up to the first that is not a JSON object, parsed once
    for i in range(share.index, len(rows), share.count):
        n, raw = rows[i]
        try:
            parsed.append((i, _parsed(uri, n, raw)))
        except UserError as e:
            unparsable = (i, str(e))
            break
    tokenizer = _BatchEncoded(tokenizer, _texts(parsed, spec))
    for i, row in parsed:
        try:
            ex = tokenize_row(row, spec, tokenizer, f"{uri} line {rows[i][0]}")
        except UserError as e:  # this share's first bad row; an earlier one may be in another share
            return _Part(kept, examples, truncated, skipped, (i, str(e)))
        if len(ex.tokens) > spec.max_seq_len:
            truncated += 1
            ex = Example(ex.tokens[: spec.max_seq_len], ex.loss_mask[: spec.max_seq_len])
        if ex.loss_mask[1:].sum() == 0:  # the first token is never a target
            skipped += 1
            continue
        kept.append(i)
        examples.append(ex)
    return _Part(kept, examples, truncated, skipped, unparsable)


def example_arrays(examples: list[Example]) -> dict[str, np.ndarray]:
    """Examples as flat arrays, nothing pickled: their lengths, then their tokens and loss masks laid
    end to end. How shares travel between processes (`_encode`) and how `token_cache` keeps them."""
    return {
        "lengths": np.asarray([len(e.tokens) for e in examples], np.int64),
        "tokens": np.concatenate([e.tokens for e in examples]).astype(np.int32) if examples else np.empty(0, np.int32),
        "loss_mask": np.concatenate([e.loss_mask for e in examples]).astype(np.uint8) if examples else np.empty(0, np.uint8),
    }


def examples_from_arrays(lengths: np.ndarray, tokens: np.ndarray, loss_mask: np.ndarray) -> list[Example]:
    """`example_arrays`' examples again; ValueError where the arrays do not agree (a damaged copy)."""
    if int(lengths.sum()) != len(tokens) or len(tokens) != len(loss_mask):
        raise ValueError("the example arrays do not agree")
    if not len(lengths):
        return []
    cuts = np.cumsum(lengths)[:-1]
    return [Example(t, m.astype(np.int32)) for t, m in zip(np.split(tokens, cuts), np.split(loss_mask, cuts), strict=True)]


def _encode(part: _Part) -> bytes:
    """A part as an .npz (arrays only, nothing pickled), to send to the other processes."""
    buf = io.BytesIO()
    row, message = part.error or (-1, "")
    np.savez(
        buf,
        rows=np.asarray(part.rows, np.int64),
        counts=np.asarray([part.truncated, part.skipped, row], np.int64),
        error=np.frombuffer(message.encode(), np.uint8),
        **example_arrays(part.examples),
    )
    return buf.getvalue()


def _decode(blob: bytes) -> _Part:
    z = np.load(io.BytesIO(blob), allow_pickle=False)
    truncated, skipped, row = (int(x) for x in z["counts"])
    error = (row, z["error"].tobytes().decode()) if row >= 0 else None
    examples = examples_from_arrays(z["lengths"], z["tokens"], z["loss_mask"])
    return _Part(z["rows"].tolist(), examples, truncated, skipped, error)


def tokenize_file(uri: str, spec: DatasetSpec, tokenizer: Any, share: Share = Share(), *, raw: bytes | None = None) -> TokenizedDataset:
    """Read a file (or take its bytes, `raw`), parse and tokenize this process's share of its rows
    and pool the shares; truncate to maxSeqLen; drop examples left with no loss tokens.

    Every process returns the same dataset, in file order, and raises the same error (the
    earliest bad row in the file, as one process tokenizing everything would): the shares
    are pooled before anything is raised, so no process waits for one that already gave up.
    """
    rows = _raw_rows(uri, storage.read_bytes(uri) if raw is None else raw)
    if not rows:
        raise UserError(f"{uri} holds no rows: add training examples")
    mine = _tokenize_share(rows, uri, spec, tokenizer, share)
    parts = [_decode(blob) for blob in share.allgather(_encode(mine))]
    errors = [p.error for p in parts if p.error is not None]
    if errors:
        raise UserError(min(errors)[1])
    order = sorted((row, k, j) for k, p in enumerate(parts) for j, row in enumerate(p.rows))
    examples = [parts[k].examples[j] for _, k, j in order]
    truncated, skipped = sum(p.truncated for p in parts), sum(p.skipped for p in parts)
    log.info(
        "%s: %d examples, %d truncated to maxSeqLen=%d%s", uri, len(rows), truncated, spec.max_seq_len,
        f" (this process tokenized {len(range(share.index, len(rows), share.count))} of them, process {share.index} of "
        f"{share.count})" if share.count > 1 else "",
    )  # fmt: skip
    if skipped:
        log.warning("%s: skipped %d examples with no loss tokens left after truncation", uri, skipped)
    if not examples:
        raise UserError(
            f"{uri}: no example has a completion/assistant token within dataset.maxSeqLen={spec.max_seq_len}; "
            "raise maxSeqLen or shorten the prompts"
        )
    return TokenizedDataset(examples, truncated, skipped)


# --------------------------------------------------------------------------- sequences


def _single(ex: Example) -> Sequence:
    n = len(ex.tokens)
    return Sequence(ex.tokens, ex.loss_mask, np.ones(n, np.int32), np.arange(n, dtype=np.int32))


def pack(examples: list[Example], max_seq_len: int) -> list[Sequence]:
    """Greedy first-fit packing in file order; each example keeps its own segment id and positions.

    First fit finds the first bin with room through a max-tree over the bins' free room
    (O(log bins) per example): scanning the bins is quadratic, an hour for 500k examples.
    """
    size = 1 << max(len(examples) - 1, 0).bit_length()  # leaves >= examples >= bins
    room = [-1] * (2 * size)  # leaves: each bin's free room (-1: no bin yet); inner nodes: max of children
    bins: list[list[Example]] = []
    for ex in examples:
        n = len(ex.tokens)
        if room[1] >= n:
            node = 1
            while node < size:
                node = 2 * node if room[2 * node] >= n else 2 * node + 1
            bins[node - size].append(ex)
            room[node] -= n
        else:
            node = size + len(bins)
            bins.append([ex])
            room[node] = max_seq_len - n
        while node > 1:
            node //= 2
            room[node] = max(room[2 * node], room[2 * node + 1])
    out = []
    for group in bins:
        out.append(
            Sequence(
                np.concatenate([e.tokens for e in group]),
                np.concatenate([e.loss_mask for e in group]),
                np.concatenate([np.full(len(e.tokens), i + 1, np.int32) for i, e in enumerate(group)]),
                np.concatenate([np.arange(len(e.tokens), dtype=np.int32) for e in group]),
            )
        )
    return out


def to_sequences(data: TokenizedDataset, spec: DatasetSpec) -> list[Sequence]:
    """One sequence per example, or packed sequences when dataset.packing is on."""
    return pack(data.examples, spec.max_seq_len) if spec.packing else [_single(e) for e in data.examples]


def collate(seqs: list[Sequence], rows: int, length: int, pad_id: int) -> dict[str, np.ndarray]:
    """A [rows, length] batch, right-padded; segment id 0 marks padding (no attention, no loss)."""
    b = rows
    batch = {
        "input_tokens": np.full((b, length), pad_id, np.int32),
        "input_mask": np.zeros((b, length), np.int32),
        "segment_ids": np.zeros((b, length), np.int32),
        "positions": np.zeros((b, length), np.int32),
    }
    for i, s in enumerate(seqs):
        n = len(s.tokens)
        batch["input_tokens"][i, :n] = s.tokens
        batch["input_mask"][i, :n] = s.loss_mask
        batch["segment_ids"][i, :n] = s.segment_ids
        batch["positions"][i, :n] = s.positions
    return batch


# --------------------------------------------------------------------------- the stream


class BatchStream:
    """Endless, seeded, resumable stream of global (micro-)batches.

    Every host makes the whole global batch (every host holds every sequence), and
    `tunix_trainer.on_mesh` puts on each host's devices the rows they hold, however the mesh lays them
    out: a fixed share per host went wrong wherever the mesh did not split rows across hosts
    (tensor parallelism spanning hosts), each host then feeding its share as the whole batch.

    Batch k holds stream items [k*B, (k+1)*B) where the stream is the concatenation of
    per-epoch permutations (seeded by (seed, epoch)) of the sequences. Position = batches
    consumed; `state()` / `restore()` round-trip it through the checkpoint.

    Each batch carries `loss_norm`: the loss targets of its whole optimizer step (all
    `accumulation` micro-batches, all hosts; every host holds every sequence) divided by
    `accumulation`. Tunix averages the micro-batches' gradients, so each micro-batch's summed
    loss over that norm makes the step's gradient the token-weighted mean over the step, as
    one batch of globalBatchSize rows gives; a per-micro-batch mean weighted short and long
    completions differently (22% off the full batch's gradient in an audit).
    """

    def __init__(
        self,
        sequences: list[Sequence],
        *,
        global_batch: int,
        seq_len: int,
        seed: int,
        pad_id: int,
        accumulation: int = 1,
    ) -> None:
        self._seqs = sequences
        self._global_batch = global_batch
        self._seq_len = seq_len
        self._seed = seed
        self._pad_id = pad_id
        self._batches = 0
        self._perm_epoch = -1
        self._perm = np.empty(0, np.int64)
        self._accumulation = accumulation
        self._targets = np.array([s.loss_targets() for s in sequences], np.int64)
        self._norm_step, self._norm = -1, 1.0

    def fingerprint(self) -> dict[str, int]:
        """What must match for a saved position to mean the same data on resume."""
        tokens = sum(int(s.tokens.size) for s in self._seqs)
        return {"sequences": len(self._seqs), "tokens": tokens, "seed": self._seed, "globalBatch": self._global_batch}

    def state(self) -> dict[str, Any]:
        """JSON-serialisable position (stored as the checkpoint's `data` item)."""
        return {"batches": self._batches, **self.fingerprint()}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue after the batches a checkpoint says were consumed (warn if the data changed)."""
        if {k: state.get(k) for k in self.fingerprint()} != self.fingerprint():
            log.warning(
                "the training data differs from the checkpointed run's (%s vs %s); continuing at batch %d of the new data",
                {k: state.get(k) for k in self.fingerprint()},
                self.fingerprint(),
                state["batches"],
            )
        self._batches = int(state["batches"])

    def _index(self, j: int) -> int:
        """The sequence at stream position j."""
        epoch, pos = divmod(j, len(self._seqs))
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self._seed, epoch]).permutation(len(self._seqs))
            self._perm_epoch = epoch
        return int(self._perm[pos])

    def _item(self, j: int) -> Sequence:
        return self._seqs[self._index(j)]

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def _loss_norm(self) -> float:
        """Loss targets of the current optimizer step's batch, per micro-batch."""
        step = self._batches // self._accumulation
        if step != self._norm_step:
            first = step * self._accumulation * self._global_batch
            items = range(first, first + self._accumulation * self._global_batch)
            total = sum(int(self._targets[self._index(j)]) for j in items)
            self._norm_step, self._norm = step, max(total, 1) / self._accumulation
        return self._norm

    def peek(self) -> dict[str, np.ndarray]:
        """The next batch, left in the stream: its shapes compile the train step ahead of the first."""
        position = self._batches
        try:
            return next(self)
        finally:
            self._batches = position

    def __next__(self) -> dict[str, np.ndarray]:
        start = self._batches * self._global_batch
        norm = self._loss_norm()
        seqs = [self._item(j) for j in range(start, start + self._global_batch)]
        self._batches += 1
        batch = collate(seqs, self._global_batch, self._seq_len, self._pad_id)
        batch["loss_norm"] = np.full(self._global_batch, norm, np.float32)
        return batch


def eval_batches(
    sequences: list[Sequence], *, global_batch: int, seq_len: int, pad_id: int
) -> list[dict[str, np.ndarray]]:
    """One pass over the eval set in file order, whole batches as `BatchStream`'s; the last is filled
    up with padding rows."""
    return [collate(sequences[start : start + global_batch], global_batch, seq_len, pad_id) for start in range(0, len(sequences), global_batch)]
