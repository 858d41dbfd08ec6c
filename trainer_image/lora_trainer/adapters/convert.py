"""`lora-trainer convert`: HF PEFT <-> Orbax LoRA checkpoint, and `restoreFrom` of a PEFT adapter.

An HF PEFT adapter made elsewhere becomes an adapter-only Orbax checkpoint (step 0) with
the metadata the trainer records, so `restoreFrom` and `export` accept it like one of
their own. The adapter is validated completely against the base model's shapes before
anything is written.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from lora_trainer import lora_names, storage
from lora_trainer.adapters.base_model import BaseShapes, base_shapes
from lora_trainer.adapters.export import adapter_from_checkpoint, write_adapter_output
from lora_trainer.adapters.mapping import LoraTree, peft_to_lora_tree, target_regex
from lora_trainer.adapters.peft_format import CONFIG_NAME, WEIGHTS_NAME, PeftLoraAdapter, read_peft_adapter
from lora_trainer.checkpoint import read_lora, write_lora
from lora_trainer.checkpoint_metadata import check_lora_tree
from lora_trainer.errors import UserError
from lora_trainer.lora import targetable_modules
from lora_trainer.models import FamilySpec

log = logging.getLogger(__name__)

FORMATS = ("hf-peft", "orbax")
#: The step an imported adapter is stored under.
IMPORTED_STEP = 0


def is_peft_dir(uri: str) -> bool:
    """True when `uri` holds an `adapter_config.json` (an HF PEFT adapter), else it is taken as Orbax."""
    return storage.exists(storage.join(uri, CONFIG_NAME))


def read_peft_uri(uri: str) -> PeftLoraAdapter:
    """Read and validate the PEFT adapter at a local path or gs:// URI."""
    if not is_peft_dir(uri):  # checked before a gs:// download of whatever lies there
        raise UserError(
            f"{storage.join(uri, CONFIG_NAME)} does not exist: an HF PEFT adapter directory holds "
            "adapter_config.json and adapter_model.safetensors"
        )
    with storage.local_dir(uri) as directory:
        return read_peft_adapter(directory, uri)


def _weights(adapter: PeftLoraAdapter) -> str:
    """How errors name an adapter's tensor file."""
    return storage.join(adapter.source, WEIGHTS_NAME) if adapter.source else "the adapter"


def peft_lora_tree(adapter: PeftLoraAdapter, base: BaseShapes) -> LoraTree:
    """The adapter as the trainer's LoRA tree, checked against the base's shapes."""
    return peft_to_lora_tree(adapter.modules, base.family, base.weight_shapes, rank=adapter.hyper.rank, where=_weights(adapter))


def imported_metadata(adapter: PeftLoraAdapter, tree: LoraTree, base: BaseShapes, base_uri: str) -> dict[str, Any]:
    """The checkpoint metadata (docs/dev/contracts.md) of an imported adapter."""
    return {
        "family": base.family.name,
        "multimodal": base.family.multimodal,
        "baseModel": base_uri,
        "rank": adapter.hyper.rank,
        "alpha": adapter.hyper.alpha,
        "dropout": adapter.hyper.dropout,
        "targetModules": target_regex(tree, base.family, base.weight_shapes),
        "quantization": None,
        "modulePaths": sorted(tree),
        "numLayers": base.family.num_layers(base.hf_config),
    }


def _publish_orbax(out: str, tree: LoraTree, metadata: dict[str, Any]) -> None:
    """Write an adapter-only checkpoint that appears whole or not at all.

    Locally it is staged and renamed into place; on gs:// Orbax itself makes the step
    visible only when committed (`commit_success.txt`), which a copied local checkpoint
    would lack. Called only after the adapter has been fully validated.
    """
    if storage.is_gcs(out):
        storage.check_replaceable(out, {str(IMPORTED_STEP)})  # an earlier import, or nothing
        if storage.exists(out):  # replaced whole, as a local output is
            storage.delete_tree(out)
        write_lora(out, IMPORTED_STEP, tree, metadata)
        return
    with storage.staged_output_dir(out) as stage:
        write_lora(str(stage), IMPORTED_STEP, tree, metadata)


