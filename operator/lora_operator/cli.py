"""`lora-operator`: run the operator, render a CR's children, generate the CRDs, or run a CR locally."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lora-operator", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="start the operator (kopf)")
    r.add_argument("--namespace", "-n", action="append", default=[], help="namespace to watch (repeatable; default: all)")
    r.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="liveness endpoint URL")
    r.add_argument("--settings", default=None, help="operator settings YAML (images allowlist, defaults)")
    r.add_argument("--metrics-port", type=int, default=8081, help="port of the Prometheus /metrics endpoint (0: none)")

    rd = sub.add_parser("render", help="print every child object of a CR as YAML, like `helm template`")
    rd.add_argument("-f", "--filename", required=True, help="LoraFinetune or AdapterConversion manifest")
    rd.add_argument("--settings", default=None, help="operator settings YAML")

    c = sub.add_parser("crds", help="generate the CRD YAML from the API models")
    c.add_argument("--out", action="append", default=[], help="directory to write into (repeatable; default: crds/)")
    c.add_argument("--check", action="store_true", help="exit 1 if the files on disk differ from the generated ones")

    d = sub.add_parser("docs", help="generate docs/reference/ (CRDs, CLIs, exit codes) from the code")
    d.add_argument("--out", default="docs/reference", help="directory to write into (default: docs/reference)")
    d.add_argument("--check", action="store_true", help="exit 1 if the files on disk differ from the generated ones")

    lo = sub.add_parser("run-local", help="run a LoraFinetune on this machine, no cluster (CPU or one accelerator)")
    lo.add_argument("-f", "--filename", required=True, help="LoraFinetune manifest")
    lo.add_argument("--output", default=None, help="override spec.output.uri")
    lo.add_argument("--no-progress-bar", action="store_true", help="plain log lines instead of a live bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "crds":
        from lora_operator.crdgen import check_or_write

        return check_or_write([Path(d) for d in (args.out or ["crds"])], check=args.check)
    if args.command == "render":
        from lora_operator.render import render_file

        return render_file(Path(args.filename), settings_path=args.settings)
    if args.command == "run":
        from lora_operator.runner import run_operator

        return run_operator(namespaces=args.namespace, liveness=args.liveness, settings_path=args.settings,
                            metrics_port=args.metrics_port)
    if args.command == "docs":
        from lora_operator.refdocs import check_or_write as write_docs
        from lora_trainer.cli import _parser as trainer_parser

        clis = {"operator-cli.md": _parser(), "trainer-cli.md": trainer_parser()}
        return write_docs(Path(args.out), clis, check=args.check)
    if args.command == "run-local":
        from lora_operator.local import run_local

        return run_local(Path(args.filename), output=args.output, progress_bar=not args.no_progress_bar)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
