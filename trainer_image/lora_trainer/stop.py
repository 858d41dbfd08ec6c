"""Stopping at a step boundary: SIGTERM (preemption, pod deletion) and Ctrl-C from a terminal
(`lora-trainer train` and `lora-operator run-local` handle it; in a pod none arrives).

A signal only sets a flag; the training loop checks it between steps and saves a checkpoint.
After SIGTERM it exits PREEMPTED (43), so the JobSet restarts the run, without counting it toward
maxRestarts, and it resumes from that step; after Ctrl-C with 130, and the same command resumes it.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from lora_trainer.errors import Interrupted, Preempted, TrainerError

log = logging.getLogger(__name__)


class StopRequest:
    """Set by SIGTERM (preemption, pod deletion), or by Ctrl-C when `interruptible` (the CLI and the local mode);
    checked at step boundaries by every process."""

    def __init__(self, *, interruptible: bool = False) -> None:
        self._event = threading.Event()
        self._interruptible = interruptible
        self.interrupted = False

    def _on_interrupt(self, *_: Any) -> None:
        """The first Ctrl-C stops at the next step boundary, once a checkpoint is saved (a Ctrl-C in
        the middle of a save printed dozens of tracebacks from Orbax's threads); a second one quits."""
        if self.interrupted:
            raise KeyboardInterrupt
        self.interrupted = True
        self._event.set()
        log.warning("interrupted: stopping after this step to save a checkpoint (Ctrl-C again to quit at once)")

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        if threading.current_thread() is not threading.main_thread():
            yield self  # signal handlers can only be set from the main thread (e.g. a test harness thread)
            return
        previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, lambda *_: self._event.set())}
        if self._interruptible:
            previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_interrupt)
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def error(self, step: int, root: str) -> TrainerError:
        """What stopping at `step` (its checkpoint committed, if any) is reported as."""
        if self.interrupted:
            if not step:
                return Interrupted("interrupted before the first step; nothing was saved")
            return Interrupted(f"interrupted: checkpoint step {step} is saved in {root}; run the same command again to resume from there")
        if not step:
            return Preempted("received SIGTERM before the first step; no checkpoint to save, exiting")
        return Preempted(
            f"received SIGTERM: checkpoint step {step} is saved in {root}; exiting so the JobSet "
            "restarts and the run resumes from there"
        )

    def requested(self) -> bool:
        """True on every process if any process got SIGTERM (so all stop at the same step)."""
        flag = self._event.is_set()
        if jax.process_count() == 1:
            return flag
        from jax.experimental import multihost_utils

        return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))
