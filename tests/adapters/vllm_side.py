"""The vLLM side of the export proofs: vLLM's own LoRA loader reads an exported adapter.

Run as a script in a subprocess whose PYTHONPATH holds vLLM (installed without its dependencies,
see vllm-requirements.txt: its wheel would pull a CUDA torch; the venv's CPU torch serves):

    python vllm_side.py ADAPTER_DIR BASE_CONFIG_JSON

It makes the calls vLLM's `WorkerLoRAManager._load_adapter` makes when a server gets
`--lora-modules name=ADAPTER_DIR`: `PEFTHelper.from_local_dir`, `validate_legal` against a
`LoRAConfig`, and `LoRAModel.from_local_checkpoint` with the module names the vLLM model class for
the base's architecture accepts (its packed modules expanded, its other LoRA-capable linear layers,
its embedding modules) and its HF -> vLLM weight-name mapper. Then every tensor of the file must be
in the loaded model, equal, with the adapter's rank and scaling. Prints one JSON object:
{"ok", "error", "rank", "scaling", "tensors", "modules", "problems"}.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import types
from pathlib import Path

#: Where `make test` installs vLLM and the few small packages its loader imports.
VLLM_PKGS = Path(sys.prefix) / "vllm-pkgs"

#: architecture -> (vLLM model module, its LoRA-capable linear layers that are not packed ones).
#: vLLM finds the latter by walking the built model; for these families they are the attention
#: output and MLP down projections (plus SigLIP's layers in Gemma 3's vision tower).
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", ["o_proj", "down_proj"]),
    "Qwen3ForCausalLM": ("qwen3", ["o_proj", "down_proj"]),
    "Qwen2ForCausalLM": ("qwen2", ["o_proj", "down_proj"]),
    "Gemma3ForCausalLM": ("gemma3", ["o_proj", "down_proj"]),
    "Gemma3ForConditionalGeneration": ("gemma3_mm", ["o_proj", "down_proj", "out_proj", "fc1", "fc2"]),
}


def _without_image_processor() -> None:
    """vLLM's gemma3_mm imports transformers' Gemma3ImageProcessor, which needs torchvision (its
    wheel pins a CUDA torch). Only image preprocessing uses it, never the LoRA loader."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        stub = types.ModuleType("transformers.models.gemma3.image_processing_gemma3")
        stub.Gemma3ImageProcessor = type("Gemma3ImageProcessor", (), {})
        sys.modules[stub.__name__] = stub


def check(adapter: Path, base_config: dict) -> dict:
    import torch
    from safetensors import safe_open
    from vllm.config.lora import LoRAConfig
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    arch = base_config["architectures"][0]
    module, linear = ARCHITECTURES[arch]
    cls = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), arch)
    packed = dict(getattr(cls, "packed_modules_mapping", {}) or {})
    embedding = dict(getattr(cls, "embedding_modules", {}) or {})
    expected = {leaf for m in {*packed, *linear, *embedding} for leaf in packed.get(m, [m])}
    mapper = getattr(cls, "hf_to_vllm_mapper", None)
    mapper = mapper.get_rename_mapper() if mapper is not None else None
    text = base_config.get("text_config", base_config)

    peft = PEFTHelper.from_local_dir(str(adapter), text.get("max_position_embeddings"))
    peft.validate_legal(LoRAConfig(max_lora_rank=64, max_loras=1))
    lora = LoRAModel.from_local_checkpoint(
        str(adapter), expected, peft_helper=peft, lora_model_id=1, device="cpu", dtype=torch.float32,
        model_vocab_size=text["vocab_size"], weights_mapper=mapper,
        skip_prefixes=getattr(cls, "lora_skip_prefixes", None), unsupported_lora_modules=set(),
    )
    problems = []
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
        for key in keys:
            name, is_a = parse_fine_tuned_lora_name(key, mapper)
            weights = lora.get_lora(name)
            got = None if weights is None else (weights.lora_a if is_a else weights.lora_b)
            want = f.get_tensor(key)
            if got is None or tuple(got.shape) != tuple(want.shape) or not torch.equal(got, want.to(got.dtype)):
                problems.append(f"{key} -> {name}: loaded {None if got is None else tuple(got.shape)}, file {tuple(want.shape)}")
    for name, weights in lora.loras.items():
        if weights.rank != peft.r or weights.scaling != peft.vllm_lora_scaling_factor:
            problems.append(f"{name}: rank {weights.rank}, scaling {weights.scaling}")
    return {"ok": not problems, "error": None, "rank": peft.r, "scaling": peft.vllm_lora_scaling_factor,
            "tensors": len(keys), "modules": len(lora.loras), "problems": problems}


def load_in_vllm(adapter: Path, base: Path) -> dict:
    """This script's verdict on `adapter` for the base model in `base`, from a subprocess with vLLM."""
    if not (VLLM_PKGS / "vllm").is_dir():
        raise RuntimeError(f"vLLM is not installed at {VLLM_PKGS}: run `make test`, which installs it there")
    env = {**os.environ, "PYTHONPATH": str(VLLM_PKGS), "VLLM_TARGET_DEVICE": "cpu"}
    done = subprocess.run([sys.executable, __file__, str(adapter), str(base / "config.json")],
                          env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0 or not done.stdout.strip():
        raise RuntimeError(f"vllm_side.py exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    adapter, base_config = Path(argv[0]), json.loads(Path(argv[1]).read_text())
    _without_image_processor()
    try:
        result = check(adapter, base_config)
    except Exception as e:  # vLLM's refusal is the result the negative tests look for
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
