"""The run's checkpoints, saved without stopping training.

Why a thread: Orbax's async save still does its synchronous part on the caller's thread (waiting
for the previous save's commit, then copying every array to the host) before it returns; on a
v5e chip that blocked the loop 1.5 s per checkpoint against a 1.3 s step (issue 21). So a save
here only copies the arrays *on the device* (the next step donates the model's own buffers) and
hands `store.save` to one background thread just before the next step is dispatched: Tunix's
`train()` waits for its step, so the loop's host work between steps leaves the chip idle, and
Orbax's Python work (hundreds of arrays to describe, under the GIL) must run while the main
thread waits on the chip, not between steps. The device-to-host copy and the commit overlap the
next steps.

Why the thread copies to the host itself before calling Orbax: given device arrays, Orbax's save
still slowed the step it overlapped by 0.4 s (3B widths, 8 layers, 339 arrays; +3.1 s on a whole
3B run), the same with a 0.1 ms GIL switch interval; given host arrays from one batched
`jax.device_get`, by 0.02 s (docs/benchmarks.md, "TPU"). Arrays a process does not wholly hold
(a multi-host run's sharded state) stay device arrays: Orbax writes each process's shards.

What does not change: only committed checkpoints are reported (`committed`, progress.json's
lastCheckpoint), and `finish` (the last step, SIGTERM, Ctrl-C) saves and waits for the commit,
so a stopped run still leaves its final step committed. A save that failed in the background
raises its own error (a storage fault keeps its class) at the next look.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax

from lora_trainer import checkpoint, data, tunix_trainer
from lora_trainer.lora import lora_variables, read_lora
from lora_trainer.progress import ProgressSink

log = logging.getLogger(__name__)


def _each_array(tree: Any, take: Any, transform: Any) -> Any:
    """`tree` with its arrays that `take` accepts replaced by `transform` of them all at once (one
    program or one transfer, never one per array)."""
    leaves, treedef = jax.tree.flatten(tree)
    where = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and take(x)]
    for i, new in zip(where, transform([leaves[i] for i in where]), strict=True):
        leaves[i] = new
    return jax.tree.unflatten(treedef, leaves)


def _device_copy(tree: Any) -> Any:
    """A copy of every array on its own devices, enqueued before the next step donates the
    originals: one batched transfer (not one dispatch per array: a 1B model's adapter and optimizer
    state are ~700 arrays), and no program. A jitted copy took 3.2-3.6 s to compile at each
    process's first save on a v5e chip; the transfer dispatches 700 arrays in 0.03-0.05 s. Each
    array's own sharding is named: a multi-host array has devices of other processes too."""
    return _each_array(tree, lambda x: True, lambda xs: jax.device_put(xs, [x.sharding for x in xs], may_alias=False))


def _on_host(snapshot: dict[str, Any]) -> dict[str, Any]:
    """`snapshot` with every array this process wholly holds copied to the host in one batched transfer."""
    return _each_array(snapshot, lambda x: x.is_fully_addressable, jax.device_get)


