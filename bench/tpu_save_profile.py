"""Profile the train steps a background save overlaps on the chip (run by hand through `device`, never in CI).

What it answers: when a save (as `async_saves` makes it: a copy on the device, then on one thread
the host copy and Orbax's save) slows the steps around it, is the chip slower, or idle? It traces
six steps with `jax.profiler` (a save handed off before the third) and prints, from the trace,
each device program's duration and the idle gap before it, and how long the main thread's
dispatch of a micro-batch (`tunix_trainer.StateStep.__call__`) took with and without the save running.

    python bench/tpu_save_profile.py --out $OUT/save-profile      # 3B widths, 8 layers, 8 micro-batches of 1 x 2048

The steps come from `tpu_throughput._study_trainer` (the production step, `dots`), which counts
every micro-batch as an optimizer step: Tunix then waits for the previous micro-batch's loss
before dispatching the next, so the chip runs at most one micro-batch ahead of the host. A
training run waits once per step, with two micro-batches in flight.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / p) for p in ("trainer_image", "operator")]
import tpu_throughput as tb  # noqa: E402  (beside this file)


def _is_dispatch(name: str) -> bool:
    """The Python tracer's event for one call of the train step (`StateStep.__call__`), named `$file:line function`."""
    return "tunix_trainer.py" in name and name.endswith(" __call__")


def _inside(outer: dict[str, Any], events: list[dict[str, Any]], top: int = 10) -> dict[str, float]:
    """Milliseconds spent in each event name within `outer` on its thread (nested ones counted in their parents too)."""
    totals: dict[str, float] = {}
    for e in events:
        if e is not outer and outer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"]:
            totals[e["name"]] = totals.get(e["name"], 0.0) + e["dur"] / 1e3
    return {"total": round(outer["dur"] / 1e3, 1), **{k: round(v, 1) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])[:top]}}


def _trace_summary(trace: Path, step_starts: list[float], wall_zero: float) -> dict[str, Any]:
    """Device programs (duration, idle gap before) and the main thread's dispatch times, from a perfetto trace."""
    events = json.load(gzip.open(trace))
    events = events["traceEvents"] if isinstance(events, dict) else events
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    modules = sorted((e for e in events if e.get("ph") == "X" and tracks.get((e["pid"], e["tid"])) == "XLA Modules"),
                     key=lambda e: e["ts"])  # fmt: skip
    programs, end = [], None
    for e in modules:
        programs.append({"name": e["name"].split("(")[0], "ms": round(e["dur"] / 1e3, 2),
                         "idle_before_ms": round((e["ts"] - end) / 1e3, 2) if end is not None else 0.0})  # fmt: skip
        end = e["ts"] + e["dur"]
    dispatch = sorted((e for e in events if e.get("ph") == "X" and _is_dispatch(e.get("name", ""))), key=lambda e: e["ts"])
    main = [e for e in events if e.get("ph") == "X" and dispatch and (e["pid"], e["tid"]) == (dispatch[0]["pid"], dispatch[0]["tid"])]
    slowest = sorted(dispatch, key=lambda e: -e["dur"])[:3]
    return {"programs": programs, "dispatch_ms": [round(e["dur"] / 1e3, 1) for e in dispatch],
            "slowest_dispatch_inside": [_inside(d, main) for d in slowest],
            "step_starts_s": [round(s - wall_zero, 3) for s in step_starts]}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/tpu-save-profile"))
    p.add_argument("--out", type=Path, default=Path("/tmp/tpu-save-profile"))
    p.add_argument("--shape", default="3b", choices=sorted(tb.SHAPES), help="widths (tiny: a smoke run on CPU)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--micro", type=int, default=1)
    p.add_argument("--accumulation", type=int, default=8)
    args = p.parse_args()

    import jax

    from lora_trainer import async_saves, checkpoint, checkpoint_metadata, tunix_trainer
    from lora_trainer.lora import lora_state

    trainer, _ = tb._study_trainer(tb._study_model(args.work, args.shape, args.layers), "dots", splash=jax.default_backend() == "tpu")
    seq = 2048 if args.shape != "tiny" else 128
    batches = [tb._study_batch(args.micro, seq, seed=i) for i in range(args.accumulation)]
    result: dict[str, Any] = {"compile": tb._timed_step(trainer, batches), "steady": [tb._timed_step(trainer, batches) for _ in range(3)]}
    store = checkpoint.TrainingCheckpoints(str(args.work / f"checkpoints-{time.time_ns()}"), keep=2)
    metadata = {k: "study" for k in checkpoint_metadata.METADATA_KEYS}
    thread = ThreadPoolExecutor(max_workers=1)

    def save(snapshot: dict[str, Any], step: int) -> tuple[float, float]:
        start = time.perf_counter()
        on_host = async_saves._on_host(snapshot)
        copied = time.perf_counter()
        store.save(step, lora=on_host["lora"], optimizer=on_host["optimizer"], data={}, metadata=metadata)
        return copied - start, time.perf_counter() - copied

    trace_dir = args.out / "trace"
    jax.profiler.start_trace(str(trace_dir), create_perfetto_trace=True)
    times, starts, handoff = [], [], None
    for i in range(6):
        if i == 2:
            snapshot = {"lora": async_saves._device_copy(lora_state(trainer.model)),
                        "optimizer": async_saves._device_copy(tunix_trainer.optimizer_state(trainer))}  # fmt: skip
            handoff = thread.submit(save, snapshot, i)
        starts.append(time.perf_counter())
        times.append(tb._timed_step(trainer, batches))
    assert handoff is not None
    result["steps"], result["save_host_copy_and_orbax_call"] = times, handoff.result()
    store.wait()
    jax.profiler.stop_trace()
    (trace,) = trace_dir.rglob("perfetto_trace.json.gz")
    result["trace"] = _trace_summary(trace, starts, starts[0])
    programs = [x for x in result["trace"]["programs"] if x["name"] == "jit__train_step"]
    result["program_ms_median"] = statistics.median(x["ms"] for x in programs) if programs else None  # no device track on CPU
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "save-profile.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "trace"}))
    print("idle gaps before each program (ms):", [x["idle_before_ms"] for x in result["trace"]["programs"]])
    print("main thread's dispatch per micro-batch (ms):", result["trace"]["dispatch_ms"])
    print("inside the slowest dispatches (ms):", json.dumps(result["trace"]["slowest_dispatch_inside"], indent=1))


if __name__ == "__main__":
    main()
