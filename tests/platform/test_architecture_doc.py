"""docs/architecture.md's module table names every module of both packages, and only real ones.

A row's first cell names modules in backticks; a name without a package (`refdocs` after
`lora_operator.crdgen`) is a sibling of the row's first name. Subpackages count as one module
(`lora_trainer.models` covers `models.loading`); their modules may have rows of their own.
"""

from __future__ import annotations

import importlib.util
import pkgutil
import re
from pathlib import Path

import lora_operator
import lora_trainer

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def _documented() -> set[str]:
    table = DOC.read_text().split("## Modules", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        first, *rest = re.findall(r"`([\w.]+)`", line.split("|")[1])
        package = first.rsplit(".", 1)[0]
        names |= {first, *(n if "." in n else f"{package}.{n}" for n in rest)}
    return names


def _modules() -> set[str]:
    return {f"{pkg.__name__}.{m.name}" for pkg in (lora_trainer, lora_operator) for m in pkgutil.iter_modules(pkg.__path__)}


def test_every_module_has_a_row():
    missing = _modules() - _documented()
    assert not missing, f"add a row for each to the module table of {DOC}: {sorted(missing)}"


def test_every_row_names_a_real_module():
    unknown = sorted(n for n in _documented() if importlib.util.find_spec(n) is None)
    assert not unknown, f"{DOC} names modules that do not exist: {unknown}"
