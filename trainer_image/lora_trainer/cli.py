"""`lora-trainer`: the one program of the trainer image (train, export, convert, logits).

Subcommands import their heavy modules lazily so `--help` and argument errors are instant.
Every failure ends with one paragraph on stderr and a code from `exit_codes`.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Sequence

from lora_trainer import background, exit_codes
from lora_trainer.errors import TrainerError, UserError, device_oom_message, naming_fields

#: Seconds Python's shutdown may take once the exit code is decided; then the process is ended anyway.
EXIT_GRACE_S = 30.0
#: Seconds an error waits for background work that logs when done (`_fail`).
SETTLE_S = 10.0
#: Python's exit status after an uncaught exception (a crash outside the exit-code table).
UNCAUGHT_EXIT = 1
#: Ends every retriable error's paragraph, so a reader of the log knows no action is needed.
RETRIABLE_NOTES = {
    code: f" (retriable, exit {code}: the JobSet restarts the run, which resumes from its last committed checkpoint)"
    for code in (exit_codes.RETRIABLE, exit_codes.PREEMPTED)
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lora-trainer", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="fine-tune a LoRA adapter from a train config (YAML or JSON)")
    t.add_argument("--config", required=True, help="train config file (the ConfigMap the operator renders)")

    e = sub.add_parser("export", help="Orbax LoRA checkpoint -> HF PEFT adapter (optionally merged model)")
    e.add_argument("--checkpoint", required=True, help="checkpoint root (<output>/checkpoints) or one step directory")
    e.add_argument("--step", type=int, default=None, help="step to export (default: latest committed)")
    e.add_argument("--out", required=True, help="output directory (local or gs://)")
    e.add_argument("--merged", action="store_true", help="write the base model with the adapter merged instead")
    e.add_argument("--base", default=None, help="base model (default: the one recorded in the checkpoint)")

    c = sub.add_parser("convert", help="convert an adapter between HF PEFT and Orbax")
    c.add_argument("--from", dest="src_format", required=True, choices=["hf-peft", "orbax"])
    c.add_argument("--to", dest="dst_format", required=True, choices=["hf-peft", "orbax"])
    c.add_argument("--source", required=True, help="adapter to convert")
    c.add_argument("--out", required=True, help="output directory")
    c.add_argument("--base", required=True, help="base model the adapter belongs to")
    c.add_argument("--family", default=None, help="model family (default: detected from the base config.json)")
    c.add_argument("--merged", action="store_true", help="write the merged model (target hf-peft only)")

    lg = sub.add_parser("logits", help="JAX logits of one token sequence, float32 [len, vocab], to a .npy file")
    lg.add_argument("--base", required=True)
    lg.add_argument("--adapter", default=None, help="HF PEFT adapter dir or Orbax LoRA checkpoint")
    lg.add_argument("--tokens", required=True, help="comma-separated token ids, e.g. 1,2,3")
    lg.add_argument("--out", required=True)
    lg.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    return p


#: Flags of each command that name a storage location (`naming_fields` names them in errors).
_LOCATION_FLAGS = {
    "export": ("checkpoint", "out", "base"),
    "convert": ("source", "out", "base"),
    "logits": ("base", "adapter", "out"),
}


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "train":
        from lora_trainer import backend_start
        from lora_trainer.config import load_train_config

        cfg = load_train_config(args.config)  # a bad config fails in a quarter second, before any runtime starts
        backend_start.start(cfg)  # the runtime starts (then the cached step loads) while the trainer's modules import
        from lora_trainer.train import run_training

        fields = {
            "model.source": cfg.model.source,
            "dataset.train": cfg.dataset.train,
            "dataset.eval": cfg.dataset.eval,
            "lora.restoreFrom": cfg.lora.restore_from,
            "output.uri": cfg.output.uri,
        }
        with naming_fields(fields):
            run_training(cfg, interruptible=True)  # Ctrl-C by hand: save, then exit 130
        return exit_codes.OK
    with naming_fields({f"--{flag}": getattr(args, flag) for flag in _LOCATION_FLAGS[args.command]}):
        return _run_adapter_command(args)


def _run_adapter_command(args: argparse.Namespace) -> int:
    if args.command == "export":
        from lora_trainer.adapters.export import export_checkpoint

        export_checkpoint(args.checkpoint, args.out, step=args.step, merged=args.merged, base=args.base)
        return exit_codes.OK
    if args.command == "convert":
        from lora_trainer.adapters.convert import convert

        convert(args.src_format, args.dst_format, args.source, args.out, base=args.base, family=args.family, merged=args.merged)
        return exit_codes.OK
    if args.command == "logits":
        from lora_trainer.adapters.logits import write_logits

        try:
            tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
        except ValueError as e:
            raise UserError(f"--tokens {args.tokens!r}: give token ids as comma-separated integers, e.g. 1,15043,29871") from e
        write_logits(args.base, tokens, args.out, adapter=args.adapter, dtype=args.dtype)
        return exit_codes.OK
    raise AssertionError(args.command)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit code.

    With `argv` None the command line is the process's own (the console script), and the process
    then ends within EXIT_GRACE_S of its exit code being decided (see `_exit_within`).
    """
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # argparse: 0 for --help, 2 for a bad command line, which the table calls a user error
        if e.code in (0, None):
            raise
        return exit_codes.USER_ERROR
    try:
        code = _run(args)
    except Exception:
        if argv is None:
            _exit_within(EXIT_GRACE_S, UNCAUGHT_EXIT)
        raise
    if argv is None:
        _exit_within(EXIT_GRACE_S, code)
    return code


def _exit_within(grace: float, code: int) -> None:
    """End the process with `code` if Python's shutdown has not ended it `grace` seconds from now.

    Why: after a checkpoint save fails mid-commit (a storage outage), Orbax leaves non-daemon
    threads waiting for signals that never come, and Python waits for them at exit forever: the
    pod would hold its chips and never report the code the JobSet acts on. A daemon thread keeps
    running while Python waits, so it can end the process; a clean shutdown ends it first.
    """

    def force() -> None:
        time.sleep(grace)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)

    threading.Thread(target=force, name="lora-trainer-exit", daemon=True).start()


def _run(args: argparse.Namespace) -> int:
    """`_dispatch`, with every known failure turned into its paragraph on stderr and its exit code."""
    try:
        return _dispatch(args)
    except TrainerError as e:
        return _fail(args, f"{e}{RETRIABLE_NOTES.get(e.exit_code, '')}", e.exit_code)
    except MemoryError:
        return _fail(
            args,
            "out of host memory. Use a host with more memory, a smaller training.globalBatchSize or dataset.maxSeqLen, "
            "or quantize the base (lora.quantization).",
            exit_codes.USER_ERROR,
        )
    except Exception as e:
        message = device_oom_message(e, args.command)
        if message is None:
            raise
        return _fail(args, message, exit_codes.USER_ERROR)


def _fail(args: argparse.Namespace, message: str, code: int) -> int:
    """Print the error as stderr's last line: work still writing what it logs (a kept train step)
    gets a few seconds to finish first, or its line came after the error (`background.settle`)."""
    background.settle(SETTLE_S)
    print(f"lora-trainer {args.command}: error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
