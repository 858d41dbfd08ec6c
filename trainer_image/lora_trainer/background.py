"""Work begun on a daemon thread, its result or error handed back through a `Future`.

Daemon, because a process that stops early (an error, a preemption's exit 43) must not wait at
its exit for work no one needs any more, such as a minute-long compile. The `Future` raises the
work's error again in the thread that waits for it, where the caller maps errors to exit codes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


def in_background(work: Callable[[], T], name: str) -> Future[T]:
    """Run `work` on a new daemon thread named `name`; its outcome lands in the returned `Future`."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            result = work()
        except BaseException as e:  # noqa: BLE001  (handed to the thread that waits on the future)
            future.set_exception(e)
        else:
            future.set_result(result)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
