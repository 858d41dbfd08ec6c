"""Shared by the benchmarks: each owns one `## Section` of docs/benchmarks.md and rewrites only it."""

from __future__ import annotations

import os
import platform
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def write_section(section: str, body: str, doc: Path = DOC) -> None:
    """Replace `section` (a `## Title` heading line, included in `body`) in `doc`, or append it."""
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    if section in text:
        head, _, rest = text.partition(section)
        nxt = rest.find("\n## ")
        tail = rest[nxt + 1 :] if nxt >= 0 else ""
        text = head + body + ("\n" + tail if tail else "")
    else:
        text = text.rstrip("\n") + "\n\n" + body
    doc.write_text(text)


#: The instruction-set extensions that decide a CPU's matmul speed (bf16 above all), as /proc/cpuinfo names them.
MATMUL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def machine() -> str:
    """This CPU for a results table: the model, the matmul extensions it has, and the core count.

    Why: the same code's ratios move with the CPU (AMX and AVX512-BF16 speed up bf16 matmuls, and
    not each framework alike), so a figure is comparable only with one from the same kind of CPU.
    """
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    found = [f for f in MATMUL_FLAGS if f in flags]
    return f"{model} ({platform.machine()}, {', '.join(found) if found else 'no ' + '/'.join(MATMUL_FLAGS)}), {os.cpu_count()} CPUs"

