"""The trainer on a real TPU chip: tokens/s, MFU, compile time (cold and warm), memory, checkpoint cost.

Run by hand on a machine with one TPU chip (never in CI), e.g. through the `device` tool:

    python bench/tpu_throughput.py --out /tmp/tpu-bench [--cases 1b-lora,3b-lora,8b-qlora,...] [--check] [--study]

Each case writes a random Llama-shaped HF checkpoint (bfloat16 safetensors, a small BPE
tokenizer; shapes of Llama-3.2-1B, Llama-3.2-3B and Llama-3.1-8B) and runs the real
`lora-trainer train --config` in a subprocess, as a user would: short text rows packed into
`seq`-token sequences (the "fill" is the share of real tokens), LoRA rank 16 (alpha 32) on all
seven projections, AdamW, bfloat16 base. It reads the trainer's own progress lines (tokens/s,
MFU, step time) and log lines (compile time, compiled memory; JAX's log of every compile and
cache hit), and times from the process start to the first finished step. A case is preempted
(SIGTERM) after STEPS steps and then runs again with the same config, resuming from the
SIGTERM's checkpoint with the compilation cache warm: the restart's time to its first step. The `full-ft` case trains every weight of the same model (bfloat16 AdamW
moments) in a bare jitted step of the same loss, kernels and rematerialisation.

MFU is the trainer's (`lora_trainer.metrics`): model FLOPs per token = 4 x (base matmul
parameters, the LM head included, the embedding lookup not) + 6 x LoRA parameters +
attention (2 x 2 x seq x heads x head_dim per layer forward, halved by causality, x3 for forward
and backward); a full fine-tune counts 6 x parameters instead of 4. Rematerialised work is not
counted (it is not model FLOPs). Peak: 197 TFLOP/s bf16 for a v5e chip.

`--check` first compares the splash kernel with the XLA attention in bfloat16 on the chip;
`--study`, `--qlora-memory` and `--save-overlap` first run the few-layer studies of the step's
variants, of QLoRA's memory and of what a background save costs the steps it overlaps;
`--splash-tilings` times the attention kernel's tilings, and `--step-profiles` traces the whole 1B
step (16 layers, queued), an 8-layer 1B step and a 4-layer 8B QLoRA step and sums the chip's time by
kind of op (attention kernel, projections, LoRA's rank-r products, the LM head, the rest by the ops
fused in it), with how much of the traced span the chip was busy.
Results go to `<out>/results.json` as each case ends; `--write` also rewrites the "TPU"
section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "trainer_image"))
import report  # noqa: E402  (bench/ is on sys.path when a script here runs)
from lora_trainer.exit_codes import PREEMPTED  # noqa: E402  (light: no JAX)

SECTION = "## TPU"

#: HF config.json of each shape (random weights; Llama 3.x layouts and rope).
SHAPES: dict[str, dict[str, Any]] = {
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True},
    "3b": {"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24,
           "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True},
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False},
    # A few-second model to check this harness on a CPU (`--cases tiny-lora,tiny-full-ft`).
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": False, "vocab_size": 4096},
}
COMMON = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_act": "silu",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "attention_bias": False,
    "mlp_bias": False, "torch_dtype": "bfloat16",
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}

#: name -> (shape, seq, micro-batch, accumulation, extra train-config fields). Steps: 1 compiling + timed ones.
CASES: dict[str, tuple[str, int, int, int, dict[str, Any]]] = {
    "1b-lora": ("1b", 2048, 4, 2, {}),
    "1b-lora-xla": ("1b", 2048, 4, 2, {"training": {"attention": "xla"}}),
    "1b-qlora": ("1b", 2048, 4, 2, {"lora": {"quantization": {"weightQtype": "nf4", "tileSize": 64}}}),
    "3b-lora": ("3b", 2048, 2, 4, {}),
    # `dots` keeps each layer's products, nearly what `none` keeps: half the micro-batch of `full` (`auto`).
    "1b-lora-dots": ("1b", 2048, 2, 4, {"training": {"remat": "dots"}}),
    # The target's micro-batch: fits under `dots` since the loss no longer keeps whole logits (`fused_head`).
    "1b-lora-dots-mb4": ("1b", 2048, 4, 2, {"training": {"remat": "dots"}}),
    "1b-lora-none-mb4": ("1b", 2048, 4, 2, {"training": {"remat": "none"}}),
    # Its QLoRA twin, for the QLoRA / LoRA step ratio at the fastest LoRA settings.
    "1b-qlora-none-mb4": ("1b", 2048, 4, 2, {"lora": {"quantization": {"weightQtype": "nf4", "tileSize": 64}},
                                             "training": {"remat": "none"}}),
    "3b-lora-dots": ("3b", 2048, 1, 8, {"training": {"remat": "dots"}}),
    # Scanned layers (`training.scanLayers`), against the unrolled cases above.
    "1b-lora-dots-scanned": ("1b", 2048, 2, 4, {"training": {"remat": "dots", "scanLayers": True}}),
    "3b-lora-dots-scanned": ("3b", 2048, 1, 8, {"training": {"remat": "dots", "scanLayers": True}}),
    "3b-lora-full": ("3b", 2048, 4, 2, {"training": {"remat": "full"}}),
    "3b-qlora": ("3b", 2048, 2, 4, {"lora": {"quantization": {"weightQtype": "nf4", "tileSize": 64}}}),
    # `full`: `dots` keeps ~0.35 GB of products per layer at micro-batch 2 (11 GB for 32 layers), which
    # with the ~5.4 GiB quantized base cannot fit in 15.7 GiB; `full` keeps each layer's input (1 GB in all).
    # Scanned: 32 unrolled QLoRA layers would compile for about 13 minutes (16 took 390 s).
    "8b-qlora": ("8b", 2048, 2, 4, {"lora": {"quantization": {"weightQtype": "nf4", "tileSize": 64}},
                                    "training": {"remat": "full", "scanLayers": True}}),
    # The same under `dots` at micro-batch 1: the layers' products (~0.18 GB each at 1 x 2048) kept
    # rather than the forward run again with its dequantizations; the logits no longer kept (`fused_head`).
    "8b-qlora-dots": ("8b", 2048, 1, 8, {"lora": {"quantization": {"weightQtype": "nf4", "tileSize": 64}},
                                         "training": {"remat": "dots", "scanLayers": True}}),
    # Larger micro-batches: a QLoRA micro-batch dequantizes every weight whatever its size (1 x 8 under
    # `dots` ran slower than 2 x 4 under `full`); 4 x 2 fits under `full` since the logits are not kept (12.44 GiB).
    "8b-qlora-mb4": ("8b", 2048, 4, 2, {"lora": {"quantization": {"weightQtype": "nf4", "tileSize": 64}},
                                        "training": {"remat": "full", "scanLayers": True}}),
    "1b-full-ft": ("1b", 2048, 2, 1, {}),
    "tiny-lora": ("tiny", 256, 2, 2, {}),
    "tiny-full-ft": ("tiny", 256, 2, 1, {}),
}
STEPS, CHECKPOINT_EVERY = 12, 4
PEAK = 197e12


# --------------------------------------------------------------------------- inputs


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """A safetensors file (bfloat16), written directly: no torch on the TPU machine."""
    header, offset = {}, 0
    for name, array in tensors.items():
        header[name] = {"dtype": "BF16", "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with path.open("wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for array in tensors.values():
            f.write(array.tobytes())


def write_checkpoint(shape: str, directory: Path) -> Path:
    """A random Llama checkpoint of `shape` (one safetensors file per layer), unless already there."""
    import ml_dtypes

    from lora_trainer.tiny_models import build_tokenizer

    if (directory / "config.json").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    cfg = {**COMMON, **SHAPES[shape]}
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    n, k, h = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    pool = (np.random.default_rng(0).standard_normal(1 << 24, np.float32) * 0.02).astype(ml_dtypes.bfloat16)

    @functools.cache
    def rand(*dims: int) -> np.ndarray:  # random values without drawing billions of numbers: one per shape, from a pool
        size = int(np.prod(dims))
        start = int(np.random.default_rng(size).integers(0, pool.size))
        return np.resize(np.roll(pool, -start), size).reshape(dims)

    ones = np.ones(d, ml_dtypes.bfloat16)
    files: dict[str, dict[str, np.ndarray]] = {"model-embed.safetensors": {"model.embed_tokens.weight": rand(v, d), "model.norm.weight": ones}}
    if not cfg["tie_word_embeddings"]:
        files["model-embed.safetensors"]["lm_head.weight"] = rand(v, d)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        files[f"model-layer{i:03d}.safetensors"] = {
            p + "self_attn.q_proj.weight": rand(n * h, d), p + "self_attn.k_proj.weight": rand(k * h, d),
            p + "self_attn.v_proj.weight": rand(k * h, d), p + "self_attn.o_proj.weight": rand(d, n * h),
            p + "mlp.gate_proj.weight": rand(f, d), p + "mlp.up_proj.weight": rand(f, d), p + "mlp.down_proj.weight": rand(d, f),
            p + "input_layernorm.weight": ones, p + "post_attention_layernorm.weight": ones,
        }
    weight_map = {}
    for name, tensors in files.items():
        _write_safetensors(directory / name, tensors)
        weight_map.update(dict.fromkeys(tensors, name))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    tokenizer = build_tokenizer(4096)
    cfg.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    tokenizer.save_pretrained(directory)
    return directory


def write_dataset(path: Path, rows: int = 12000) -> Path:
    """Plain text rows of 20-160 random words (about 80-650 tokens), which the trainer packs into full sequences.

    Why this length: packing puts whole rows into a sequence, so rows close to half the sequence
    leave it half empty (rows of 300 words, about 1,216 tokens, filled 59% of each 2048-token
    sequence: the padding is computed but not counted as tokens); short rows fill it to ~98%.
    """
    if not path.exists():
        rng = np.random.default_rng(0)
        words = ["alpha", "beta", "gamma", "delta", "tensor", "chip", "matrix", "adapter", "rank", "token", "layer", "model"]
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for _ in range(rows):
                f.write(json.dumps({"text": " ".join(rng.choice(words, int(rng.integers(20, 161))))}) + "\n")
    return path


def train_config(case: str, model: Path, data: Path, out: Path, steps: int) -> dict[str, Any]:
    shape, seq, micro, accumulation, extra = CASES[case]
    cfg: dict[str, Any] = {
        "model": {"source": str(model), "dtype": "bfloat16"},
        "dataset": {"train": str(data), "format": "text", "maxSeqLen": seq, "packing": True},
        "lora": {"rank": 16, "alpha": 32.0},
        "training": {"steps": steps, "globalBatchSize": micro * accumulation, "gradientAccumulation": accumulation,
                     "learningRate": 1e-4, "checkpointEvery": CHECKPOINT_EVERY, "logEvery": 1, "schedule": "constant"},
        "output": {"uri": str(out)},
    }
    for section, fields in extra.items():
        cfg[section] = {**cfg[section], **fields}
    return cfg


# --------------------------------------------------------------------------- running


def _record(line: str) -> dict[str, Any] | None:
    """A progress record, or None: other output, or a record a log line from another thread (stderr
    shares the pipe) was written into."""
    if not line.startswith("{"):
        return None
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def _run(argv: list[str], log: Path, timeout: float, *, sigterm_after: int | None = None) -> dict[str, Any]:
    """Run a trainer process; time each stdout progress line and the first step's log line from its start.

    `sigterm_after`: send SIGTERM once the progress line of that step is out, as a preemption
    would (the trainer saves that step and exits 43), so the restart can resume with the same
    config, hence the same programs, and hit the persistent compilation cache.
    """
    start = time.perf_counter()
    env = {**os.environ, "JAX_LOG_COMPILES": "1"}  # every compile and cache hit, with its time, in the log
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env)
    lines: list[tuple[float, str]] = []
    assert proc.stdout is not None
    with log.open("w") as f:
        for line in proc.stdout:
            lines.append((time.perf_counter() - start, line))
            f.write(line)
            f.flush()
            if sigterm_after is not None and (_record(line) or {}).get("step") == sigterm_after:
                proc.send_signal(signal.SIGTERM)
            if time.perf_counter() - start > timeout:
                proc.kill()
                break
    code = proc.wait()
    return {"code": code, "lines": lines, "seconds": time.perf_counter() - start}


def _compiles(text: str) -> dict[str, Any]:
    """JAX's compile log (JAX_LOG_COMPILES): how many programs were compiled, for how long, and cache hits."""
    done = [(name, float(s)) for name, s in re.findall(r"Finished XLA compilation of (\S+) in ([\d.]+) ?s", text)]
    return {
        "compiles": len(done),
        "compile_seconds": round(sum(s for _, s in done), 1),
        "slowest": [f"{name} {s:.1f}s" for name, s in sorted(done, key=lambda x: -x[1])[:5]],
        "cache_hits": len(re.findall(r"[Pp]ersistent compilation cache hit", text)),
    }


