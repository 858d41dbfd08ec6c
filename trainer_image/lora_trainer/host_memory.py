"""Make glibc keep freed host memory for reuse, so a CPU training step stops page-faulting its buffers.

Why (docs/benchmarks.md, "Trainer: findings"): XLA's CPU client allocates every step's
buffers with `posix_memalign` from its worker threads. glibc serves those from per-thread
arenas that cannot hold blocks of 64 MiB or more, so it `mmap`s them fresh and `munmap`s them
on free, and it trims freed heap tops back to the kernel. The next step then touches new
pages again: on the benchmark model ~200,000 page faults (~800 MB zero-filled by the kernel)
per step, 0.7 s of system time, about half the step. With one arena, no mmap'd blocks and
no trimming, freed buffers are reused: ~1,000 faults per step.

The price is that the process keeps its peak heap (a training process reaches its working
set in the first steps and stays there), and that every thread allocates from the one arena, so
threads that allocate at once queue for its lock: the tokenizer's parallel batch encoding ran 3x
slower on 2 cores, and on a 13-core TPU host loading the tokenizer and tokenizing took 22.5 s of
a 57 s restart, 6.2 s untuned (issue 21). So the
tuning applies only where JAX computes on the CPU, and `data` encodes one text at a time under
it. Set `LORA_TRAINER_GLIBC_MALLOC=default` to leave glibc's defaults alone. Only glibc is
tuned; elsewhere (musl, macOS) this does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import sys
from collections.abc import Mapping
from pathlib import Path

#: glibc mallopt parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
#: mallopt takes an int: the largest trim threshold it accepts (2 GiB).
_NEVER_TRIM = 2**31 - 1
OPT_OUT_ENV = "LORA_TRAINER_GLIBC_MALLOC"
#: The PCI vendor id of Google's TPU chips (JAX's own probe, `jax._src.hardware_utils`, reads the same files).
_GOOGLE_PCI_VENDOR = "0x1ae0"

_applied = False


def one_arena() -> bool:
    """Whether this process's allocations share one glibc arena (`retain_freed_memory` applied)."""
    return _applied


def _accelerator_attached() -> bool:
    """A TPU chip on the PCI bus or an NVIDIA GPU device node: found without starting JAX."""
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        with contextlib.suppress(OSError):
            if Path(vendor).read_text().strip() == _GOOGLE_PCI_VENDOR:
                return True
    return os.path.exists("/dev/nvidiactl")


def computes_on_cpu(env: Mapping[str, str], accelerator_attached: bool) -> bool:
    """Whether JAX will compute on XLA:CPU: `JAX_PLATFORMS` says so, or names nothing and no accelerator is attached. Pure."""
    platforms = [p.strip() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    return platforms[0] == "cpu" if platforms else not accelerator_attached


def retain_freed_memory() -> bool:
    """Tune glibc malloc as described above; True when applied.

    Call it first thing in a process, before JAX starts its thread pools: threads that
    already have an arena keep it. Where JAX computes on an accelerator, step buffers live on
    the device and nothing is tuned.
    """
    global _applied
    if os.environ.get(OPT_OUT_ENV) == "default" or not sys.platform.startswith("linux"):
        return False
    if not computes_on_cpu(os.environ, _accelerator_attached()):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, _NEVER_TRIM))
    _applied = all(mallopt(param, value) == 1 for param, value in settings)
    return _applied
