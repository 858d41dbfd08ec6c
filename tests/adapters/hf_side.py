"""The reference side of the golden-logit proofs: HF `transformers` + `peft` on CPU torch, float32."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lora_trainer.models import registry

#: Every model family the adapters support: every declared family.
FAMILIES = registry.FAMILIES
#: The HF module names of every projection the families' LoRA can target.
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: One token sequence long enough to cross Gemma 3's sliding window (4 in the tiny models).
TOKENS = (5, 17, 42, 99, 3, 250, 7, 64, 128, 11)


def hf_logits(base_dir: Path, tokens: Sequence[int] = TOKENS, adapter_dir: Path | None = None) -> np.ndarray:
    """float32 [len, vocab] logits of the HF model (with a PEFT adapter loaded by PEFT itself)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(tokens)]))
    return out.logits[0].float().numpy()


def make_peft_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    rank: int = 4,
    alpha: float = 8.0,
    targets: Sequence[str] | str = ALL_PROJECTIONS,
    use_rslora: bool = False,
    seed: int = 0,
) -> Path:
    """An adapter made by `peft.get_peft_model` + `save_pretrained`, with random non-zero A and B."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    modules = targets if isinstance(targets, str) else list(targets)  # a str is one regex, as PEFT takes it
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules, task_type="CAUSAL_LM", use_rslora=use_rslora)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    peft_model.save_pretrained(str(out_dir))
    return out_dir
