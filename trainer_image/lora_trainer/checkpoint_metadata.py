"""What a LoRA checkpoint's `metadata` and `lora` items must hold, checked before anything uses them.

Why: a checkpoint can come from anywhere (`lora.restoreFrom`, `convert --source`, a bucket others
write), and export, conversion and resume index its metadata and reshape its arrays as the format
(docs/dev/contracts.md) promises. A key missing or of the wrong type, a `lora` item other than the
one `modulePaths` lists, or a layout record that does not fit the stored arrays would surface as a
KeyError or a reshape error deep inside them: here each is one line naming the item and the key.
Pure functions on the restored JSON and numpy arrays.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from lora_trainer import lora_names, storage
from lora_trainer.errors import UserError, shown
from lora_trainer.models.registry import FAMILIES

#: Keys every checkpoint's `metadata` item carries (contracts.md); `write_lora` refuses less.
METADATA_KEYS = ("family", "baseModel", "rank", "alpha", "dropout", "targetModules", "quantization", "modulePaths")
#: The `metadata` key in which `write_lora` records how its `lora` item is laid out.
LAYOUT = "loraLayout"


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _strings(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


#: Each known key's test and the words for what it holds (the optional ones may be absent).
_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "family": (lambda v: v in FAMILIES, f"one of the model families {', '.join(FAMILIES)}"),
    "baseModel": (lambda v: v is None or isinstance(v, str), "the base model's URI (a string) or null"),
    "rank": (lambda v: _int(v) and v >= 1, "a positive integer"),
    "alpha": (lambda v: _number(v) and v > 0, "a positive number"),
    "dropout": (lambda v: v is None or (_number(v) and 0 <= v < 1), "a number in [0, 1) or null"),
    "targetModules": (lambda v: isinstance(v, str), "a regex (a string)"),
    "quantization": (lambda v: v is None or isinstance(v, dict), "an object or null"),
    "modulePaths": (lambda v: _strings(v) and len(set(v)) == len(v), "a list of distinct module paths (strings)"),
    "numLayers": (lambda v: _int(v) and v >= 1, "a positive integer"),
    "multimodal": (lambda v: isinstance(v, bool), "true or false"),
    "step": (lambda v: _int(v) and v >= 0, "a step number (an integer >= 0)"),
    LAYOUT: (lambda v: isinstance(v, dict), "an object"),
}


def check_required(metadata: Mapping[str, Any], where: str) -> None:
    """A writer's check: every key of METADATA_KEYS is present."""
    missing = [k for k in METADATA_KEYS if k not in metadata]
    if missing:
        raise UserError(f"LoRA checkpoint metadata for {where} lacks {missing}; every checkpoint records {list(METADATA_KEYS)}")


def valid_metadata(raw: Any, where: str) -> dict[str, Any]:
    """The `metadata` item of the step `where`, every required key present and every known key of its type."""
    item = f"{where}/metadata"
    if not isinstance(raw, dict):
        raise UserError(f"{item} holds a JSON {type(raw).__name__}, not an object: this is not a LoRA checkpoint of this trainer")
    missing = [k for k in METADATA_KEYS if k not in raw]
    if missing:
        raise UserError(f"{item} lacks the keys {missing}: every LoRA checkpoint records {list(METADATA_KEYS)}")
    for key, (test, what) in _RULES.items():
        if key in raw and not test(raw[key]):
            raise UserError(f"{item}: key {key!r} is {shown(raw[key])}, expected {what}")
    return dict(raw)


def check_item_keys(stored: Any, where: str) -> None:
    """The keys in a `lora` item's `_METADATA` (Orbax's record of its tree, parsed JSON): each a confined name.

    Why before Orbax opens anything: it opens each array at `<step>/lora/<key>.<name>`, so a key
    such as `../../x` or `/tmp/x` reads an array from outside the checkpoint (`storage.confined_name`).
    """
    entries = stored.get("tree_metadata") if isinstance(stored, dict) else None
    if not isinstance(entries, dict):
        raise UserError(f"{where}/lora/_METADATA does not describe a tree (no object 'tree_metadata'): the checkpoint is damaged")
    for entry in entries.values():
        keys = entry.get("key_metadata") if isinstance(entry, dict) else None
        if not isinstance(keys, list) or not all(isinstance(k, dict) and "key" in k for k in keys):
            raise UserError(f"{where}/lora/_METADATA holds an entry without key_metadata: the checkpoint is damaged")
        for k in keys:
            storage.confined_name(str(k["key"]), f"{where}/lora")


