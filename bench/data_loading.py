"""Loading training data on one host vs two: each host tokenizes its share of the rows and the hosts pool them.

Data: `--rows` chat rows (system, user, assistant, user, assistant; a few hundred tokens
each), rendered with the tiny model's chat template and its assistant-only loss mask, the
trainer's slowest format. Each round runs `data.tokenize_file` in one process, then in two
real processes joined by `jax.distributed` (one CPU device each, gloo collectives, the path
a multi-host run takes), and times it inside the processes (reading, tokenizing and pooling;
not JAX's start-up). Both runs must produce the same examples (checked by digest). Reported:
the median over rounds, rows/s, and the two-host speed-up. On this machine the two
processes share its two cores, so the speed-up is bounded by 2.
Writes the "Data loading" section of docs/benchmarks.md unless `--no-write`.
Run by hand: `.venv/bin/python bench/data_loading.py [--rows 4000] [--rounds 3] [--no-write]`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import report  # bench/ is on sys.path when a script here runs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gcs_emulator import free_port  # noqa: E402  (the tests' loopback port helper)

WORDS = "the a river city capital review label positive negative hotel delivery great mountain answer why how".split()


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_rows(path: Path, rows: int) -> None:
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(rows):
            turns = [{"role": "system", "content": "Answer briefly."}]
            for _ in range(2):
                turns += [{"role": "user", "content": _sentence(rng, 20)}, {"role": "assistant", "content": _sentence(rng, 30)}]
            f.write(json.dumps({"messages": turns}) + "\n")


def worker(data_file: str, model_dir: str) -> None:
    """One process: join the run (if the environment says so), tokenize its share, pool, report."""
    import jax

    from lora_trainer import data, distributed
    from lora_trainer.config import DatasetSpec

    distributed.initialize()
    tokenizer = data.load_tokenizer(Path(model_dir))
    spec = DatasetSpec(train=data_file, format="chat", max_seq_len=1024)
    share = data.Share(jax.process_index(), jax.process_count(), distributed.allgather_bytes)
    start = time.perf_counter()
    ds = data.tokenize_file(data_file, spec, tokenizer, share)
    seconds = time.perf_counter() - start
    digest = hashlib.sha256(b"".join(e.tokens.tobytes() + e.loss_mask.tobytes() for e in ds.examples)).hexdigest()
    tokens = sum(len(e.tokens) for e in ds.examples)
    print(json.dumps({"seconds": seconds, "examples": len(ds.examples), "tokens": tokens, "digest": digest}))


def run(data_file: Path, model_dir: Path, processes: int) -> dict:
    """`processes` real worker processes; the slowest one's time (they finish together, after pooling)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"}
    if processes > 1:
        env |= {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}", "JAX_PROCESS_COUNT": str(processes)}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(data_file), str(model_dir)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**env, "JAX_PROCESS_ID": str(k)},
        )  # fmt: skip
        for k in range(processes)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        if p.returncode:
            raise SystemExit(f"worker failed ({p.returncode}):\n{err.decode()[-3000:]}")
        results.append(json.loads(out.decode().splitlines()[-1]))
    if len({r["digest"] for r in results}) != 1:
        raise SystemExit("the processes hold different data")
    return {**results[0], "seconds": max(r["seconds"] for r in results)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--worker", nargs=2, metavar=("DATA", "MODEL_DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker)
        return

    from lora_trainer.tiny_models import make_tiny_hf_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_hf_model("llama3", Path(tmp) / "model")
        data_file = Path(tmp) / "chat.jsonl"
        write_rows(data_file, args.rows)
        times: dict[int, list[float]] = {1: [], 2: []}
        for r in range(args.rounds):
            got = {n: run(data_file, model_dir, n) for n in (1, 2)}
            if got[1]["digest"] != got[2]["digest"]:
                raise SystemExit("one process and two processes produced different data")
            for n in (1, 2):
                times[n].append(got[n]["seconds"])
            print(f"round {r + 1}: one host {got[1]['seconds']:.2f} s, two hosts {got[2]['seconds']:.2f} s", flush=True)
        one, two = statistics.median(times[1]), statistics.median(times[2])
        tokens = got[1]["tokens"]

    rows = [
        ("one host", one, args.rows / one),
        ("two hosts", two, args.rows / two),
    ]
    table = "\n".join(f"| {name} | {s:.2f} | {rate:,.0f} |" for name, s, rate in rows)
    body = f"""## Data loading

`bench/data_loading.py` on {report.machine()}, {time.strftime("%Y-%m-%d")}:
{args.rows} chat rows ({tokens / args.rows:.0f} tokens each on average, assistant-only loss mask from the
chat template), `data.tokenize_file` in one process and in two real processes joined by
`jax.distributed` (gloo), each tokenizing every other row and pooling them (the same
examples, checked by digest). Median of {args.rounds} rounds; JAX's start-up not counted.

| hosts | seconds | rows/s |
|---|---|---|
{table}

Two hosts load the file **{one / two:.2f}x** as fast as one. Not split: every host reads the
whole file and splits it into lines, and pooling sends every host's tokens to every other; and
the two processes share this machine's two cores with JAX's own threads. Before, every host
tokenized every row, so adding hosts never shortened loading.
"""
    print(body)
    if not args.no_write:
        report.write_section("## Data loading", body)


if __name__ == "__main__":
    main()
