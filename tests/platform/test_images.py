"""The two images install what pyproject.toml pins and run what the operator renders.

No Docker engine here: the Dockerfiles are parsed (tests/platform/dockerfile.py)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

import dockerfile
import rendered
from lora_trainer import cli as trainer_cli

ROOT = Path(__file__).resolve().parents[2]
OPERATOR_DOCKERFILE = ROOT / "Dockerfile"
TRAINER_DOCKERFILE = ROOT / "trainer_image" / "Dockerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def pins(requirements: list[str]) -> dict[str, str]:
    """`name==version` requirements as {normalised name: version}."""
    out = {}
    for req in requirements:
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)(\[[^\]]*\])?==([^;\s]+)", req.strip())
        assert m, f"pyproject requirement {req!r} is not pinned with =="
        out[m.group(1).lower().replace("_", "-")] = m.group(3)
    return out


def constraints() -> dict[str, str]:
    lines = [x for x in (ROOT / "constraints.txt").read_text().splitlines() if x.strip() and not x.startswith("#")]
    return {k: v.split("+")[0] for k, v in pins(lines).items()}


def test_every_pyproject_pin_is_in_constraints() -> None:
    """The images install with `-c constraints.txt`: the two must agree, or an image drifts from CI."""
    c = constraints()
    declared = PYPROJECT["project"]["dependencies"] + [r for extra in PYPROJECT["project"]["optional-dependencies"].values() for r in extra]
    for name, version in pins(declared).items():
        assert c.get(name) == version, f"{name}=={version} in pyproject.toml but {c.get(name)!r} in constraints.txt"


@pytest.mark.parametrize("path", [OPERATOR_DOCKERFILE, TRAINER_DOCKERFILE], ids=["operator", "trainer"])
def test_image_is_slim_python_of_the_supported_version_and_non_root(path: Path) -> None:
    stage = dockerfile.final_stage(path)
    base = stage[0].args
    assert re.fullmatch(r"python:3\.11(\.\d+)?-slim(-\w+)?", base), f"{path.name}: base {base!r} is not a slim Python 3.11"
    assert PYPROJECT["project"]["requires-python"] == ">=3.11,<3.12"
    users = [i.args for i in stage if i.keyword == "USER"]
    assert users, f"{path.name}: final stage has no USER (would run as root)"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"{path.name}: USER {users[-1]!r} must be a numeric non-root UID (runAsNonRoot needs one)"


def test_operator_image_installs_only_the_operator_extra_pinned() -> None:
    (install,) = dockerfile.pip_installs(OPERATOR_DOCKERFILE)
    assert install.constraints == ("constraints.txt",)
    assert install.requirements == ('.[operator]',)
    assert dockerfile.exec_form(OPERATOR_DOCKERFILE, "ENTRYPOINT") == ["lora-operator", "run"]
    copied = " ".join(i.args for i in dockerfile.instructions(OPERATOR_DOCKERFILE) if i.keyword == "COPY")
    assert "constraints.txt" in copied and "pyproject.toml" in copied


def test_chart_runs_the_operator_image_as_its_user() -> None:
    values = (ROOT / "charts" / "lora-operator" / "values.yaml").read_text()
    user = [i.args for i in dockerfile.final_stage(OPERATOR_DOCKERFILE) if i.keyword == "USER"][-1]
    uid, gid = user.split(":")
    assert f"runAsUser: {uid}" in values and f"runAsGroup: {gid}" in values


def test_trainer_image_installs_pinned_jax_for_tpu_and_the_trainer_extra() -> None:
    (install,) = dockerfile.pip_installs(TRAINER_DOCKERFILE)
    assert install.constraints == ("constraints.txt",)
    trainer_pins = pins(PYPROJECT["project"]["optional-dependencies"]["trainer"])
    assert f"jax[tpu]=={trainer_pins['jax']}" in install.requirements
    assert ".[trainer]" in install.requirements
    assert not [r for r in install.requirements if r.startswith(".[") and r != ".[trainer]"], "only the trainer extra"
    assert dockerfile.exec_form(TRAINER_DOCKERFILE, "ENTRYPOINT") == ["lora-trainer"]
    scripts = PYPROJECT["project"]["scripts"]
    assert scripts["lora-trainer"] == "lora_trainer.cli:main" and scripts["lora-operator"] == "lora_operator.cli:main"


@pytest.mark.parametrize("path", rendered.MANIFESTS, ids=lambda p: p.name)
def test_rendered_trainer_commands_are_what_the_trainer_image_runs(path: Path) -> None:
    """Every container the operator renders (JobSet, export Job, conversion Job) runs the trainer
    image's entrypoint with a subcommand and flags `lora-trainer`'s own parser accepts, as the
    user the image was built for."""
    entrypoint = dockerfile.exec_form(TRAINER_DOCKERFILE, "ENTRYPOINT")
    uid, gid = [i.args for i in dockerfile.final_stage(TRAINER_DOCKERFILE) if i.keyword == "USER"][-1].split(":")
    parser = trainer_cli._parser()
    workloads = [o for o in rendered.render(path) if o["kind"] in ("JobSet", "Job")]
    assert workloads
    for obj in workloads:
        security = rendered.pod_security(obj)
        assert (str(security["runAsUser"]), str(security["runAsGroup"])) == (uid, gid), obj["metadata"]["name"]
        for container in rendered.pod_containers(obj):
            argv = [*container.get("command", entrypoint), *container.get("args", [])]
            assert argv[: len(entrypoint)] == entrypoint, f"{obj['metadata']['name']}: {argv}"
            try:
                args = parser.parse_args(argv[len(entrypoint):])
            except SystemExit as e:
                pytest.fail(f"{obj['metadata']['name']}: lora-trainer rejects {argv}: exit {e.code}")
            expected = {"JobSet": {"train"}, "Job": {"export", "convert"}}[obj["kind"]]
            assert args.command in expected


#: Import names of what the trainer and test extras add on top of the operator image.
NOT_IN_OPERATOR_IMAGE = {
    "jax": "jax", "flax": "flax", "qwix": "qwix", "google-tunix": "tunix", "orbax-checkpoint": "orbax", "absl-py": "absl",
    "optax": "optax", "transformers": "transformers", "safetensors": "safetensors", "gcsfs": "gcsfs",
    "pyarrow": "pyarrow", "tensorboardx": "tensorboardX", "matplotlib": "matplotlib", "torch": "torch", "peft": "peft",
}

_BLOCKER = """
import importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not installed in the operator image")
sys.meta_path.insert(0, Block())
import lora_operator.cli, lora_operator.runner, lora_operator.handlers, lora_operator.kube
sys.exit(lora_operator.cli.main(["render", "-f", sys.argv[2]]))
"""


def test_operator_runs_without_the_trainer_stack() -> None:
    """The operator image has only the `operator` extra: the operator's modules must import (and
    render) with JAX, torch, transformers, matplotlib ... absent."""
    import subprocess
    import sys

    operator_extra = set(pins(PYPROJECT["project"]["optional-dependencies"]["operator"]))
    heavy = set(pins(PYPROJECT["project"]["optional-dependencies"]["trainer"])) - operator_extra
    heavy |= {"torch", "peft"}
    assert heavy <= set(NOT_IN_OPERATOR_IMAGE), f"map the import names of {heavy - set(NOT_IN_OPERATOR_IMAGE)}"
    blocked = ",".join(NOT_IN_OPERATOR_IMAGE[d] for d in sorted(heavy))
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCKER, blocked, str(rendered.EXAMPLES / "gke" / "llama31-8b-v5p.yaml")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "kind: JobSet" in proc.stdout
