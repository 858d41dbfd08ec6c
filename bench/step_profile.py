"""Where the trainer's bf16 LoRA step spends its wall time on this CPU, by what runs at each moment.

Why wall time: XLA:CPU's thunk executor runs independent thunks at once, so summing each thunk's
own time counts overlapped work twice (earlier profiles in docs/benchmarks.md did, and misled).
This traces the production step (`tunix_trainer.make_trainer`, the benchmark's model and batch
from `train_throughput`) with `jax.profiler`, sweeps the thunks' intervals, and gives every
moment to the set of thunk kinds running in it: products (frozen projections, the LM head,
attention, rank-r LoRA products) and product-free elementwise work, named by the ops fused in it.
The kinds come from XLA's optimized HLO of the step (dumped once), the FLOPs from its dots.

Run by hand: `.venv/bin/python bench/step_profile.py [--steps 5]`; prints, writes nothing.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

DUMP = tempfile.mkdtemp(prefix="step-profile-hlo-")
# Before JAX starts: XLA reads its flags once. Only the optimized module text is written.
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={DUMP} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$"

import train_throughput as tt  # noqa: E402  (bench/ is on sys.path; tunes malloc as the trainer does)

_INSTR = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = (\S+) ([\w\-]+)\((.*?)\)(.*)")
_COMP = re.compile(r"^%([\w.\-]+) \(.*?\) -> .*? \{\n(.*?)\n\}", re.S | re.M)
_SHAPE = re.compile(r"\w+\[([\d,]*)\]")


def _dims(shape: str) -> list[int]:
    m = _SHAPE.match(shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def thunk_kinds(hlo: str, rank: int) -> dict[str, tuple[str, float]]:
    """Each top-level instruction of an optimized HLO module -> (kind, FLOPs of its dots). Pure.

    Kinds: `lm head` (a dot with a vocab-sized operand, the largest dim over 4096), `attention`
    (a dot with batch dims), `rank-r` (a dot with a dim of the LoRA rank: A, B and their
    gradients), `projection` (other dots), else the sorted ops fused in it (`add+convert`, ...)."""
    bodies = {m.group(1): m.group(2) for m in _COMP.finditer(hlo)}
    kinds: dict[str, tuple[str, float]] = {}
    for line in hlo.splitlines():
        m = _INSTR.match(line)
        if not m or line.startswith("%") or "ENTRY" in line:
            continue
        name, op, rest = m.group(1), m.group(3), m.group(5)
        called = re.search(r"calls=%([\w.\-]+)", rest)
        body = bodies.get(called.group(1), "") if called else line
        ops = sorted({o for o in re.findall(r"= \S+ ([\w\-]+)\(", body) if o not in ("parameter", "bitcast", "constant", "broadcast")})
        dots = [d for d in body.splitlines() if re.search(r"= \S+ dot\(", d)]
        if not dots:
            kinds[name] = ("+".join(ops) or op, 0.0)
            continue
        flops = 0.0
        for d in dots:
            dm = _INSTR.match(d)
            lhs = dm.group(4).split(",")[0].strip()
            lhs_shape = re.search(rf"{re.escape(lhs)} = (\S+) ", body)
            lhs_dims = _dims(lhs_shape.group(1)) if lhs_shape else []
            contracted = [int(i) for i in re.search(r"lhs_contracting_dims=\{([\d,]*)\}", d).group(1).split(",")]
            k = math.prod(lhs_dims[i] for i in contracted if i < len(lhs_dims))
            flops += 2.0 * k * math.prod(_dims(dm.group(2)))
        shapes = [s for s in (_dims(x) for x in re.findall(r"\w+\[[\d,]*\]", body)) if s]
        if any(max(s) > 4096 for s in shapes):
            kind = "lm head"
        elif "lhs_batch_dims" in body:
            kind = "attention"
        elif any(rank in s for s in shapes):
            kind = "rank-r"
        else:
            kind = "projection"
        kinds[name] = (kind, flops)
    return kinds


def wall_by_concurrency(intervals: list[tuple[float, float, str]]) -> collections.Counter:
    """Sweep (start, end, kind) intervals: the time each multiset of concurrently running kinds
    held the machine (empty: nothing ran). Pure."""
    points = sorted([(a, 1, k) for a, _, k in intervals] + [(b, -1, k) for _, b, k in intervals])
    running: collections.Counter = collections.Counter()
    held: collections.Counter = collections.Counter()
    last = points[0][0] if points else 0.0
    for t, delta, kind in points:
        if t > last:
            held[tuple(sorted(running.elements()))] += t - last
        last = t
        running[kind] += delta
        if not running[kind]:
            del running[kind]
    return held


def _describe(held: tuple[str, ...]) -> str:
    return " + ".join(f"{n} x {k}" if n > 1 else k for k, n in sorted(collections.Counter(held).items())) or "(idle)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="steps traced (after 3 untraced)")
    args = p.parse_args()
    import jax

    from lora_trainer.tiny_models import make_tiny_hf_model

    with tempfile.TemporaryDirectory(prefix="step-profile-") as tmp:
        model_dir = make_tiny_hf_model("llama3", Path(tmp) / "llama", seed=0, **tt.SHAPE)
        step = tt.production_step(model_dir, "bfloat16")
        for _ in range(3):
            step()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        untraced = (time.perf_counter() - t0) / args.steps
        trace_dir = Path(tmp) / "trace"
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            for _ in range(args.steps):
                step()
        (trace,) = glob.glob(str(trace_dir / "**" / "perfetto_trace.json.gz"), recursive=True)
        events = json.load(gzip.open(trace))
    events = events["traceEvents"] if isinstance(events, dict) else events
    (module,) = glob.glob(f"{DUMP}/*jit__train_step.cpu_after_optimizations.txt")
    kinds = thunk_kinds(Path(module).read_text(), tt.RANK)
    thunks = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("ph") == "X" and e.get("name") in kinds]
    product = {k for k, f in kinds.values() if f}
    coarse = [(a, b, kinds[n][0] if kinds[n][0] in product else "elementwise") for a, b, n in thunks]
    held = wall_by_concurrency(coarse)
    n = args.steps
    total = sum(held.values()) / n / 1e3
    print(f"step: {untraced * 1e3:.0f} ms untraced, {total:.0f} ms of traced wall time per step")
    for group, us in held.most_common():
        print(f"  {us / n / 1e3:7.1f} ms  {_describe(group)}")
    free = collections.Counter()  # elementwise work with no product running, by its fused ops
    fine = [(a, b, n if kinds[n][0] not in product else kinds[n][0]) for a, b, n in thunks]
    for group, us in wall_by_concurrency(fine).items():
        if group and not set(group) & product:
            for name in group:
                free[kinds[name][0]] += us / len(group)
    print("product-free elementwise work by the ops fused in it:")
    for ops, us in free.most_common(12):
        print(f"  {us / n / 1e3:7.1f} ms  {ops}")
    active = collections.Counter()
    for group, us in held.items():
        for kind in set(group) & product:
            active[kind] += us
    flops = collections.Counter()
    for kind, f in kinds.values():
        flops[kind] += f
    print("products: GFLOP per step, wall time while running, GFLOP/s over that time:")
    for kind in sorted(product):
        secs = active[kind] / n / 1e6
        print(f"  {kind:10s} {flops[kind] / 1e9:6.1f} GFLOP  {secs * 1e3:6.1f} ms  {flops[kind] / 1e9 / secs if secs else 0:5.0f} GFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