def check_layout(layout: Any, stored: Mapping[str, Any], where: str) -> tuple[dict[str, list[int]], dict[str, dict[str, list[int]]]]:
    """(stacked, axes) of a `loraLayout` record that fits the stored `lora` item (see checkpoint._stack_layers)."""
    key = f"{where}/metadata: key {LAYOUT!r}"
    stacked, axes = layout.get("stacked", {}), layout.get("axes", {})
    if not isinstance(stacked, dict) or not isinstance(axes, dict):
        raise UserError(f"{key} must hold objects 'stacked' and 'axes'")
    for template, layers in stacked.items():
        group = stored.get(template)
        if not isinstance(group, Mapping):
            raise UserError(f"{key} lists the stacked group {template!r}, which the lora item does not hold")
        if not (isinstance(layers, list) and layers and all(_int(i) and i >= 0 for i in layers) and len(set(layers)) == len(layers)):
            raise UserError(f"{key}: the layers of {template!r} are {shown(layers)}, expected distinct layer numbers")
        for name, array in group.items():
            if not isinstance(array, np.ndarray) or array.ndim < 1 or array.shape[0] != len(layers):
                raise UserError(
                    f"{key}: {template!r} stacks {len(layers)} layers but its array {name!r} has shape "
                    f"{list(getattr(array, 'shape', []))}"
                )
            order = axes.get(template, {}).get(name) if isinstance(axes.get(template), dict) else None
            if order is not None and sorted(order) != list(range(array.ndim - 1)):
                raise UserError(f"{key}: the axis order of {template}/{name} is {shown(order)}, not an order of its {array.ndim - 1} axes")
    return stacked, axes


def check_lora_tree(tree: Mapping[str, Any], metadata: Mapping[str, Any], where: str) -> None:
    """A `lora` item (per module path, as `read_lora` returns it) as its metadata describes it: the modules
    of `modulePaths`, each with one float LoRA pair (`<w>_lora_a` [..., r], `<w>_lora_b` [r, ...]) of the
    recorded rank. `where` names the checkpoint."""
    item = f"{where}: the lora item of step {metadata.get('step')}"
    listed, held = set(metadata["modulePaths"]), set(tree)
    if listed != held:
        extra, absent = sorted(held - listed), sorted(listed - held)
        found = [f"holds {extra[:3]}, which it does not list" if extra else "", f"lacks {absent[:3]}" if absent else ""]
        raise UserError(f"{item} does not match key 'modulePaths' of its metadata: it " + " and ".join(s for s in found if s))
    rank = metadata["rank"]
    for path, params in sorted(tree.items()):
        names = sorted(params) if isinstance(params, Mapping) else []
        stem = lora_names.weight_of(names[0]) if names else None
        if stem is None or names != list(lora_names.pair(stem)):
            raise UserError(f"{item}: module {path!r} holds {names or type(params).__name__}, expected one pair <w>_lora_a, <w>_lora_b")
        for name, axis in ((names[0], -1), (names[1], 0)):
            array = params[name]
            if not _float_array(array):
                raise UserError(f"{item}: {path}/{name} has dtype {getattr(array, 'dtype', type(array).__name__)}, expected floating point")
            if array.ndim < 2 or array.shape[axis] != rank:
                raise UserError(
                    f"{item}: {path}/{name} has shape {list(array.shape)}, which does not fit key 'rank' {rank} of its "
                    "metadata (lora_a is [..., r], lora_b is [r, ...])"
                )


def _float_array(value: Any) -> bool:
    return isinstance(value, np.ndarray) and (np.issubdtype(value.dtype, np.floating) or value.dtype.name == "bfloat16")

