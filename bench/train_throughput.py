"""LoRA training throughput of the trainer vs HF transformers + peft + torch, same shapes, same run.

Model: Llama-3-shaped, 4 layers, hidden 512, 8 query / 2 key-value heads of 64, MLP 1408,
vocab 8192, random weights (written as an HF checkpoint by `tiny_models` and loaded by the
trainer's own loader), base in float32 and in bfloat16 (the trainer's default; float32 LoRA
params either way). Batch 8 x 256 tokens, LoRA rank 16 (alpha 32) on all seven projections,
AdamW. Per dtype, measured round-robin (one step of each per round, `--steps` rounds after warm-up), median;
the trainer-vs-torch ratio is the median of the per-round ratios (each pair ran back to back),
with the ratio of medians and that of each side's fastest round beside it:
  - trainer:  the production step, `tunix_trainer.make_trainer(...).train([batch])` (Tunix PeftTrainer);
  - raw lora: the same loss and LoRA-only gradient in a bare `nnx.jit` step (Tunix's overhead);
  - full ft:  every parameter trained, bare `nnx.jit` step (the fraction's denominator), its matmuls
              routed through the trainer's LoRA provider with no rule, so that they take the same
              16-bit path as the LoRA step's (plain Tunix upcasts bf16 weight gradients on CPU);
  - forward:  the loss alone, jitted;
  - torch:    transformers LlamaForCausalLM + peft LoRA, loss.backward() + AdamW.step(); for
              bfloat16 the same mixed-precision recipe as the trainer's: bf16 base, PEFT's
              float32 adapters, matmuls under `torch.autocast(bfloat16)`.
Tokens/s counts all 8 x 256 tokens. On an accelerator (`--jax-only`), the trainer's step
is measured on the default JAX backend and MFU is reported from lora_trainer.metrics.
Writes the "Trainer" section of docs/benchmarks.md unless `--no-write`.
Run by hand: `.venv/bin/python bench/train_throughput.py [--steps 5] [--dtype D ...] [--no-write] [--jax-only]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import report  # bench/ is on sys.path when a script here runs

# torch's OpenMP workers spin for a while after each op by default; in one process with XLA's
# own thread pool that steals the 2 cores from the next JAX step. Sleep instead of spinning.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "trainer_image"))
from lora_trainer import host_memory  # noqa: E402

# As `run_training` does in production, before any JAX or torch thread exists; torch's
# allocations in this process benefit alike, so the comparison stays like for like.
HOST_MEMORY_TUNED = host_memory.retain_freed_memory()
SECTION = "## Trainer"
SHAPE = {
    "num_hidden_layers": 4,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "vocab_size": 8192,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 512,
}
BATCH, SEQ, RANK, ALPHA = 8, 256, 16, 32.0
#: The trainer measured (for its compile count); the last dtype's.
TRAINER: list[Any] = []
#: XLA's FLOP count (cost analysis of the compiled step) per row; the last dtype's.
FLOPS: dict[str, float] = {}
DTYPES = ("bfloat16", "float32")
#: The LM head's matmul, [batch*seq, hidden] x [hidden, vocab]: the step's largest, the machine's best case.
MATMUL = (BATCH * SEQ, 512, 8192)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _interleaved(steps: dict[str, Callable[[], Any]], warmup: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each step (each must block until done), one per round, measured round-robin.

    Round-robin, so that load from other work on a shared machine hits every row alike
    and the ratios stay meaningful even when the absolute times drift.
    """
    for step in steps.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    return times


def _medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in times.items()}


def paired_ratios(slow: list[float], fast: list[float]) -> list[float]:
    """`slow / fast` per round, sorted: each pair ran back to back, so the machine's drift between
    rounds (a shared VM's phases move both steps, though not by the same factor) cancels in it."""
    return sorted(s / f for s, f in zip(slow, fast, strict=True))


def _batch() -> dict[str, np.ndarray]:
    tokens = np.random.default_rng(0).integers(3, SHAPE["vocab_size"], (BATCH, SEQ)).astype(np.int32)
    ones = np.ones_like(tokens)
    return {"input_tokens": tokens, "input_mask": ones, "segment_ids": ones, "positions": np.tile(np.arange(SEQ, dtype=np.int32), (BATCH, 1))}