#: A start's milestones, each the first output line matching: where a (warm) restart's time goes.
TIMELINE = {
    "run_began": r"compiled programs are cached in",  # imports done, the runtime up (`backend_start`)
    "base_built": r"INFO lora_trainer\.train: built the ",  # placeholders: the weights are read after the step begins compiling
    "base_loaded": r"INFO lora_trainer\.train: loaded the ",
    "step_preloaded": r"loaded the train step compiled earlier",  # `step_preload`, on its thread
    "step_record_loaded": r"loaded the compiled train step ",  # `step_record`, the run's own step, on its thread
    "step_record_taken": r"not traced again",  # the compile-ahead thread took it: no trace, no lowering
    "lora_added": r"added LoRA ",
    "step_traced": r"Finished tracing _train_step ",  # the compile-ahead thread
    "step_lowered": r"Finished jaxpr to MLIR module conversion jit\(_train_step\)",
    "step_compiled_or_read": r"Finished XLA compilation of jit\(_train_step\)",
    "restored": r"resuming from step ",
    "first_step_done": r"compiled the train step and ran in",
}


def timeline(lines: list[tuple[float, str]]) -> dict[str, float]:
    """Seconds from the process's start to each `TIMELINE` milestone its output reached."""
    reached: dict[str, float] = {}
    for t, line in lines:
        for name, pattern in TIMELINE.items():
            if name not in reached and re.search(pattern, line):
                reached[name] = round(t, 2)
    return reached


