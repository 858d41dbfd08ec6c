"""Render example manifests the way a user does: `lora-operator render -f FILE` (the real CLI)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import yaml

from lora_operator.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
#: Every manifest shipped in examples/: the local demo and the GKE ones.
MANIFESTS = sorted([EXAMPLES / "lora-finetune.yaml", *(EXAMPLES / "gke").glob("*.yaml")])


def render(path: Path) -> list[dict[str, Any]]:
    """The objects `lora-operator render -f path` prints; fails with its stderr on a non-zero exit."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(["render", "-f", str(path)])
    assert rc == 0, f"lora-operator render -f {path} exited {rc}: {err.getvalue()}"
    return [d for d in yaml.safe_load_all(out.getvalue()) if d]


def pod_containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The containers of a JobSet's or a Job's pod template."""
    if obj["kind"] == "JobSet":
        return [c for rj in obj["spec"]["replicatedJobs"] for c in rj["template"]["spec"]["template"]["spec"]["containers"]]
    if obj["kind"] == "Job":
        return obj["spec"]["template"]["spec"]["containers"]
    return []


def pod_security(obj: dict[str, Any]) -> dict[str, Any]:
    """The pod-level securityContext of a JobSet's or Job's pod template."""
    if obj["kind"] == "JobSet":
        return obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["securityContext"]
    return obj["spec"]["template"]["spec"]["securityContext"]
