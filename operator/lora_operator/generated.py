"""Files generated from the code (CRDs, reference docs): write them, or check they are up to date."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path


def write_or_check(files: Mapping[str, str], directories: Sequence[Path], *, check: bool, what: str, command: str) -> int:
    """Write `files` (name -> text) into each directory, or with `check` list stale ones and return 1.

    `what` names the files in the message ("CRDs"), `command` is how to regenerate them.
    """
    stale = []
    for directory in directories:
        for name, text in files.items():
            path = directory / name
            if check:
                if not path.exists() or path.read_text() != text:
                    stale.append(str(path))
            else:
                directory.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    if stale:
        print(f"{what} out of date: {', '.join(stale)}; run `{command}` and commit the result", file=sys.stderr)
        return 1
    return 0