class AsyncSaves:
    """Checkpoints of one run: `start` snapshots a step, `poll` hands it off and announces commits, `finish` waits for all.
    Used as a context manager, so a failed run leaves no save queued."""

    def __init__(self, root: str, store: checkpoint.TrainingCheckpoints, sink: ProgressSink,
                 trainer: tunix_trainer.LoraPeftTrainer, stream: data.BatchStream, metadata: dict[str, Any], step: int) -> None:
        self.root, self.store, self.sink, self.trainer, self.stream, self.metadata = root, store, sink, trainer, stream, metadata
        self.started = step  # the newest step saved (or resumed from)
        self.committed = checkpoint.step_uri(root, step) if step else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-save")
        self._handoff: Future[None] | None = None  # `store.save` running on the thread
        self._pending: list[int] = []  # steps handed off and not yet announced, oldest first
        # `store.save`'s arguments not yet handed off, with what taking them cost the loop (flushing metrics, copying on the device)
        self._snapshot: tuple[dict[str, Any], tuple[float, float]] | None = None
        # The state's variables, found at the first save, after the first step placed the optimizer
        # (`LoraPeftTrainer._shard_optimizer`). Finding them walks the whole model graph, and training
        # waits for the snapshot: on CPU a 16-layer model's state read in 39 ms so, 4 ms through them.
        self._variables: tuple[Any, Any] | None = None

    def start(self, step: int) -> None:
        """Begin saving `step`: copy its state on the devices; the next `poll` hands it off.

        Metrics and TensorBoard up to `step` are made durable first, not when the commit is seen: the
        commit lands in the background, and a run that dies after it but before its next look would
        otherwise resume past metrics lines never written (a resume drops lines beyond its step).
        """
        start = time.perf_counter()
        self.sink.flush()
        flushed = time.perf_counter()
        if self._variables is None:
            self._variables = lora_variables(self.trainer.model), tunix_trainer.optimizer_variables(self.trainer)
        lora, optimizer = self._variables
        snapshot = {"step": step, "lora": _device_copy(read_lora(lora)),
                    "optimizer": _device_copy(tunix_trainer.read_optimizer(optimizer)),
                    "data": self.stream.state(), "metadata": self.metadata}
        self._snapshot = snapshot, (flushed - start, time.perf_counter() - flushed)
        self.started = step

    def poll(self) -> None:
        """Hand off a snapshot (call it just before the next step), and announce the saves that
        have committed since the last look; waits only for a previous handoff still running."""
        self._hand_off()
        if self._handoff is not None and not self._handoff.done():
            return
        self._settle()
        if self._pending and not self.store.saving():
            self.store.wait()  # returns at once: raises the error of a commit that failed in the background
            self._announce(self._pending[-1])

    def finish(self, step: int) -> None:
        """Save `step` unless it is saved already, and wait until every save has committed."""
        if self.started != step:
            self.start(step)
        self._hand_off()
        self._settle()
        if self._pending:
            self.store.wait()
            self._announce(self._pending[-1])
        self._executor.shutdown()

    def __enter__(self) -> AsyncSaves:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        """On an error, start no queued save (one already running ends on its own); `finish` ends a run that did not fail."""
        if kind is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _hand_off(self) -> None:
        """Give the snapshot, if any, to the save thread, one handoff at a time (a checkpoint interval
        is far longer than a handoff, so the wait for the previous one is nil in practice)."""
        taken, self._snapshot = self._snapshot, None
        if taken is None:
            return
        self._settle()
        self._handoff = self._executor.submit(self._save, *taken)
        self._pending.append(taken[0]["step"])

    def _save(self, snapshot: dict[str, Any], snapshot_seconds: tuple[float, float]) -> None:
        """On the save thread: the host copy, then Orbax's save (its commit goes on in the background).
        Both are timed in the log: they overlap the next step, which a slow one would stretch; so is
        what `start` cost the loop (`snapshot_seconds`), which the step times do not count."""
        start = time.perf_counter()
        on_host = _on_host(snapshot)
        copied = time.perf_counter()
        self.store.save(**on_host)
        log.info("checkpoint step %d: metrics flushed in %.2fs and state copied on the device in %.2fs (training waited), "
                 "then copied to the host in %.2fs and handed to Orbax in %.2fs (committing in the background)",
                 snapshot["step"], *snapshot_seconds, copied - start, time.perf_counter() - copied)

    def _settle(self) -> None:
        """Wait for the handoff in flight, raising its error. Orbax's save first waits for the previous
        save's commit, so every step handed off before the last one has committed."""
        if self._handoff is None:
            return
        handoff, self._handoff = self._handoff, None
        handoff.result()
        for step in self._pending[:-1]:
            self._announce(step)

    def _announce(self, step: int) -> None:
        """Checkpoint `step` (and every one before it) has committed: progress.json names it."""
        self._pending = [s for s in self._pending if s > step]
        self.committed = checkpoint.step_uri(self.root, step)
        self.sink.checkpointed(self.committed)
