"""The trainer's log: `lora_trainer.*` loggers to stderr, one line per record, set up once per process.

Why its own module: `lora-trainer train` sets it up before it starts JAX's runtime on a thread
(`backend_start`), whose first act, joining a multi-host run, already logs; the training module
that used to set it up is imported only after that. Stdout carries only the JSON progress lines.
"""

from __future__ import annotations

import logging
import sys
from typing import Any


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever `sys.stderr` is at emit time (test harnesses and the local mode swap it)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def configure() -> None:
    """Trainer logs to stderr at INFO; idempotent."""
    logger = logging.getLogger("lora_trainer")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        logger.addHandler(_StderrHandler())
    logger.setLevel(logging.INFO)
    logger.propagate = False  # libraries (absl, Tunix) may configure the root logger; print once