def _summary(run: dict[str, Any], case: str) -> dict[str, Any]:
    """What a trainer run's output says: step times, tokens/s, MFU, compile time, memory, checkpoint cost."""
    text = "".join(line for _, line in run["lines"])
    progress = [(t, r) for t, line in run["lines"] if (r := _record(line)) and "step" in r]
    first = re.search(r"step (\d+) compiled the train step and ran in ([\d.]+)s", text)
    first_at = next((t for t, line in run["lines"] if "compiled the train step" in line), None)
    memory = re.search(r"train step memory per device: (.*)", text)
    # Not the first record (its step compiled) nor the last: the trainer writes a step's record once
    # the next step is queued, but the last one at once, so the last interval is short by that lag
    # (a restart's two timed steps read 0.98 s and 0.48 s on the v5e).
    timed = [r for _, r in progress[1:-1] if r.get("stepTimeSeconds")]
    # Wall time between progress lines (each waits for its step): a save's snapshot blocks between
    # the line of the step it saves and the next one, the rest of it overlaps the next steps.
    gaps = {r["step"]: t - t0 for (t0, _), (t, r) in zip(progress, progress[1:])}
    plain = [gaps[s] for s in gaps if (s - 1) % CHECKPOINT_EVERY]
    out: dict[str, Any] = {
        "exit": run["code"],
        "load": _seconds(r"INFO lora_trainer\.train: loaded the .* in ([\d.]+)s", text),  # the base (not step_preload's line)
        "lora": _seconds(r"added LoRA .* in ([\d.]+)s", text),
        "first_step": float(first.group(2)) if first else None,
        "start_to_first_step": first_at,
        "timeline": timeline(run["lines"]),
        "phases": [line.strip() for _, line in run["lines"] if line.startswith("[t] ")] or None,  # `start_timeline.py`
        "memory": memory.group(1) if memory else None,
        "step_seconds": statistics.median(r["stepTimeSeconds"] for r in timed) if timed else None,
        "tokens_per_second": statistics.median(r["tokensPerSecond"] for r in timed) if timed else None,
        "mfu": _median([r["mfu"] for r in timed if r.get("mfu") is not None]),
    }
    _, seq, micro, accumulation, _ = CASES[case]
    if timed:  # counted tokens over computed positions
        out["fill"] = statistics.median(r["tokensPerSecond"] * r["stepTimeSeconds"] for r in timed) / (micro * accumulation * seq)
    out.update(_compiles(text))
    if plain:
        # What a save adds: the wall time of the CHECKPOINT_EVERY steps after it (its snapshot, then its
        # host copy and Orbax's work on the save thread) over as many plain steps. A process's first save
        # is reported apart (until the sixth session it also compiled the device copy).
        base = statistics.median(plain)
        extra = [sum(gaps[s] - base for s in range(after, after + CHECKPOINT_EVERY))
                 for after in sorted(gaps) if (after - 1) % CHECKPOINT_EVERY == 0 and after > 1
                 and all(s in gaps for s in range(after, after + CHECKPOINT_EVERY))]  # fmt: skip
        if extra:
            out["first_save_extra_seconds"] = extra[0]
        if len(extra) > 1:
            out["save_extra_seconds"] = statistics.mean(extra[1:])
            out["save_extra_percent_of_interval"] = 100 * out["save_extra_seconds"] / (base * CHECKPOINT_EVERY)
    if run["code"] not in (0, PREEMPTED):
        out["tail"] = text[-2000:]
    return out


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _seconds(pattern: str, text: str) -> float | None:
    m = re.search(pattern, text)
    return float(m.group(1)) if m else None


#: `lora-trainer train` with `background.prompt_handoffs`' switch interval set to the first argument
#: (the restart variants of `--restart-intervals`); the rest of the command line is the CLI's.
_CLI_AT_INTERVAL = ("import sys; from lora_trainer import background; "
                    "background.prompt_handoffs.__defaults__ = (float(sys.argv.pop(1)),); "
                    "from lora_trainer.cli import main; sys.exit(main())")


def run_case(case: str, work: Path, logs: Path, timeout: float, *, restart: bool = True,
             intervals: tuple[float, ...] = (), traced: bool = False, timed: bool = False) -> dict[str, Any]:
    """Run `case` (a cold start, preempted, then a warm restart); each process's log is written to `logs`
    as it runs, so a command stopped at the device's time limit still brings back what ran.

    Variants of the warm restart, each from its own copy of the preempted run's output (checkpoint,
    compilation cache, tokenized data), on the same machine as the plain restart:
    `intervals`: once for each GIL switch interval given to the start-up's overlap
    (`background.prompt_handoffs`); `traced`: once without the run's step record, so the step is
    traced and lowered to find JAX's cache entry, as before `step_record`; `timed`: once with every
    thread's start-up pieces timed (`start_timeline.py`, its lines under "phases")."""
    shape, *_ = CASES[case]
    model = write_checkpoint(shape, work / f"model-{shape}")
    data = write_dataset(work / "data.jsonl")
    out = work / f"run-{case}"
    cfg_path = work / f"{case}.json"
    if case.endswith("full-ft"):
        cfg_path.write_text(json.dumps(train_config(case, model, data, out, STEPS)))
        cold = _run([sys.executable, __file__, "--full-ft-worker", str(cfg_path)], logs / f"{case}.log", timeout)
        return {"case": case, "cold": _summary(cold, case)}
    # Preempted (SIGTERM) after STEPS steps, then restarted with the same config: it resumes from
    # the SIGTERM's checkpoint, with the compilation cache warm.
    cfg_path.write_text(json.dumps(train_config(case, model, data, out, STEPS + 3)))
    argv = [sys.executable, "-m", "lora_trainer.cli", "train", "--config", str(cfg_path)]
    cold = _run(argv, logs / f"{case}.log", timeout, sigterm_after=STEPS)
    result = {"case": case, "cold": _summary(cold, case)}
    if restart and cold["code"] == PREEMPTED:

        def copied(label: str) -> tuple[Path, Path]:
            """The preempted run copied (before the plain restart trains on), and the config training into the copy."""
            copy = work / f"run-{case}-{label}"
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(out, copy)
            variant_cfg = work / f"{case}-{label}.json"
            variant_cfg.write_text(json.dumps(train_config(case, model, data, copy, STEPS + 3)))
            return copy, variant_cfg

        variants = {}  # label -> the CLI's command line for that variant
        for interval in intervals:
            label = f"handoffs_{interval * 1e3:g}ms"
            _, variant_cfg = copied(label)
            variants[label] = [sys.executable, "-c", _CLI_AT_INTERVAL, str(interval), "train", "--config", str(variant_cfg)]
        if traced:
            from lora_trainer import step_record  # imports JAX, which this process leaves alone otherwise

            copy, variant_cfg = copied("traced")
            for record in (copy / "compilation-cache").glob(step_record.RECORDS):
                record.unlink()
            variants["traced"] = [*argv[:-1], str(variant_cfg)]
        if timed:
            _, variant_cfg = copied("timed")
            variants["timed"] = [sys.executable, str(Path(__file__).with_name("start_timeline.py")), "train", "--config", str(variant_cfg)]
        result["warm"] = _summary(_run(argv, logs / f"{case}-warm.log", timeout), case)
        for label, variant_argv in variants.items():
            result[f"warm_{label}"] = _summary(_run(variant_argv, logs / f"{case}-warm-{label}.log", timeout), case)
    return result


