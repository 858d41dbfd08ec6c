"""`lora-trainer logits`: the JAX model's logits for one token sequence, to check a conversion.

Like MaxText's forward-pass logit checker: run the base model (optionally with an adapter
in either format) on the trainer's own model code and save float32 [len, vocab] logits as
`.npy`, to compare with `transformers` (+ `peft`) on the same tokens.
The base runs unquantized (as `transformers` runs it) even for a QLoRA adapter.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np

from lora_trainer import storage
from lora_trainer.adapters.base_model import BaseShapes
from lora_trainer.adapters.convert import load_adapter
from lora_trainer.config import LoraSpec
from lora_trainer.errors import UserError
from lora_trainer.lora import apply_lora, set_lora_state, targetable_modules
from lora_trainer.models import forward_logits, load_model


def jax_logits(base: str, tokens: Sequence[int], *, adapter: str | None = None, dtype: str = "float32") -> np.ndarray:
    """float32 [len(tokens), vocab] logits of the base model (with `adapter` applied, if given)."""
    if not tokens:
        raise UserError("--tokens is empty: give comma-separated token ids, e.g. 1,2,3")
    loaded = load_model(base, dtype=dtype)
    vocab = int(loaded.hf_config["vocab_size"])
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise UserError(f"--tokens holds ids {bad[:5]} outside the vocabulary [0, {vocab})")
    model = loaded.model
    if adapter is not None:
        shapes = BaseShapes(loaded.family, loaded.hf_config, targetable_modules(model, loaded.family))
        tree, metadata = load_adapter(adapter, shapes)
        spec = LoraSpec(rank=int(metadata["rank"]), alpha=float(metadata["alpha"]), target_modules=str(metadata["targetModules"]))
        model = apply_lora(model, spec, loaded.family, seed=0, structure_only=True).model  # values: the adapter's
        set_lora_state(model, tree)
    logits = forward_logits(model, np.asarray([list(tokens)], dtype=np.int32))
    return np.asarray(logits[0], dtype=np.float32)


def write_logits(base: str, tokens: Sequence[int], out: str, *, adapter: str | None = None, dtype: str = "float32") -> None:
    """Save `jax_logits(...)` as a .npy file at `out` (local path or gs://)."""
    buf = io.BytesIO()
    np.save(buf, jax_logits(base, tokens, adapter=adapter, dtype=dtype))
    storage.write_bytes(out, buf.getvalue())
