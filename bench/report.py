"""Shared by the benchmarks: each owns one `## Section` of docs/benchmarks.md and rewrites only it."""

from __future__ import annotations

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