# --------------------------------------------------------------------------- full fine-tune (comparison)


def full_ft_worker(config: Path) -> None:
    """Every weight trained, in a bare jitted step of the trainer's loss, kernels and rematerialisation;
    prints progress lines as the trainer does (the same summary reads them)."""
    import jax
    import optax
    from flax import nnx

    from lora_trainer import data as data_lib
    from lora_trainer import metrics
    from lora_trainer.config import TrainConfig
    from lora_trainer.loss import lm_loss, model_inputs
    from lora_trainer.models import load_model, remat
    from lora_trainer.models.attention import choose_kernel

    cfg = TrainConfig.model_validate(json.loads(config.read_text()))
    t = cfg.training
    loaded = load_model(cfg.model.source, dtype=cfg.model.dtype)
    model = loaded.model
    remat.apply(model, remat.resolve(t.remat, jax.default_backend()))
    splash = choose_kernel(t.attention, jax.default_backend()) == "splash"
    optimizer = nnx.Optimizer(model, optax.adamw(t.learning_rate, mu_dtype="bfloat16"), wrt=nnx.Param)
    tokenizer = data_lib.load_tokenizer(loaded.local_dir)
    seqs = data_lib.to_sequences(data_lib.tokenize_file(cfg.dataset.train, cfg.dataset, tokenizer), cfg.dataset)
    stream = data_lib.BatchStream(seqs, global_batch=t.global_batch_size, seq_len=cfg.dataset.max_seq_len, seed=0,
                                  pad_id=tokenizer.pad_token_id)

    @nnx.jit(donate_argnums=(0, 1))
    def step(model: nnx.Module, optimizer: nnx.Optimizer, batch: dict[str, jax.Array]) -> jax.Array:
        inputs = model_inputs(batch, splash=splash)
        loss, grads = nnx.value_and_grad(lambda m: lm_loss(m, **inputs)[0])(model)
        optimizer.update(model, grads)
        return loss

    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    hf = loaded.hf_config
    lookup = 0 if hf.get("tie_word_embeddings") else hf["hidden_size"] * hf["vocab_size"]
    lora_flops = metrics.lora_train_flops_per_token(
        matmul_params=params - lookup, lora_params=0, num_layers=hf["num_hidden_layers"],
        attn_width=hf["num_attention_heads"] * hf["head_dim"], seq_len=cfg.dataset.max_seq_len)
    flops = lora_flops + 2.0 * (params - lookup)  # weight gradients too: 6N
    tokens = t.global_batch_size * cfg.dataset.max_seq_len
    start = time.perf_counter()
    for i in range(t.steps):
        batch = {k: jax.numpy.asarray(v) for k, v in next(stream).items() if k != "loss_norm"}
        loss = float(step(model, optimizer, batch))
        now = time.perf_counter()
        if i == 0:
            print(f"step 1 compiled the train step and ran in {now - start:.1f}s", file=sys.stderr, flush=True)
            stats = step.lower(model, optimizer, batch).compile().memory_analysis()
            peak = stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes + stats.temp_size_in_bytes
            print(f"train step memory per device: {peak / 2**30:.2f} GiB at peak", file=sys.stderr, flush=True)
            dt = None
        else:
            dt = now - start
        print(json.dumps({"step": i + 1, "loss": loss, "stepTimeSeconds": dt, "tokensPerSecond": tokens / dt if dt else None,
                          "mfu": tokens / dt * flops / PEAK if dt else None}), flush=True)
        start = now


# --------------------------------------------------------------------------- splash check


def check_splash() -> dict[str, Any]:
    """The splash kernel against the XLA attention in bfloat16 on the chip: max error relative to the
    largest magnitude, for the output and the three gradients, on the 1B and 8B attention shapes."""
    import jax
    import jax.numpy as jnp

    from lora_trainer.models.attention import SegmentMask, causal_gqa_attention

    results = {}
    for name, (b, t, n, kv, d) in {"1b": (2, 2048, 32, 8, 64), "8b": (1, 2048, 32, 8, 128)}.items():
        keys = jax.random.split(jax.random.key(0), 4)
        q = jax.random.normal(keys[0], (b, t, n, d), jnp.bfloat16)
        k = jax.random.normal(keys[1], (b, t, kv, d), jnp.bfloat16)
        v = jax.random.normal(keys[2], (b, t, kv, d), jnp.bfloat16)
        seg = jnp.concatenate([jnp.ones((b, t - 500), jnp.int32), 2 * jnp.ones((b, 400), jnp.int32), jnp.zeros((b, 100), jnp.int32)], 1)
        dense = jnp.tril(jnp.ones((t, t), bool))[None] & (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)
        real = (seg > 0)[:, :, None, None]
        g = jax.random.normal(keys[3], q.shape, jnp.bfloat16) * real

        def f(q: jax.Array, k: jax.Array, v: jax.Array, mask: Any) -> tuple[jax.Array, Any]:
            out, vjp = jax.vjp(lambda q, k, v: causal_gqa_attention(q, k, v, mask, d**-0.5), q, k, v)
            return out * real, vjp(g)

        ref, xla = jax.jit(f)(q, k, v, dense)
        got, spl = jax.jit(f)(q, k, v, SegmentMask(seg))
        rel = lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) / jnp.max(jnp.abs(b.astype(jnp.float32))))  # noqa: E731
        results[name] = {"out": rel(got, ref), "dq": rel(spl[0], xla[0]), "dk": rel(spl[1], xla[1]), "dv": rel(spl[2], xla[2])}
    return results


# --------------------------------------------------------------------------- where the step's time goes


#: (attention kernel, remat policy, micro-batch, LM head) of the study: one variable at a time. The
#: XLA attention's rows (2026-12-05: 12-19% slower per token than splash) and the other policies'
#: are in docs/benchmarks.md. "logits" is the loss from whole logits, as before `fused_head`.
STUDY = [("splash", "dots", 4, "logits"), ("splash", "dots", 4, "fused"), ("splash", "none", 4, "logits"), ("splash", "none", 4, "fused")]


def _study_model(work: Path, shape: str, layers: int) -> Path:
    """A random checkpoint of `shape`'s widths with `layers` decoder layers (short compiles)."""
    name = f"{shape}-{layers}layers"
    SHAPES[name] = {**SHAPES[shape], "num_hidden_layers": layers}
    return write_checkpoint(name, work / f"model-{name}")