def convert(
    src_format: str, dst_format: str, source: str, out: str, *, base: str, family: str | None = None, merged: bool = False
) -> None:
    """Convert the adapter at `source` from `src_format` to `dst_format` (`hf-peft` or `orbax`) into `out`."""
    for flag, value in (("--from", src_format), ("--to", dst_format)):
        if value not in FORMATS:
            raise UserError(f"{flag} {value!r} is not a format; use one of {', '.join(FORMATS)}")
    if src_format == dst_format:
        raise UserError(f"--from and --to are both {src_format}: nothing to convert")
    if merged and dst_format != "hf-peft":
        raise UserError("--merged writes an HF model, so it needs --to hf-peft")
    shapes = base_shapes(base, family)
    recorded = storage.absolute_uri(base)  # outputs name the base so that a reader elsewhere finds it
    if src_format == "hf-peft":
        adapter = read_peft_uri(source)
        tree = peft_lora_tree(adapter, shapes)
        _publish_orbax(out, tree, imported_metadata(adapter, tree, shapes, recorded))
        return
    tree, metadata = read_lora(source)
    if metadata["family"] != shapes.family.name:
        raise UserError(f"the checkpoint at {source} is a {metadata['family']} adapter but --base {base} is a {shapes.family.name} model")
    adapter = adapter_from_checkpoint(
        tree, metadata, base=recorded, family=shapes.family, num_layers=shapes.family.num_layers(shapes.hf_config), where=source
    )
    # The Orbax side may come from anywhere: check it fits --base before writing.
    peft_to_lora_tree(adapter.modules, shapes.family, shapes.weight_shapes, rank=adapter.hyper.rank, where=f"the checkpoint at {source}")
    write_adapter_output(adapter, out, merged=merged, base=recorded)


def load_peft_as_lora_tree(
    adapter_uri: str, family_spec: FamilySpec, model: Any, *, rank: int | None = None, alpha: float | None = None
) -> LoraTree:
    """`restoreFrom` of an HF PEFT adapter: its LoRA tree for `model` (a base model of `family_spec`).

    A `rank` other than the adapter's is refused. When the run's `alpha` differs from the
    adapter's (rsLoRA folded), B is rescaled so the restored model computes exactly what
    the adapter did under the run's `alpha / rank`.
    """
    adapter = read_peft_uri(adapter_uri)
    if rank is not None and rank != adapter.hyper.rank:
        raise UserError(f"lora.restoreFrom {adapter_uri} has rank r={adapter.hyper.rank} but lora.rank is {rank}: set lora.rank to {adapter.hyper.rank}")
    shapes = targetable_modules(model, family_spec)
    tree = peft_to_lora_tree(adapter.modules, family_spec, shapes, rank=adapter.hyper.rank, where=_weights(adapter))
    if alpha is not None and not math.isclose(alpha, adapter.hyper.alpha, rel_tol=1e-12):
        factor = np.float32(adapter.hyper.alpha / alpha)
        log.info("restoreFrom %s: adapter alpha %s, run alpha %s: rescaling lora_b by %s", adapter_uri, adapter.hyper.alpha, alpha, factor)
        tree = {p: {n: (v * factor if lora_names.is_up(n) else v) for n, v in params.items()} for p, params in tree.items()}
    return tree


def load_adapter(adapter_uri: str, base: BaseShapes) -> tuple[LoraTree, dict[str, Any]]:
    """An adapter of either format as (LoRA tree, checkpoint-style metadata), checked against `base`."""
    if is_peft_dir(adapter_uri):
        adapter = read_peft_uri(adapter_uri)
        tree = peft_lora_tree(adapter, base)
        return tree, imported_metadata(adapter, tree, base, adapter.hyper.base_model or "")
    tree, metadata = read_lora(adapter_uri)
    check_lora_tree(tree, metadata, adapter_uri)
    if metadata["family"] != base.family.name:
        raise UserError(f"the adapter at {adapter_uri} is for a {metadata['family']} model, but the base is {base.family.name}")
    return tree, metadata
