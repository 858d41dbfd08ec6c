"""Where a run's progress goes: stdout JSON lines, metrics.jsonl, TensorBoard, progress.json, a callback.

progress.json is the operator's channel (no Kubernetes rights for training pods): process 0
rewrites `<output>/progress.json` atomically every log interval, with exactly the fields
in docs/dev/contracts.md. Every process prints its line to stdout only if it is process 0,
so a multi-host job's logs are not multiplied.

On gs:// nothing can be appended to, so metrics.jsonl is rewritten (and TensorBoard event
files, written to a local directory, are uploaded) at each checkpoint and at the end; a run
killed in between repeats those steps after resuming anyway.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from lora_trainer import storage
from lora_trainer.progress_record import ProgressRecord, now_rfc3339

#: The record's fields that are also TensorBoard scalars (`train/<camelCase name>`).
_SCALARS = {"loss", "learning_rate", "tokens_per_second", "step_time_seconds", "mfu"}

ProgressCallback = Callable[[dict[str, Any]], None]


def format_eta(seconds: float) -> str:
    """Human ETA: `1h02m`, `4m05s`, `12s`."""
    s = max(0, int(round(seconds)))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    if h:
        return f"{h}h{m:02d}m"
    if m:
        return f"{m}m{sec:02d}s"
    return f"{sec}s"


def progress_record(
    *,
    step: int,
    total_steps: int,
    loss: float,
    learning_rate: float,
    tokens_per_second: float | None,
    step_time_seconds: float | None,
    mfu: float | None,
    last_checkpoint: str | None,
    pending_seconds: float = 0.0,
) -> dict[str, Any]:
    """The progress.json / stdout / callback record (contracts.md). Pure apart from the clock.

    Throughput fields are None for an interval with no timed step (only the step that compiled).
    The ETA is the steps left at this step time plus `pending_seconds` (the eval passes still due)."""
    eta = None if step_time_seconds is None else step_time_seconds * max(total_steps - step, 0) + pending_seconds
    return ProgressRecord(
        step=step,
        total_steps=total_steps,
        loss=_finite(loss),
        learning_rate=float(learning_rate),
        tokens_per_second=_float(tokens_per_second),
        step_time_seconds=_float(step_time_seconds),
        eta_seconds=_float(eta),
        eta=None if eta is None else format_eta(eta),
        mfu=_float(mfu),
        last_checkpoint=last_checkpoint,
        time=now_rfc3339(),
    ).to_wire()


def _float(x: float | None) -> float | None:
    return None if x is None else float(x)


def _finite(x: float) -> float | None:
    """JSON has no NaN: a diverged loss is reported as null."""
    x = float(x)
    return x if math.isfinite(x) else None


class IntervalTimer:
    """Training time of the current log interval: eval and checkpoint time is taken out.

    Without that, the interval after an eval or a save reported its duration as step time
    (tokens/s and MFU fell by orders of magnitude for one line and the ETA jumped).

    An interval can end at a time already past (`lap(at=...)`): the moment a step finished,
    seen after the next step was queued. A pause that ran on past that moment counts towards
    the next interval's pauses, not this one's.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._start = clock()
        self._pauses: list[tuple[float, float]] = []

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside does not count towards the interval."""
        start = self._clock()
        try:
            yield
        finally:
            self._pauses.append((start, self._clock()))

    def lap(self, at: float | None = None) -> float:
        """Seconds of training from the last lap (or the start) to `at` (default: now); starts the next interval there."""
        end = self._clock() if at is None else at
        paused = sum(max(0.0, min(stop, end) - max(start, self._start)) for start, stop in self._pauses)
        elapsed = end - self._start - paused
        self._start = end
        self._pauses = [(max(start, end), stop) for start, stop in self._pauses if stop > end]
        return elapsed


class ProgressSink:
    """Writes each record to every channel; only process 0 writes anything."""

    def __init__(
        self, output_uri: str, *, primary: bool, resume_step: int, on_progress: ProgressCallback | None = None
    ) -> None:
        self.primary = primary
        self._on_progress = on_progress
        self._progress_uri = storage.join(output_uri, "progress.json")
        self._metrics_uri = storage.join(output_uri, "metrics.jsonl")
        self._tb_uri = storage.join(output_uri, "tensorboard")
        self._gcs = storage.is_gcs(output_uri)
        self._lines: list[str] = []
        self._last: dict[str, Any] | None = None  # the record progress.json holds
        self._tb: Any = None
        self._tb_tmp: tempfile.TemporaryDirectory[str] | None = None
        if primary:
            self._lines = _lines_up_to(self._metrics_uri, resume_step)
            if not self._gcs:
                path = storage.local_path(self._metrics_uri)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text("".join(line + "\n" for line in self._lines))  # drop steps a resume redoes
            self._open_tensorboard()

    def _open_tensorboard(self) -> None:
        from tensorboardX import SummaryWriter

        if self._gcs:
            self._tb_tmp = tempfile.TemporaryDirectory(prefix="lora-tb-")
            logdir = self._tb_tmp.name
        else:
            logdir = str(storage.local_path(self._tb_uri))
        self._tb = SummaryWriter(logdir=logdir)

    def emit(self, record: dict[str, Any], *, extra_scalars: dict[str, float] | None = None) -> None:
        """One log interval: stdout line, metrics.jsonl line, TensorBoard scalars, progress.json, callback."""
        if not self.primary:
            return
        line = json.dumps(record, sort_keys=False)
        print(line, file=sys.stdout, flush=True)
        self._lines.append(line)
        if not self._gcs:
            with storage.local_path(self._metrics_uri).open("a") as f:
                f.write(line + "\n")
        typed = ProgressRecord.parse(record)
        scalars = typed.model_dump(by_alias=True, include=_SCALARS)
        for name, value in {**scalars, **(extra_scalars or {})}.items():
            if value is not None:
                self._tb.add_scalar(f"train/{name}", value, typed.step)
        self._publish(record)

    def checkpointed(self, uri: str) -> None:
        """A checkpoint committed: progress.json and the callback name it now, not at the next interval.

        The record of a step is written before that step's checkpoint is saved, so without this
        the final (or SIGTERM) checkpoint would never reach `status.lastCheckpoint`.
        """
        if not self.primary or self._last is None:
            return
        self._publish(ProgressRecord.parse(self._last).with_checkpoint(uri).to_wire())

    def _publish(self, record: dict[str, Any]) -> None:
        """The operator's channel (progress.json, rewritten whole) and the callback get `record`."""
        storage.write_text(self._progress_uri, json.dumps(record, indent=2) + "\n")
        self._last = record
        if self._on_progress is not None:
            self._on_progress(dict(record))

    def scalar(self, name: str, value: float, step: int) -> None:
        """An extra TensorBoard scalar (e.g. eval loss), also as a metrics.jsonl line."""
        if not self.primary:
            return
        line = json.dumps({"step": step, name: value, "time": now_rfc3339()})
        self._lines.append(line)
        if not self._gcs:
            with storage.local_path(self._metrics_uri).open("a") as f:
                f.write(line + "\n")
        self._tb.add_scalar(name, value, step)

    def flush(self) -> None:
        """Make metrics.jsonl and TensorBoard durable at the output (called at checkpoints and the end)."""
        if not self.primary:
            return
        self._tb.flush()
        if self._gcs:
            storage.write_text(self._metrics_uri, "".join(line + "\n" for line in self._lines))
            assert self._tb_tmp is not None
            storage.upload_dir(self._tb_tmp.name, self._tb_uri)

    def close(self, *, flush: bool = True) -> None:
        """Flush (unless `flush` is False, after a fault) and release the TensorBoard writer."""
        if not self.primary:
            return
        if flush:
            self.flush()
        self._tb.close()
        if self._tb_tmp is not None:
            self._tb_tmp.cleanup()


def _lines_up_to(uri: str, step: int) -> list[str]:
    """Existing metrics lines of steps <= `step` (a resumed run redoes the later ones)."""
    if not storage.exists(uri):
        return []
    kept = []
    for line in storage.read_text(uri).splitlines():
        try:
            if int(json.loads(line).get("step", 0)) <= step:
                kept.append(line)
        except (ValueError, AttributeError):
            continue
    return kept