def _study_batch(micro: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    """One packed-looking micro-batch of random tokens, every position real."""
    rng = np.random.default_rng(seed)
    return {"input_tokens": rng.integers(3, 4000, (micro, seq)).astype(np.int32), "input_mask": np.ones((micro, seq), np.int32),
            "segment_ids": np.ones((micro, seq), np.int32), "positions": np.broadcast_to(np.arange(seq), (micro, seq)).astype(np.int32)}


def _study_trainer(model_dir: Path, policy: str, *, splash: bool, quantization: Any = None) -> tuple[Any, Any]:
    """(trainer, loaded model): the production step (`tunix_trainer.make_trainer`) with LoRA r16 on all projections.
    Loaded again for each: a trained model's arrays are donated."""
    from lora_trainer.config import LoraSpec, TrainingSpec
    from lora_trainer.lora import apply_lora
    from lora_trainer.models import load_model, remat
    from lora_trainer.tunix_trainer import make_trainer

    loaded = load_model(str(model_dir), dtype="bfloat16")
    model = apply_lora(loaded.model, LoraSpec(rank=16, alpha=32.0, quantization=quantization), loaded.family, seed=0).model
    remat.apply(model, policy)
    trainer = make_trainer(model, TrainingSpec(steps=1000, learning_rate=1e-4, schedule="constant"), splash=splash)
    return trainer, loaded


@contextlib.contextmanager
def _head(kind: str) -> Iterator[None]:
    """The LM head as the study's row asks: "fused" (the trainer's), or "logits" (no head defers, so
    the loss is computed from whole logits, the path before `fused_head`)."""
    from lora_trainer import fused_head

    if kind == "fused":
        yield
        return
    defer = fused_head.defer
    fused_head.defer = lambda *args, **kwargs: None
    try:
        yield
    finally:
        fused_head.defer = defer


def _timed_step(trainer: Any, micro_batches: list[dict[str, np.ndarray]]) -> float:
    start = time.perf_counter()
    trainer.train([dict(b) for b in micro_batches])
    float(trainer.train_aux[-1]["loss"])
    return time.perf_counter() - start


def study(work: Path, shape: str = "1b", layers: int = 4, seq: int = 2048) -> list[dict[str, Any]]:
    """The production step on `shape`'s widths with `layers` layers, one micro-batch per step, for
    each kernel / remat / micro-batch of `STUDY`."""
    import jax
    import jax.numpy as jnp

    from lora_trainer import train
    from lora_trainer.tunix_trainer import compiled_memory

    model_dir = _study_model(work, shape, layers)
    rows = []
    for kernel, policy, micro, head in STUDY:
        batch = _study_batch(micro, seq, seed=micro)
        trainer, loaded = _study_trainer(model_dir, policy, splash=kernel == "splash")
        with _head(head):
            compile_seconds = _timed_step(trainer, [batch])
            seconds = statistics.median(_timed_step(trainer, [batch]) for _ in range(5))
            memory = compiled_memory(trainer, {k: jnp.asarray(v) for k, v in batch.items()})
        tokens_per_second = micro * seq / seconds
        flops = train._flops_per_token(trainer.model, loaded.hf_config, seq)
        rows.append({"attention": kernel, "remat": policy, "micro": micro, "head": head, "step": seconds,
                     "tokens_per_second": tokens_per_second, "mfu": tokens_per_second * flops / PEAK, "compile": compile_seconds,
                     "memory": memory})
        print(json.dumps(rows[-1]), flush=True)
        del trainer, loaded
        jax.clear_caches()
    return rows


#: (shape, layers, micro-batch, remat, product) of the QLoRA memory study: "lora" is the bf16 base;
#: "qwix" and "ours" are nf4 QLoRA with Qwix's frozen product or `lora_trainer.quantized_product`.
QLORA_STUDY = [("1b", 4, 4, "dots", "lora"), ("1b", 4, 4, "dots", "qwix"), ("1b", 4, 4, "dots", "ours"),
               ("8b", 2, 2, "full", "ours"), ("8b", 4, 2, "full", "ours")]


def qlora_memory(work: Path, seq: int = 2048) -> list[dict[str, Any]]:
    """Compiled memory (arguments, temporaries) and step time of the QLoRA step against LoRA, by frozen
    product, on few layers: the per-layer growth says what a whole model needs."""
    import jax
    import jax.numpy as jnp
    from qwix._src.core import dot_general as qwix_dot_general
    from qwix._src.core import einsum as qwix_einsum

    from lora_trainer import quantized_product
    from lora_trainer.config import QuantizationSpec

    ours = quantized_product.dot_general, quantized_product.einsum
    rows = []
    for shape, layers, micro, policy, product in QLORA_STUDY:
        batch = _study_batch(micro, seq)
        quantized_product.dot_general, quantized_product.einsum = (
            (qwix_dot_general.dot_general, qwix_einsum.einsum) if product == "qwix" else ours)
        quantization = None if product == "lora" else QuantizationSpec(weight_qtype="nf4", tile_size=64)
        try:
            trainer, _ = _study_trainer(_study_model(work, shape, layers), policy, splash=jax.default_backend() == "tpu",
                                        quantization=quantization)
        finally:
            quantized_product.dot_general, quantized_product.einsum = ours
        trainer.jit_train_and_eval_step()
        inputs = trainer._prepare_inputs({k: jnp.asarray(v) for k, v in batch.items()})
        stats = trainer.train_step.lower(inputs).compile().memory_analysis()
        _timed_step(trainer, [batch])
        rows.append({"shape": shape, "layers": layers, "micro": micro, "remat": policy, "product": product,
                     "arguments_gib": stats.argument_size_in_bytes / 2**30, "temporaries_gib": stats.temp_size_in_bytes / 2**30,
                     "step": statistics.median(_timed_step(trainer, [batch]) for _ in range(3))})
        print(json.dumps(rows[-1]), flush=True)
        del trainer
        jax.clear_caches()
    return rows


#: How the save thread hands a snapshot to Orbax: no save; device arrays (with Python's default and a
#: 0.1 ms GIL switch interval); host arrays from one `jax.device_get` (what `async_saves` does).
SAVE_MODES = ["none", "device-arrays", "device-arrays-fast-switch", "host-arrays"]


def save_overlap(work: Path, shape: str = "3b", layers: int = 8, micro: int = 2, accumulation: int = 4,
                 steps: int = 10, seq: int = 2048) -> list[dict[str, Any]]:
    """What a save on the background thread adds to the steps it overlaps, by what it hands Orbax:
    a snapshot every 4 steps, copied on the device as `async_saves` does, saved by the real
    `checkpoint.TrainingCheckpoints` on one thread while the next steps run."""
    from concurrent.futures import ThreadPoolExecutor

    import jax

    from lora_trainer import async_saves, checkpoint, checkpoint_metadata, tunix_trainer
    from lora_trainer.lora import lora_state

    trainer, _ = _study_trainer(_study_model(work, shape, layers), "dots", splash=jax.default_backend() == "tpu")
    micro_batches = [_study_batch(micro, seq, seed=i) for i in range(accumulation)]
    compile_seconds = _timed_step(trainer, micro_batches)
    metadata = {k: "study" for k in checkpoint_metadata.METADATA_KEYS}
    thread = ThreadPoolExecutor(max_workers=1)
    rows = []
    for mode in SAVE_MODES:
        sys.setswitchinterval(1e-4 if mode.endswith("fast-switch") else 0.005)
        store = checkpoint.TrainingCheckpoints(str(work / f"saves-{mode}"), keep=2)

        def save(snapshot: dict[str, Any], step: int, mode: str = mode, store: Any = store) -> float:
            start = time.perf_counter()
            if mode == "host-arrays":
                snapshot = async_saves._on_host(snapshot)
            store.save(step, lora=snapshot["lora"], optimizer=snapshot["optimizer"], data={}, metadata=metadata)
            return time.perf_counter() - start

        times, saved, handoffs = [], [], []
        for i in range(steps):
            if mode != "none" and i % 4 == 2:
                snapshot = {"lora": async_saves._device_copy(lora_state(trainer.model)),
                            "optimizer": async_saves._device_copy(tunix_trainer.optimizer_state(trainer))}
                handoffs.append(thread.submit(save, snapshot, i))
                saved.append(i)
            times.append(_timed_step(trainer, micro_batches))
        handoff_seconds = [h.result() for h in handoffs]
        store.wait()
        rows.append({"mode": mode, "step": statistics.median(t for i, t in enumerate(times) if i not in saved),
                     "overlapping_steps": [times[i] for i in saved], "handoff_seconds": handoff_seconds,
                     "arrays": len(jax.tree.leaves(lora_state(trainer.model))) + len(jax.tree.leaves(tunix_trainer.optimizer_state(trainer))),
                     "compile": compile_seconds})
        print(json.dumps(rows[-1]), flush=True)
    sys.setswitchinterval(0.005)
    return rows


#: Splash kernel tilings of the sweep: name -> BlockSizes fields. "1024-fused" is the trainer's
#: (`models.splash`; "512" was, until the seventh session); "fused" computes dq in the dk/dv kernel; "seq-minor" keeps k and v with
#: the sequence on the lanes, where a 64-wide head fills half of a 128-lane row; "compute-512" works through
#: each block of 1024 keys in slices of 512 (twelfth session: 1.7% less time for 1B, 2.2% for 8B, one call).
SPLASH_TILINGS: dict[str, dict[str, Any]] = {
    "512": {"block": 512},
    "1024": {"block": 1024},
    "q512-kv1024": {"block": 512, "block_kv": 1024, "block_kv_dkv": 1024},
    "512-fused": {"block": 512, "fused": True},
    "1024-fused": {"block": 1024, "fused": True},
    "512-seq-minor": {"block": 512, "seq_minor": True},
    "512-fused-seq-minor": {"block": 512, "fused": True, "seq_minor": True},
    "1024-fused-seq-minor": {"block": 1024, "fused": True, "seq_minor": True},
    "1024-fused-compute-512": {"block": 1024, "fused": True, "compute": 512},
}


def _splash_blocks(tiling: dict[str, Any]) -> Any:
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    b = tiling["block"]
    layout = splash.QKVLayout.SEQ_MINOR if tiling.get("seq_minor") else splash.QKVLayout.HEAD_DIM_MINOR
    fused = tiling.get("fused", False)
    compute = tiling.get("compute", b)
    return splash.BlockSizes(
        block_q=b, block_kv=tiling.get("block_kv", b), block_kv_compute=compute, block_q_dkv=b,
        block_kv_dkv=tiling.get("block_kv_dkv", b), block_kv_dkv_compute=compute,
        block_q_dq=None if fused else b, block_kv_dq=None if fused else b, use_fused_bwd_kernel=fused,
        k_layout=layout, v_layout=layout)


def splash_tilings(work: Path, seq: int = 2048) -> list[dict[str, Any]]:
    """Forward and backward of one layer's attention through the splash kernel, by tiling
    (`SPLASH_TILINGS`), on the 1B (64-wide heads, micro-batch 4) and 8B (128-wide, micro-batch 2)
    shapes: median time and its largest difference from the first tiling's results. `work` is unused."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    rows = []
    for name, (b, n, kv, d) in {"1b": (4, 32, 8, 64), "8b": (2, 32, 8, 128)}.items():
        keys = jax.random.split(jax.random.key(0), 4)
        q, k, v = (jax.random.normal(keys[i], (b, h, seq, d), jnp.bfloat16) for i, h in enumerate((n, kv, kv)))
        g = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
        seg = splash.SegmentIds(q=jnp.ones((b, seq), jnp.int32), kv=jnp.ones((b, seq), jnp.int32))
        reference = None
        for tiling_name, tiling in SPLASH_TILINGS.items():
            try:
                with jax.ensure_compile_time_eval():
                    kernel = splash.make_splash_mha(mask=splash.MultiHeadMask([splash.CausalMask((seq, seq))] * n),
                                                    block_sizes=_splash_blocks(tiling), head_shards=1, q_seq_shards=1)

                @jax.jit
                def f(q: jax.Array, k: jax.Array, v: jax.Array, kernel: Any = kernel) -> Any:
                    out, vjp = jax.vjp(lambda q, k, v: jax.vmap(kernel)(q, k, v, seg), q, k, v)
                    return out, vjp(g)

                got = jax.block_until_ready(f(q, k, v))
                times = []
                for _ in range(10):
                    start = time.perf_counter()
                    jax.block_until_ready(f(q, k, v))
                    times.append(time.perf_counter() - start)
                reference = got if reference is None else reference
                err = max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))) for x, y in
                          zip(jax.tree.leaves(got), jax.tree.leaves(reference)))
                rows.append({"shape": name, "tiling": tiling_name, "ms": 1e3 * statistics.median(times), "max_abs_diff": err})
            except Exception as e:  # noqa: BLE001  (a tiling the kernel refuses is a row, not the end of the sweep)
                rows.append({"shape": name, "tiling": tiling_name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def nf4_decoding(work: Path, tokens: int = 4096) -> list[dict[str, Any]]:
    """One 8B MLP product with an nf4 weight (4096 x 14336, tiles of 64), forward and backward, with
    Qwix's decoding (a gather from the 16-value table) against the trainer's (`quantized_product.nf4_to_fp`,
    selects): the time each takes, and whether the values agree. `work` is unused."""
    import jax
    import jax.numpy as jnp
    from qwix._src.core import numerics, qarray

    from lora_trainer import quantized_product

    keys = jax.random.split(jax.random.key(0), 3)
    w = jax.random.normal(keys[0], (4096, 14336), jnp.bfloat16) * 0.02
    how = qarray.HowToQuantize(qtype="nf4", tiled_axes={0: 64}, channelwise_axes=[1])
    wq = jax.jit(lambda w: qarray.quantize(w, how))(w)
    x = jax.random.normal(keys[1], (tokens, 4096), jnp.bfloat16)
    g = jax.random.normal(keys[2], (tokens, 14336), jnp.bfloat16)
    dims = (((1,), (0,)), ((), ()))
    rows, outputs = [], []
    for name, decode in (("qwix-gather", quantized_product.QWIX_NF4_TO_FP), ("selects", quantized_product.nf4_to_fp)):
        numerics.nf4_to_fp = decode  # read when the product is traced, below
        try:
            @jax.jit
            def f(x: jax.Array, wq: Any) -> Any:
                out, vjp = jax.vjp(lambda x: quantized_product.dot_general(x, wq, dims), x)
                return out, vjp(g)[0]

            outputs.append(jax.block_until_ready(f(x, wq)))
            times = []
            for _ in range(10):
                start = time.perf_counter()
                jax.block_until_ready(f(x, wq))
                times.append(time.perf_counter() - start)
        finally:
            numerics.nf4_to_fp = quantized_product.nf4_to_fp
        # ideal: the forward and the activation-gradient products at peak
        rows.append({"decoding": name, "ms": 1e3 * statistics.median(times), "ideal_ms": 1e3 * 4 * tokens * 4096 * 14336 / PEAK})
    # The decoded values are equal bit for bit (tests); the products may differ in the order of their sums.
    rows[-1]["max_relative_difference"] = max(
        float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) / jnp.max(jnp.abs(b.astype(jnp.float32))))
        for a, b in zip(*outputs))
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


_HLO_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+?) ([\w\-]+)\((.*)$")
_HLO_COMP = re.compile(r"^%?([\w.\-]+) .*?\{\n(.*?)\n\}", re.S | re.M)


def hlo_kinds(hlo: str, rank: int, vocab: int) -> dict[str, tuple[str, str]]:
    """Each instruction of an optimized TPU HLO module -> (kind, its output shape). Pure.

    Kinds: `attention kernel` (a Pallas custom call), `lm head` (a product with a vocab-sized
    shape), `rank-r` (a product with a dim of the LoRA rank), `projection` (other products: TPU
    HLO spells them `convolution` or `dot`), else the sorted ops fused in it."""
    bodies = {m.group(1): m.group(2) for m in _HLO_COMP.finditer(hlo)}
    kinds: dict[str, tuple[str, str]] = {}
    for line in hlo.splitlines():
        m = _HLO_INSTR.match(line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        called = re.search(r"calls=%?([\w.\-]+)", rest)
        body = bodies.get(called.group(1), line) if called else line
        ops = sorted({o for o in re.findall(r"= \S+ ([\w\-]+)\(", body)} - {"parameter", "bitcast", "constant", "broadcast"}) or [op]
        dims = [[int(d) for d in x.split(",") if d] for x in re.findall(r"\w+\[([\d,]*)\]", body)]
        if "custom-call" in ops or op == "custom-call":
            kind = "attention kernel" if "tpu_custom_call" in body else "custom-call"
        elif {"convolution", "dot"} & set(ops):
            kind = "lm head" if any(vocab in d for d in dims) else "rank-r" if any(rank in d for d in dims) else "projection"
        else:
            kind = "+".join(ops)
        kinds.setdefault(name, (kind, shape))
    return kinds


#: (shape, layers, micro-batch, remat, nf4 QLoRA, micro-batches queued per traced call) of the step
#: profiles: the 1B target's whole step (16 layers, `none`, queued as a run queues them), an 8-layer
#: 1B step under `dots`, and 8B QLoRA's, whose frozen products dequantize their weights.
STEP_PROFILES = [("1b", 16, 4, "none", False, 4), ("1b", 8, 4, "dots", False, 1), ("8b", 4, 2, "full", True, 1)]


def step_profiles(work: Path) -> list[dict[str, Any]]:
    """`step_profile` for each row of `STEP_PROFILES`."""
    import jax

    rows = []
    for shape, layers, micro, policy, qlora, queued in STEP_PROFILES:
        rows.append(step_profile(work, shape, layers, micro, policy, qlora=qlora, queued=queued))
        jax.clear_caches()
    return rows


def busy(intervals: list[tuple[float, float]]) -> dict[str, float]:
    """How long one device line was busy: its ops' (start, end) intervals merged (an op nested in
    another, a loop's body in the loop, counted once), against the span from the first start to the
    last end, and the largest gap between them; in the intervals' unit. Pure."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    gaps = [b[0] - a[1] for a, b in zip(merged, merged[1:])]
    return {"busy": sum(end - start for start, end in merged), "span": merged[-1][1] - merged[0][0] if merged else 0.0,
            "largest_gap": max(gaps, default=0.0)}


def step_profile(work: Path, shape: str = "1b", layers: int = 8, micro: int = 4, policy: str = "dots", *,
                 qlora: bool = False, seq: int = 2048, steps: int = 3, queued: int = 1) -> dict[str, Any]:
    """Where the chip's time goes in the production step (LoRA r16, `policy`), per micro-batch:
    traced with `jax.profiler` over `steps` calls of `queued` micro-batches each (queued as a run
    queues them), each device op named by the step's optimized HLO and summed by kind (attention
    kernel, LM head, projections, rank-r LoRA products, the rest by fused ops); and how much of the
    traced span the chip was busy (`busy`): time the host leaves it idle shows there."""
    import collections
    import gzip
    import tempfile

    import jax

    from lora_trainer import train
    from lora_trainer.config import QuantizationSpec

    batch = _study_batch(micro, seq)
    quantization = QuantizationSpec(weight_qtype="nf4", tile_size=64) if qlora else None
    trainer, loaded = _study_trainer(_study_model(work, shape, layers), policy, splash=jax.default_backend() == "tpu",
                                     quantization=quantization)
    compile_seconds = _timed_step(trainer, [batch])
    seconds = statistics.median(_timed_step(trainer, [batch] * queued) / queued for _ in range(5))
    # The inputs as `train` hands them to the step (placed on the mesh): lowered for other placements,
    # the step compiles anew, and its fusions are named otherwise than the traced program's.
    hlo = trainer.train_step.lower(trainer.step_inputs(dict(batch))).compile().as_text()
    kinds = hlo_kinds(hlo, 16, SHAPES[shape].get("vocab_size", COMMON["vocab_size"]))
    trace_dir = Path(tempfile.mkdtemp(prefix="step-profile-", dir=work))  # kept: open it in Perfetto for the timeline
    (trace_dir / "train_step.hlo.txt").write_text(hlo)
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        for _ in range(steps):
            _timed_step(trainer, [batch] * queued)
    (trace,) = trace_dir.rglob("perfetto_trace.json.gz")
    events = json.load(gzip.open(trace))
    events = events["traceEvents"] if isinstance(events, dict) else events
    ops = [e for e in events if e.get("ph") == "X" and e.get("name") in kinds]
    per_micro_batch = steps * queued * 1e3  # event times are in us; results in ms per micro-batch
    by_kind: collections.Counter = collections.Counter()
    by_op: collections.Counter = collections.Counter()
    for e in ops:
        by_kind[kinds[e["name"]][0]] += e["dur"] / per_micro_batch
        by_op[e["name"]] += e["dur"] / per_micro_batch
    # Events on the same device lines that the HLO does not name (the Pallas kernel's, for one).
    lines = {(e.get("pid"), e.get("tid")) for e in ops}
    unnamed: collections.Counter = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("name") not in kinds and (e.get("pid"), e.get("tid")) in lines:
            unnamed[e.get("name")] += e.get("dur", 0) / per_micro_batch
    device_lines = {f"{pid}/{tid}": {k: v / 1e3 for k, v in busy([(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X"
                                                             and (e.get("pid"), e.get("tid")) == (pid, tid)]).items()}
                    for pid, tid in lines}
    flops = train._flops_per_token(trainer.model, loaded.hf_config, seq)
    result = {"shape": shape, "layers": layers, "micro": micro, "remat": policy, "qlora": qlora, "queued": queued,
              "step": seconds, "mfu": micro * seq / seconds * flops / PEAK, "compile": compile_seconds,
              "device_ms_per_step": sum(by_kind.values()), "busy_ms": device_lines, "ops_matched": len(ops),
              "events": len(events), "trace": str(trace), "by_kind_ms": dict(by_kind.most_common(30)),
              "top_ops_ms": [(n, round(t, 3), *kinds[n]) for n, t in by_op.most_common(40)],
              "unnamed_ms": [(n, round(t, 3)) for n, t in unnamed.most_common(15)], "unnamed_total_ms": sum(unnamed.values())}
    if not ops:  # names that did not match the HLO: show what the trace calls its events
        names = collections.Counter(e.get("name") for e in events if e.get("ph") == "X")
        result["trace_names"] = names.most_common(40)
    print(json.dumps(result, indent=1), flush=True)
    return result


def adapted_products(work: Path) -> list[dict[str, Any]]:
    """The first `STEP_PROFILES` row (the 1B target's step) with each adapted projection as two
    products (the frozen one in float32, then the delta added in a second pass: the CPU's form)
    and as one (`fused_delta`, the TPU's), side by side in one process."""
    import jax

    from lora_trainer.lora_provider import LoraProvider

    shape, layers, micro, policy, _, queued = STEP_PROFILES[0]
    rows = []
    try:
        for one in (False, True):
            LoraProvider.fuses_delta = one
            row = step_profile(work, shape, layers, micro, policy, queued=queued)
            rows.append({"products": "one" if one else "two", **{k: row[k] for k in ("step", "mfu", "compile", "device_ms_per_step",
                                                                                        "by_kind_ms", "trace")}})
            jax.clear_caches()
    finally:
        LoraProvider.fuses_delta = None
    return rows


# --------------------------------------------------------------------------- report


#: `--NAME` flag -> the study it runs before the cases.
STUDIES = {"study": study, "qlora_memory": qlora_memory, "save_overlap": save_overlap,
           "splash_tilings": splash_tilings, "nf4_decoding": nf4_decoding,
           "step_profiles": step_profiles, "adapted_products": adapted_products}


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| case | micro-batch x accumulation | step | tokens/s | MFU | rows' fill | compile (cold) | restart to 1st step (warm) | compiled memory | save cost |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "case" not in r:
            continue
        _, seq, micro, acc, _ = CASES[r["case"]]
        c, w = r["cold"], r.get("warm") or {}
        if c["exit"] not in (0, PREEMPTED):
            rows.append(f"| {r['case']} | {micro} x {acc} | failed (exit {c['exit']}) | | | | | | | |")
            continue
        save = "-" if c.get("save_extra_seconds") is None else f"{c['save_extra_seconds']:.2f} s ({c['save_extra_percent_of_interval']:.1f}% of {CHECKPOINT_EVERY} steps)"
        if c.get("first_save_extra_seconds") is not None:
            save += f"; first save {c['first_save_extra_seconds']:.2f} s"
        rows.append(f"| {r['case']} | {micro} x {acc} | {_fmt(c['step_seconds'], '.3f')} s | {_fmt(c['tokens_per_second'], ',.0f')} | "
                    f"{_fmt(c['mfu'] and 100 * c['mfu'], '.1f')}% | {_fmt(c.get('fill') and 100 * c['fill'], '.0f')}% | "
                    f"{_fmt(c['first_step'], '.0f')} s | {_fmt(w.get('start_to_first_step'), '.1f')} s | {c['memory'] or '-'} | {save} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/tpu-bench"), help="checkpoints, data and runs (tens of GB)")
    p.add_argument("--out", type=Path, default=Path("/tmp/tpu-bench"), help="results.json and the runs' logs")
    p.add_argument("--cases", default="1b-lora,3b-lora,8b-qlora,1b-qlora,1b-full-ft")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds per trainer process")
    p.add_argument("--no-restart", action="store_true", help="skip each case's warm-cache restart")
    p.add_argument("--restart-intervals", default="", help="comma-separated GIL switch intervals (s): the warm restart "
                   "again at each, from a copy of the preempted run (background.prompt_handoffs)")
    p.add_argument("--restart-traced", action="store_true", help="the warm restart again from a copy of the preempted "
                   "run without its step record: the step traced and lowered to find JAX's entry (step_record)")
    p.add_argument("--restart-timed", action="store_true", help="the warm restart again from a copy of the preempted "
                   "run, every thread's start-up pieces timed (start_timeline.py)")
    p.add_argument("--check", action="store_true", help="first compare the splash kernel with the XLA attention")
    p.add_argument("--write", action="store_true", help="rewrite the TPU section of docs/benchmarks.md")
    p.add_argument("--study", action="store_true", help="first time the step's variants on a 4-layer 1B (STUDY)")
    p.add_argument("--qlora-memory", action="store_true", help="first compare QLoRA's compiled memory by frozen product (QLORA_STUDY)")
    p.add_argument("--save-overlap", action="store_true", help="first time the steps a save overlaps, by what Orbax is given (SAVE_MODES)")
    p.add_argument("--splash-tilings", action="store_true", help="first time the splash kernel's tilings (SPLASH_TILINGS)")
    p.add_argument("--nf4-decoding", action="store_true", help="first time an 8B MLP product's nf4 decoding: Qwix's gather against selects")
    p.add_argument("--step-profiles", action="store_true", help="first trace the steps of STEP_PROFILES and sum the chip's time by kind of op")
    p.add_argument("--adapted-products", action="store_true", help="first profile the 1B step with each adapted projection "
                   "as two products and as one (fused_delta)")
    p.add_argument("--full-ft-worker", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.full_ft_worker:
        full_ft_worker(args.full_ft_worker)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    if args.check:
        results.append({"splash_check": check_splash()})
        print(json.dumps(results[-1]), flush=True)
    studies = [name for name in STUDIES if getattr(args, name)]
    if studies and args.cases:  # a study holds the chip in this process: the trainer processes could not start
        child = args.out / "studies"
        argv = [f"--{name.replace('_', '-')}" for name in studies]
        subprocess.run([sys.executable, __file__, *argv, "--cases", "", "--work", str(args.work), "--out", str(child)], check=False)
        results.extend(json.loads((child / "results.json").read_text()) if (child / "results.json").exists() else [])
    else:
        for name in studies:
            results.append({name: STUDIES[name](args.work)})
            (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    for case in filter(None, args.cases.split(",")):
        intervals = tuple(float(x) for x in args.restart_intervals.split(",") if x)
        results.append(run_case(case, args.work, args.out, args.timeout, restart=not args.no_restart, intervals=intervals,
                                traced=args.restart_traced, timed=args.restart_timed))
        print(json.dumps(results[-1], default=str)[:3000], flush=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print(table(results))
    if args.write:
        report.write_section(SECTION, f"{SECTION}\n\n{table(results)}\n")


if __name__ == "__main__":
    main()
