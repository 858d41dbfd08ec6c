"""A small Dockerfile reader: enough to check what an image installs and runs without Docker.

It joins continuation lines, drops comments and splits each instruction into its keyword and
arguments; exec-form (JSON) ENTRYPOINT/CMD are decoded. `pip install` invocations are split
into their requirement specifiers and constraint files.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str


@dataclass(frozen=True)
class PipInstall:
    requirements: tuple[str, ...]
    constraints: tuple[str, ...]


def instructions(path: Path) -> list[Instruction]:
    """The Dockerfile's instructions in order, continuation lines joined."""
    out: list[Instruction] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, args = full.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip()))
    assert not pending, f"{path}: dangling line continuation"
    return out


def exec_form(path: Path, keyword: str) -> list[str]:
    """The last ENTRYPOINT/CMD, which must be in exec (JSON array) form."""
    found = [i for i in instructions(path) if i.keyword == keyword]
    assert found, f"{path}: no {keyword}"
    value = json.loads(found[-1].args)
    assert isinstance(value, list) and all(isinstance(x, str) for x in value), f"{path}: {keyword} is not exec form"
    return value


def final_stage(path: Path) -> list[Instruction]:
    """Instructions of the last build stage (the image that ships)."""
    ins = instructions(path)
    start = max(i for i, x in enumerate(ins) if x.keyword == "FROM")
    return ins[start:]


def pip_installs(path: Path) -> list[PipInstall]:
    """Every `pip install` in RUN instructions, with its requirements and `-c` files."""
    found: list[PipInstall] = []
    for ins in instructions(path):
        if ins.keyword != "RUN":
            continue
        for command in ins.args.split("&&"):
            words = shlex.split(command)
            if len(words) < 2 or not words[0].endswith("pip") or words[1] != "install":
                continue
            reqs: list[str] = []
            constraints: list[str] = []
            rest = iter(words[2:])
            for w in rest:
                if w in ("-c", "--constraint"):
                    constraints.append(next(rest))
                elif w.startswith("-"):
                    continue
                else:
                    reqs.append(w)
            found.append(PipInstall(tuple(reqs), tuple(constraints)))
    return found
