"""Adapter conversion speed on a Llama-3-8B-shaped adapter, against `cp` and against `peft`.

The adapter: 32 layers, hidden 4096, 32 query / 8 key-value heads of 128, MLP 14336, rank 16
on all seven projections (41.9M float32 parameters, 168 MB), random, written in PEFT's
format. The base model is only its config.json (the non-merged path never reads weights).

Measured in the same run, `--repeat` rounds of every operation in turn, files in the page cache:
  - cp:            `cp -r` of the PEFT adapter directory (the floor: the same bytes moved once);
  - write:         `safetensors.numpy.save_file` of the tensors already in memory (a user-space write);
  - convert:       `convert hf-peft -> orbax` (read + validate + map + Orbax write, committed);
  - export:        `export` of that Orbax checkpoint -> PEFT (read + map + check + write);
  - orbax:         `write_lora` / `read_lora` alone (the checkpoint format's share of the two above;
                   the adapter-only checkpoint stores the 448 tensors layer-stacked as 14 arrays);
  - cli:           `lora-trainer convert` / `lora-trainer export` as fresh processes, as a Job runs
                   them (interpreter start and imports included), and a fresh process that only
                   imports what convert imports (the start-up share of those two);
  - peft weights:  PEFT's own `load_peft_weights` + `safetensors.torch.save_file` (its I/O path);
  - peft model:    `PeftModel.from_pretrained` (`low_cpu_mem_usage=True`) on a weightless
                   Llama-3-8B skeleton (see `skeleton`) + `save_pretrained`: PEFT's full load+save.
Writes the figures into the "Adapters" section of docs/benchmarks.md.
Run by hand: `.venv/bin/python bench/adapter_convert.py [--repeat 3] [--no-write]`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import report  # bench/ is on sys.path when a script here runs

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Adapters"

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, RANK = 32, 4096, 32, 8, 128, 14336, 16

#: Llama 3.1 8B's config.json (the fields the family reads).
BASE_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": HIDDEN,
    "intermediate_size": MLP,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}


def projections() -> dict[str, tuple[int, int]]:
    """HF module name -> (out, in) of every projection LoRA targets."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    per_layer = {
        "self_attn.q_proj": (q, HIDDEN),
        "self_attn.k_proj": (kv, HIDDEN),
        "self_attn.v_proj": (kv, HIDDEN),
        "self_attn.o_proj": (HIDDEN, q),
        "mlp.gate_proj": (MLP, HIDDEN),
        "mlp.up_proj": (MLP, HIDDEN),
        "mlp.down_proj": (HIDDEN, MLP),
    }
    return {f"model.layers.{i}.{m}": shape for i in range(LAYERS) for m, shape in per_layer.items()}


def make_adapter(directory: Path) -> int:
    """Write a random PEFT adapter (as PEFT lays it out); returns its parameter count."""
    from lora_trainer.adapters.peft_format import LoraHyper, PeftLoraAdapter, write_peft_adapter

    rng = np.random.default_rng(0)
    modules = {
        name: (rng.standard_normal((RANK, inp), np.float32) * 0.01, rng.standard_normal((out, RANK), np.float32) * 0.01)
        for name, (out, inp) in projections().items()
    }
    short = tuple(sorted({n.rsplit(".", 1)[1] for n in modules}))
    write_peft_adapter(directory, PeftLoraAdapter(LoraHyper(rank=RANK, alpha=32.0, target_modules=short), modules))
    return sum(a.size + b.size for a, b in modules.values())


def dir_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def round_robin(ops: dict[str, Callable[[], Callable[[Path], None]]], scratch: Path, repeat: int) -> dict[str, list[float]]:
    """Wall times of every operation, run in turn `repeat` times (so a load spike on this shared
    machine hits all of them alike), each into a fresh output directory. `ops[name]()` (not
    timed) returns the run to time."""
    times: dict[str, list[float]] = {name: [] for name in ops}
    for i in range(repeat):
        for name, prepare in ops.items():
            out = scratch / f"out-{name}-{i}"
            run = prepare()
            start = time.perf_counter()
            run(out)
            times[name].append(time.perf_counter() - start)
            shutil.rmtree(out, ignore_errors=True)
    return times