def _lora_model(model_dir: Path, dtype: str) -> Any:
    from lora_trainer.config import LoraSpec
    from lora_trainer.lora import apply_lora
    from lora_trainer.models import load_model

    loaded = load_model(str(model_dir), dtype=dtype)
    return apply_lora(loaded.model, LoraSpec(rank=RANK, alpha=ALPHA), loaded.family, seed=0).model


def production_step(model_dir: Path, dtype: str) -> Callable[[], None]:
    """One optimizer step of the trainer as `run_training` takes it (Tunix PeftTrainer, model
    donated), on the benchmark's batch; blocks until done. Also `step_profile.py`'s subject."""
    import jax

    from lora_trainer.config import TrainingSpec
    from lora_trainer.tunix_trainer import make_trainer

    batch = _batch()
    mesh = jax.make_mesh((1, 1, 1), ("data", "fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    # The trainer owns its model (as in production): rows sharing one model would hand each other
    # arrays placed differently, and a jitted step recompiles or re-places on such inputs.
    trainer = make_trainer(_lora_model(model_dir, dtype), TrainingSpec(steps=1000, learning_rate=1e-4, schedule="constant"))
    TRAINER.clear()
    TRAINER.append(trainer)

    def step() -> None:
        with mesh:  # Tunix reads the legacy mesh context
            trainer.train([batch])
        jax.block_until_ready(trainer.train_aux[-1]["loss"])
        trainer.train_aux.clear()

    return step


def jax_steps(model_dir: Path, dtype: str, *, full: bool) -> dict[str, Callable[[], Any]]:
    import jax
    import optax
    from flax import nnx

    from lora_trainer.loss import lm_loss, model_inputs
    from lora_trainer.models import load_model

    batch = _batch()
    FLOPS.clear()
    out: dict[str, Callable[[], Any]] = {"trainer": production_step(model_dir, dtype)}

    inputs = model_inputs({k: jax.numpy.asarray(v) for k, v in batch.items()})

    def bare_step(model: nnx.Module, wrt: Any) -> Callable[[], None]:
        opt = nnx.Optimizer(model, optax.adamw(1e-4), wrt=wrt)

        @nnx.jit
        def step(model: nnx.Module, opt: nnx.Optimizer, inputs: dict[str, Any]) -> jax.Array:
            (loss, _), grads = nnx.value_and_grad(lm_loss, argnums=nnx.DiffState(0, wrt), has_aux=True)(model, **inputs)
            opt.update(model, grads)
            return loss

        return lambda: jax.block_until_ready(step(model, opt, inputs))

    def grads(wrt: Any) -> Callable[..., Any]:
        return nnx.jit(lambda m, i: nnx.value_and_grad(lm_loss, argnums=nnx.DiffState(0, wrt), has_aux=True)(m, **i))

    bare_model = _lora_model(model_dir, dtype)
    out["raw lora"] = bare_step(bare_model, nnx.LoRAParam)
    FLOPS["raw lora"] = _xla_flops(grads(nnx.LoRAParam), bare_model, inputs)
    forward = nnx.jit(lambda m, i: lm_loss(m, **i)[0])
    out["forward"] = lambda: jax.block_until_ready(forward(bare_model, inputs))
    FLOPS["forward"] = _xla_flops(forward, bare_model, inputs)
    if full:
        full_model = _same_matmuls(load_model(str(model_dir), dtype=dtype).model)
        out["full ft"] = bare_step(full_model, nnx.Param)
        FLOPS["full ft"] = _xla_flops(grads(nnx.Param), full_model, inputs)
    a, b = jax.numpy.ones(MATMUL[:2], dtype), jax.numpy.ones(MATMUL[1:], dtype)
    # 16-bit operands accumulating in float32: XLA's fast form on CPU, as the trainer's step uses it.
    matmul = jax.jit(lambda a, b: jax.numpy.matmul(a, b, preferred_element_type=jax.numpy.float32))
    out["jax matmul"] = lambda: jax.block_until_ready(matmul(a, b))
    return out


def _same_matmuls(model: Any) -> Any:
    """`model` with every matmul going through the trainer's LoRA provider, which has no rule here:
    the full fine-tune then runs its products (weight gradients included) on the same 16-bit path
    as the LoRA step, and the time fraction compares the work, not two different kernels."""
    import jax.numpy as jnp
    import qwix
    from flax import nnx

    from lora_trainer.lora_provider import LoraProvider
    from lora_trainer.models.forward import positions_and_mask

    tokens = jnp.ones((1, 8), dtype=jnp.int32)
    positions, mask = positions_and_mask(tokens, None)
    return qwix.apply_lora_to_model(model, LoraProvider([]), tokens, positions, None, mask, rngs=nnx.Rngs(0))


def _xla_flops(fn: Any, *args: Any) -> float:
    """XLA's own FLOP count of the compiled function (its cost analysis); gradients only, no optimizer."""
    return float(fn.lower(*args).compile().cost_analysis()["flops"])


def torch_step(model_dir: Path, dtype: str) -> Callable[[], Any]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    low = dtype != "float32"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.from_numpy(_batch()["input_tokens"]).long()

    def step() -> None:
        with torch.autocast("cpu", dtype=getattr(torch, dtype), enabled=low):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    model.train()
    return step


def torch_matmul(dtype: str) -> Callable[[], Any]:
    """The LM head's matmul in torch, the same shapes and dtype as the JAX row."""
    import torch

    a, b = torch.ones(MATMUL[:2], dtype=getattr(torch, dtype)), torch.ones(MATMUL[1:], dtype=getattr(torch, dtype))
    return lambda: torch.matmul(a, b)


def _compiles() -> int:
    """Compilations of the trainer's jitted step over the whole bench (warm-up and timed rounds)."""
    return int(TRAINER[0]._jitted_train_step_fn.func.jitted_fn._cache_size())


def _subsection(times: dict[str, list[float]], dtype: str) -> str:
    """One dtype's table and ratios (FLOPS and TRAINER hold that dtype's run)."""
    r = _medians(times)
    paired = paired_ratios(times["torch"], times["trainer"])
    fastest_torch, fastest_trainer = min(times["torch"]), min(times["trainer"])
    tok = BATCH * SEQ
    mm_flops = 2.0 * MATMUL[0] * MATMUL[1] * MATMUL[2]
    torch_name = "torch 2.13 + transformers + peft LoRA step" + (" (autocast)" if dtype != "float32" else "")
    rows = [
        ("trainer: Tunix PeftTrainer step (production path)", r["trainer"], FLOPS["raw lora"]),
        ("bare `nnx.jit` LoRA step (same loss, LoRA-only grads)", r["raw lora"], FLOPS["raw lora"]),
        ("bare `nnx.jit` full fine-tune step", r["full ft"], FLOPS["full ft"]),
        ("forward only (loss)", r["forward"], FLOPS["forward"]),
        (torch_name, r["torch"], None),
    ]
    table = "\n".join(
        f"| {name} | {t:.3f} | {tok / t:,.0f} | {f / 1e9:.0f} | {f / t / 1e9:.0f} |" if f else f"| {name} | {t:.3f} | {tok / t:,.0f} | | |"
        for name, t, f in rows
    )
    ratio = statistics.median(paired)
    met = "met" if ratio >= 1.5 else "NOT met"
    peak = mm_flops / r["jax matmul"]
    floor = FLOPS["raw lora"] / peak
    return f"""### {dtype} base{" (the trainer's default)" if dtype == "bfloat16" else ""}

| step | seconds | tokens/s | GFLOP | GFLOP/s |
|---|---|---|---|---|
{table}

Trainer vs torch+peft: **{ratio:.2f}x** (target >= 1.5: {met}): the median of the {len(paired)} rounds'
ratios (torch's step / the trainer's, each pair back to back), which ranged {paired[0]:.2f}x-{paired[-1]:.2f}x;
the ratio of the two medians above is {r["torch"] / r["trainer"]:.2f}x, of each side's fastest round
(its least disturbed: {fastest_torch:.3f} s against {fastest_trainer:.3f} s) {fastest_torch / fastest_trainer:.2f}x. LoRA step / full fine-tune
step: **{r["trainer"] / r["full ft"]:.2f}** in time, **{FLOPS["raw lora"] / FLOPS["full ft"]:.2f}** in FLOPs (physical floor ~0.67).
Tunix's per-step overhead over a bare jitted step: {r["trainer"] - r["raw lora"]:+.3f} s. The trainer's step
compiled {_compiles()} time(s) in the run.
The machine's best case in the same run, the LM head's matmul alone ({MATMUL[0]} x {MATMUL[1]} x {MATMUL[2]}, {dtype}):
JAX {r["jax matmul"] * 1e3:.0f} ms = {peak / 1e9:.0f} GFLOP/s, torch {r["torch matmul"] * 1e3:.0f} ms =
{mm_flops / r["torch matmul"] / 1e9:.0f} GFLOP/s. At that rate the LoRA step's {FLOPS["raw lora"] / 1e9:.0f} GFLOP cannot take
less than {floor:.3f} s, at most {r["torch"] / floor:.2f}x this torch step.
"""


def _section(parts: list[str], load: float, steps: int) -> str:
    body = "\n".join(parts)
    return f"""{SECTION}

`bench/train_throughput.py` (run by hand): a Llama-3-shaped model (4 layers, hidden 512,
8/2 heads of 64, MLP 1408, vocab 8192, random), batch {BATCH} x {SEQ} tokens, LoRA rank
{RANK} (alpha {ALPHA:g}) on all seven projections, AdamW, LoRA params float32; the same shapes and
batch for every row, all in one run, median of {steps} rounds after 2 warm-up steps, the rows
of one dtype measured round-robin (one step of each per round) so that other load hits every
row alike. Machine: {report.machine()}, shared with other work (1-minute
load average {load:.1f} at the end), JAX CPU. GFLOP is XLA's own count for the compiled loss +
gradients (its cost analysis). glibc malloc tuned as `run_training` tunes it
(`lora_trainer.host_memory`): {"yes" if HOST_MEMORY_TUNED else "NO"}. Measured {time.strftime("%Y-%m-%d")}.

{body}"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dtype", nargs="+", choices=DTYPES, default=list(DTYPES), help="base dtypes to measure")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--jax-only", action="store_true", help="only the trainer step on the default JAX backend (+ MFU)")
    args = p.parse_args()
    from lora_trainer.tiny_models import make_tiny_hf_model

    parts = []
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        model_dir = make_tiny_hf_model("llama3", Path(tmp) / "llama", seed=0, **SHAPE)
        for dtype in args.dtype:
            if args.jax_only:
                _accelerator(model_dir, dtype, args.steps)
                continue
            times = _interleaved(
                {**jax_steps(model_dir, dtype, full=True), "torch": torch_step(model_dir, dtype), "torch matmul": torch_matmul(dtype)},
                2,
                args.steps,
            )
            for k, v in _medians(times).items():
                print(f"{dtype} {k:10s} {v:.3f} s  {BATCH * SEQ / v:,.0f} tokens/s")
            parts.append(_subsection(times, dtype))
    if args.jax_only:
        return 0
    text = _section(parts, os.getloadavg()[0], args.steps)
    print(text)
    if not args.no_write:
        report.write_section(SECTION, text)
    return 0


def _accelerator(model_dir: Path, dtype: str, steps: int) -> None:
    """The trainer's step on the default JAX backend (an accelerator when there is one), with MFU."""
    import jax

    from lora_trainer import metrics

    r = _medians(_interleaved({"trainer": production_step(model_dir, dtype)}, 2, steps))
    tps = BATCH * SEQ / r["trainer"]
    # matmul params: 4 layers of attention+MLP projections plus the untied LM head.
    h, m, v, kv = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"], 2 * 64
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * m
    lora = SHAPE["num_hidden_layers"] * RANK * (2 * h + 2 * h + 2 * (h + kv) + 2 * (h + m) + (m + h))
    fpt = metrics.lora_train_flops_per_token(matmul_params=4 * per_layer + h * v, lora_params=lora, num_layers=4, attn_width=h, seq_len=SEQ)
    kinds = [d.device_kind for d in jax.devices()[:1]]
    print(f"{kinds[0]} {dtype}: trainer step {r['trainer']:.4f} s, {tps:,.0f} tokens/s, mfu {metrics.mfu(tps, fpt, kinds)}")


if __name__ == "__main__":
    sys.exit(main())
