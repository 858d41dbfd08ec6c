"""`lora-trainer export`: an Orbax LoRA checkpoint -> an HF PEFT adapter or a merged HF model.

Everything the adapter is (family, base model, rank, alpha, dropout) comes from the
checkpoint's metadata, so the export Job the operator runs after training needs no
repeated flags. The output is staged and published only when complete.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from lora_trainer import storage
from lora_trainer.adapters.mapping import lora_tree_to_peft, peft_target_modules
from lora_trainer.adapters.merge import merge_adapter_into_checkpoint
from lora_trainer.adapters.peft_format import LoraHyper, PeftLoraAdapter, write_peft_adapter
from lora_trainer.checkpoint import read_lora
from lora_trainer.checkpoint_metadata import check_lora_tree
from lora_trainer.errors import UserError
from lora_trainer.models import FamilySpec, family_of_checkpoint


def adapter_from_checkpoint(
    tree: Mapping[str, Mapping[str, Any]],
    metadata: Mapping[str, Any],
    *,
    base: str | None = None,
    family: FamilySpec | None = None,
    num_layers: int | None = None,
    where: str = "the checkpoint",
) -> PeftLoraAdapter:
    """The PEFT form of a checkpoint's LoRA tree; refuses one its metadata does not describe
    (`check_lora_tree`) or with non-finite values, naming the module.

    HF module names are those of the family the metadata records, or of `family` (a given base's).
    The base's layer count (`num_layers`, else the metadata's `numLayers`, absent in older
    checkpoints) lets `target_modules` name exactly the modules of an adapter on some layers only.
    Errors start with `where`, which names the checkpoint.
    """
    check_lora_tree(tree, metadata, where)
    for path, params in tree.items():
        for name, arr in params.items():
            if not np.isfinite(np.asarray(arr, dtype=np.float32)).all():
                raise UserError(
                    f"{where}: LoRA parameter {path}/{name} of step {metadata.get('step')} holds NaN or Inf (training diverged): "
                    "export an earlier step with --step, or lower the learning rate and retrain"
                )
    family = family or family_of_checkpoint(metadata)
    modules = lora_tree_to_peft(tree, family, where)
    hyper = LoraHyper(
        rank=int(metadata["rank"]),
        alpha=float(metadata["alpha"]),
        dropout=float(metadata.get("dropout") or 0.0),
        target_modules=peft_target_modules(modules, family, num_layers if num_layers is not None else metadata.get("numLayers")),
        base_model=base or metadata.get("baseModel"),
    )
    return PeftLoraAdapter(hyper=hyper, modules=modules)


def write_adapter_output(adapter: PeftLoraAdapter, out: str, *, merged: bool, base: str | None) -> None:
    """Publish the adapter (or the base with it merged) at `out`, whole or not at all."""
    if not merged:
        with storage.staged_output_dir(out) as stage:
            write_peft_adapter(stage, adapter)
        return
    if not base:
        raise UserError("--merged needs the base model: pass --base (the checkpoint records none)")
    with storage.local_dir(base) as base_dir, storage.staged_output_dir(out) as stage:
        merge_adapter_into_checkpoint(base_dir, adapter, stage)


def export_checkpoint(checkpoint: str, out: str, *, step: int | None = None, merged: bool = False, base: str | None = None) -> None:
    """Export step `step` (default: the latest committed) of `checkpoint` to `out`.

    `checkpoint` is a checkpoint root (`<output>/checkpoints`) or one step directory.
    Without `merged`: `adapter_config.json` + `adapter_model.safetensors`. With it: the base
    model (`base`, default the checkpoint's `baseModel`) with the adapter merged, as sharded
    safetensors + index + config and tokenizer files.
    """
    tree, metadata = read_lora(checkpoint, step)
    adapter = adapter_from_checkpoint(tree, metadata, base=None if base is None else storage.absolute_uri(base), where=checkpoint)
    write_adapter_output(adapter, out, merged=merged, base=adapter.hyper.base_model)