def write_tensors(tensors: dict[str, np.ndarray], out: Path) -> None:
    """A plain user-space write of the adapter's bytes from memory (`safetensors.numpy.save_file`)."""
    from safetensors.numpy import save_file

    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))


def peft_weights_roundtrip(src: Path, out: Path) -> None:
    """PEFT's own adapter I/O: `load_peft_weights` then the `save_file` that `save_pretrained` ends with."""
    from peft.utils import load_peft_weights
    from safetensors.torch import save_file

    weights = load_peft_weights(str(src), device="cpu")
    out.mkdir(parents=True)
    save_file(weights, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    shutil.copy2(src / "adapter_config.json", out / "adapter_config.json")


def skeleton(base_dir: Path) -> Any:
    """The 8B Llama without its 32 GB of weights: built on the `meta` device, then every Linear
    weight replaced by a zero-stride CPU view of one zero (no memory), so PEFT puts the adapter
    it loads on the CPU (on a pure meta skeleton it moves the adapter to `meta` as well)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(base_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    zero = torch.zeros((), dtype=torch.float32)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight = torch.nn.Parameter(zero.expand(module.out_features, module.in_features), requires_grad=False)
    return model


def peft_model_roundtrip(src: Path, out: Path, base: Any) -> None:
    """`PeftModel.from_pretrained` on a weightless skeleton, then `save_pretrained`."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(base, str(src), low_cpu_mem_usage=True)
    model.save_pretrained(str(out))


def cli(*args: str) -> Callable[[Path], None]:
    """A run of `lora-trainer <args> --out OUT` in a fresh process (the console script of this interpreter)."""
    exe = str(Path(sysconfig.get_path("scripts")) / "lora-trainer")
    return lambda out: subprocess.run([exe, *args, "--out", str(out)], check=True, capture_output=True)


#: What a `lora-trainer convert` process imports before it touches the adapter.
IMPORTS = (
    "from lora_trainer import cli; from lora_trainer.adapters import convert; "
    "from lora_trainer.models import get_family; get_family('llama3')"
)


def stacked_arrays(orbax: Path) -> tuple[int, int]:
    """(arrays Orbax stored, tensors of the adapter) of an adapter-only checkpoint."""
    from lora_trainer.checkpoint import read_metadata

    stored = sum(1 for _ in orbax.glob("*/lora/**/.zarray"))
    return stored, 2 * len(read_metadata(str(orbax))["modulePaths"])


def measure(repeat: int) -> dict[str, Any]:
    from safetensors.numpy import load_file

    from lora_trainer.adapters.convert import convert
    from lora_trainer.adapters.export import export_checkpoint
    from lora_trainer.checkpoint import read_lora, write_lora

    with tempfile.TemporaryDirectory(prefix="adapter-bench-") as tmp:
        root = Path(tmp)
        base = root / "base"
        base.mkdir()
        (base / "config.json").write_text(json.dumps(BASE_CONFIG))
        peft_dir = root / "peft"
        peft_dir.mkdir()
        params = make_adapter(peft_dir)
        orbax = root / "orbax"
        convert("hf-peft", "orbax", str(peft_dir), str(orbax), base=str(base))  # warm-up + the export source
        tensors = load_file(str(peft_dir / "adapter_model.safetensors"))
        tree, metadata = read_lora(str(orbax))

        def peft_model_run() -> Callable[[Path], None]:
            model = skeleton(base)  # a fresh one per run (PEFT mutates it), built outside the timing
            return lambda out: peft_model_roundtrip(peft_dir, out, model)

        convert_args = ("convert", "--from", "hf-peft", "--to", "orbax", "--source", str(peft_dir), "--base", str(base))
        ops: dict[str, Callable[[], Callable[[Path], None]]] = {
            "cp": lambda: lambda out: subprocess.run(["cp", "-r", str(peft_dir), str(out)], check=True),
            "write": lambda: lambda out: write_tensors(tensors, out),
            "convert": lambda: lambda out: convert("hf-peft", "orbax", str(peft_dir), str(out), base=str(base)),
            "orbax_write": lambda: lambda out: write_lora(str(out), 0, tree, metadata),
            "export": lambda: lambda out: export_checkpoint(str(orbax), str(out)),
            "orbax_read": lambda: lambda out: read_lora(str(orbax)),
            "peft_weights": lambda: lambda out: peft_weights_roundtrip(peft_dir, out),
            "peft_model": peft_model_run,
            "convert_cli": lambda: cli(*convert_args),
            "export_cli": lambda: cli("export", "--checkpoint", str(orbax)),
            "imports": lambda: lambda out: subprocess.run([sys.executable, "-c", IMPORTS], check=True, capture_output=True),
        }
        load_before = os.getloadavg()[0]
        times = round_robin(ops, root, repeat)
        arrays, tensors_count = stacked_arrays(orbax)
        result: dict[str, Any] = {
            "parameters": params,
            "adapter_bytes": dir_bytes(peft_dir),
            "orbax_bytes": dir_bytes(orbax),
            "orbax_arrays": arrays,
            "tensors": tensors_count,
        }
    for name, ts in times.items():
        result[f"{name}_s"] = statistics.median(ts)
        result[f"{name}_range"] = (min(ts), max(ts))
    # Ratios are medians of per-round ratios: both sides of each pair ran back to back.
    for op in ("write", "convert", "export", "orbax_write", "orbax_read", "convert_cli", "export_cli"):
        result[f"{op}_vs_cp"] = statistics.median(t / c for t, c in zip(times[op], times["cp"], strict=True))
    for op in ("convert", "export"):
        for ref in ("peft_model", "peft_weights"):
            result[f"{op}_vs_{ref}"] = statistics.median(t / c for t, c in zip(times[op], times[ref], strict=True))
    result["repeat"] = repeat
    result["load"] = (load_before, os.getloadavg()[0])
    result["machine"] = (
        f"{report.machine()}, load average {load_before:.1f} at the start and "
        f"{result['load'][1]:.1f} at the end"
    )
    return result


def verdict(r: dict[str, Any], key: str, limit: float) -> str:
    """`met` or `NOT met` for one target (convert's and export's ratio `key` both under `limit`), with the ratios."""
    convert, export = r[f"convert_{key}"], r[f"export_{key}"]
    met = max(convert, export) < limit
    return f"{'met' if met else 'NOT met'}: convert {convert:.2f}x, export {export:.2f}x"


def share(r: dict[str, Any], part: str, whole: str) -> str:
    """`part`'s fastest round as a share of `whole`'s: medians of both swing too much under load."""
    return f"{r[f'{part}_range'][0] / r[f'{whole}_range'][0]:.0%}"


def spread(r: dict[str, Any]) -> str:
    """Fastest-slowest round of `cp`, convert and export: how far one round's ratio can stray."""
    ranges = (("`cp`", r["cp_range"]), ("convert", r["convert_range"]), ("export", r["export_range"]))
    return ", ".join(f"{label} {lo:.2f}-{hi:.2f} s" for label, (lo, hi) in ranges)


def write_section(r: dict[str, Any]) -> None:
    """Replace (or append) the Adapters section of docs/benchmarks.md; other sections stay."""
    shared = (
        " Other work ran on this machine during the run (see the load averages), so single figures"
        " vary by 2x or more between runs."
        if max(r["load"]) >= 0.5 * (os.cpu_count() or 1)
        else ""
    )
    body = f"""{SECTION}

`bench/adapter_convert.py` (run by hand): a Llama-3-8B-shaped adapter (32 layers, hidden 4096,
32/8 heads of 128, MLP 14336, rank 16 on all seven projections: {r['parameters'] / 1e6:.1f}M float32
parameters, {r['adapter_bytes'] / 1e6:.0f} MB as PEFT safetensors, {r['orbax_bytes'] / 1e6:.0f} MB as Orbax), random,
no base weights (the base is its config.json). {r['repeat']} rounds, each running every operation
in turn; seconds are medians (and the fastest round), ratios are medians of the per-round ratios; files in the page
cache; on {r['machine']}.

| operation | seconds | fastest round | vs `cp` | vs PEFT load+save (model) | vs PEFT load+save (weights only) |
|---|---|---|---|---|---|
| `cp -r` of the PEFT adapter (floor) | {r['cp_s']:.2f} | {r['cp_range'][0]:.2f} | 1.0x | | |
| `safetensors.numpy.save_file` of the same tensors from memory (user-space write) | {r['write_s']:.2f} | {r['write_range'][0]:.2f} | {r['write_vs_cp']:.1f}x | | |
| `convert --from hf-peft --to orbax` | {r['convert_s']:.2f} | {r['convert_range'][0]:.2f} | {r['convert_vs_cp']:.1f}x | {r['convert_vs_peft_model']:.2f}x | {r['convert_vs_peft_weights']:.2f}x |
| &nbsp;&nbsp;Orbax `write_lora` of the same tree alone | {r['orbax_write_s']:.2f} | {r['orbax_write_range'][0]:.2f} | {r['orbax_write_vs_cp']:.1f}x | | |
| `export` (Orbax -> PEFT) | {r['export_s']:.2f} | {r['export_range'][0]:.2f} | {r['export_vs_cp']:.1f}x | {r['export_vs_peft_model']:.2f}x | {r['export_vs_peft_weights']:.2f}x |
| &nbsp;&nbsp;Orbax `read_lora` alone | {r['orbax_read_s']:.2f} | {r['orbax_read_range'][0]:.2f} | {r['orbax_read_vs_cp']:.1f}x | | |
| PEFT: `PeftModel.from_pretrained` on a weightless Llama-3-8B skeleton + `save_pretrained` | {r['peft_model_s']:.2f} | {r['peft_model_range'][0]:.2f} | | 1.0x | |
| PEFT: `load_peft_weights` + `safetensors.torch.save_file` (its I/O path only) | {r['peft_weights_s']:.2f} | {r['peft_weights_range'][0]:.2f} | | | 1.0x |
| `lora-trainer convert --from hf-peft --to orbax`, a fresh process | {r['convert_cli_s']:.2f} | {r['convert_cli_range'][0]:.2f} | {r['convert_cli_vs_cp']:.1f}x | | |
| `lora-trainer export`, a fresh process | {r['export_cli_s']:.2f} | {r['export_cli_range'][0]:.2f} | {r['export_cli_vs_cp']:.1f}x | | |
| &nbsp;&nbsp;a fresh process that only imports what convert imports | {r['imports_s']:.2f} | {r['imports_range'][0]:.2f} | | | |

Targets, for convert and export in-process: within 3x of `cp` ({verdict(r, "vs_cp", 3.0)}), and
faster than PEFT's load+save, the model path ({verdict(r, "vs_peft_model", 1.0)}). The `cp` ratios
move with the floor itself: across the rounds {spread(r)}.
Convert includes reading and validating every tensor (finite, ranks, shapes against the
base's config.json; the safetensors file is memory-mapped, not copied) and Orbax's committed
write; export includes Orbax's read, the same checks and the safetensors write. The PEFT
"weights only" path does no validation and no layout mapping. The adapter-only checkpoint
stores the {r['tensors']} tensors layer-stacked as {r['orbax_arrays']} uncompressed arrays (docs/dev/contracts.md);
convert copies the tensors once, from the memory map into those stacked arrays, each in the order its bytes already have (a plain copy, no transposing; recorded as `loraLayout.axes`); export works on views of the
stacked arrays Orbax reads back and writes safetensors itself (one reused scratch buffer, no per-tensor `tobytes`).
In the fastest rounds (the least disturbed by other load), Orbax's own write of the same tree,
timed alone (stacking included), is {share(r, 'orbax_write', 'convert')} of convert's time, and its read {share(r, 'orbax_read', 'export')} of
export's; the rest is reading, checking and mapping the tensors and writing safetensors. The fresh-process rows add interpreter start and
imports, which a Job pays once per conversion: in the fastest rounds the imports alone take
{r['imports_range'][0]:.1f} s (JAX, Flax, Orbax, Qwix; not Tunix or torch: the families build their Tunix models lazily), {share(r, 'imports', 'convert_cli')} of the fresh `convert`.{shared}
"""
    report.write_section(SECTION, body)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = p.parse_args()
    result = measure(args.repeat)
    print(json.dumps(result, indent=2))
    if not args.no_write:
        write_section(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
