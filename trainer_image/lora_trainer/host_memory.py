"""Make glibc keep freed host memory for reuse, so a CPU training step stops page-faulting its buffers.

Why (docs/benchmarks.md, "Trainer: findings"): XLA's CPU client allocates every step's
buffers with `posix_memalign` from its worker threads. glibc serves those from per-thread
arenas that cannot hold blocks of 64 MiB or more, so it `mmap`s them fresh and `munmap`s them
on free, and it trims freed heap tops back to the kernel. The next step then touches new
pages again: on the benchmark model ~200,000 page faults (~800 MB zero-filled by the kernel)
per step, 0.7 s of system time, about half the step. With one arena, no mmap'd blocks and
no trimming, freed buffers are reused: ~1,000 faults per step.

The price is that the process keeps its peak heap (a training process reaches its working
set in the first steps and stays there). Set `LORA_TRAINER_GLIBC_MALLOC=default` to leave
glibc's defaults alone. Only glibc is tuned; elsewhere (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import os
import sys

#: glibc mallopt parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
#: mallopt takes an int: the largest trim threshold it accepts (2 GiB).
_NEVER_TRIM = 2**31 - 1
OPT_OUT_ENV = "LORA_TRAINER_GLIBC_MALLOC"


def retain_freed_memory() -> bool:
    """Tune glibc malloc as described above; True when applied.

    Call it first thing in a process, before JAX starts its thread pools: threads that
    already have an arena keep it.
    """
    if os.environ.get(OPT_OUT_ENV) == "default" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, _NEVER_TRIM))
    return all(mallopt(param, value) == 1 for param, value in settings)
