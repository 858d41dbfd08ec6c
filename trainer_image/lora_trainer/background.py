"""Work begun on a daemon thread, its result or error handed back through a `Future`.

Daemon, because a process that stops early (an error, a preemption's exit 43) must not wait at
its exit for work no one needs any more, such as a minute-long compile. The `Future` raises the
work's error again in the thread that waits for it, where the caller maps errors to exit codes.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from typing import Any, TypeVar

T = TypeVar("T")


#: Work begun with `finish_first` and not yet done.
_unfinished: set[Future[Any]] = set()
_unfinished_lock = threading.Lock()


def in_background(work: Callable[[], T], name: str, *, finish_first: bool = False) -> Future[T]:
    """Run `work` on a new daemon thread named `name`; its outcome lands in the returned `Future`.

    `finish_first`: short work whose log line belongs before the process's last word (`settle`)."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            result = work()
        except BaseException as e:  # noqa: BLE001  (handed to the thread that waits on the future)
            future.set_exception(e)
        else:
            future.set_result(result)
        finally:
            with _unfinished_lock:
                _unfinished.discard(future)

    if finish_first:
        with _unfinished_lock:
            _unfinished.add(future)
    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def settle(timeout: float) -> None:
    """Wait up to `timeout` seconds in all for the `finish_first` work still running.

    Why: such work logs when it ends (a kept train step), and an error printed before it was not
    the last line on stderr, where users and tests look for it."""
    with _unfinished_lock:
        pending = list(_unfinished)
    wait(pending, timeout=timeout)


@contextlib.contextmanager
def prompt_handoffs(interval: float = 2e-4) -> Iterator[None]:
    """Threads hand the interpreter over every `interval` seconds inside, not every 5 ms.

    Why: a thread whose work is mostly native (file reads, copies, host-to-device transfers), each
    call letting go of the GIL, waits at every return for the thread that took it meanwhile; beside
    a thread tracing Python, that wait is the whole switch interval. Reading a base's weights beside
    such a thread took 2.1 s at 5 ms and 0.5 s at 0.2 ms, against 0.7 s alone (CPU host, an
    8-layer model). Only around overlapping start-up work: during training the default serves the
    step loop better (docs/benchmarks.md, "Restart and saves"). The thread that traces pays for it:
    on a v5e host a restart's trace of the 1B step took 6.5 s with the handoffs and the restore
    beside it, 3.0 s without either (which of the two costs more was not measured).
    """
    before = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    try:
        yield
    finally:
        sys.setswitchinterval(before)
