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
#: The local demo (run-local; its relative paths mean nothing in a cluster).
LOCAL_DEMO = EXAMPLES / "lora-finetune.yaml"
#: Every cluster manifest shipped in examples/.
MANIFESTS = sorted((EXAMPLES / "gke").glob("*.yaml"))
#: The operator settings of the platform the GKE examples assume (the priority class they name).
SETTINGS = EXAMPLES / "operator-settings.yaml"


def render_command(path: Path) -> tuple[int, str, str]:
    """`lora-operator render -f path --settings examples/operator-settings.yaml`: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(["render", "-f", str(path), "--settings", str(SETTINGS)])
    return rc, out.getvalue(), err.getvalue()


def render(path: Path) -> list[dict[str, Any]]:
    """The objects `lora-operator render` prints for `path`; fails with its stderr on a non-zero exit."""
    rc, out, err = render_command(path)
    assert rc == 0, f"lora-operator render -f {path} exited {rc}: {err}"
    return [d for d in yaml.safe_load_all(out) if d]


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
