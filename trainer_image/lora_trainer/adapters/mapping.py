"""The trainer's LoRA tree <-> PEFT tensors, through the family's one HF <-> NNX table.

Pure functions on numpy arrays. The layout knowledge (which NNX module is which HF
module, the head-flatten order, which axes are contracting) lives in the family's
`LoraTarget`s in `lora_trainer.models`; this module only walks the adapter, calls those
targets, and checks that every tensor fits the base model before anything is written,
so a bad adapter fails with its key named and leaves no output.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import einops
import numpy as np

from lora_trainer import lora_names
from lora_trainer.adapters.peft_format import KEY_PREFIX
from lora_trainer.errors import UserError
from lora_trainer.models.mapping import expand
from lora_trainer.models.spec import FamilySpec

LoraTree = dict[str, dict[str, np.ndarray]]
PeftModules = dict[str, tuple[np.ndarray, np.ndarray]]


def _known_modules(family: FamilySpec) -> str:
    return ", ".join(t.hf.replace("{i}", "N") for t in family.lora_targets)


def lora_tree_to_peft(tree: Mapping[str, Mapping[str, Any]], family: FamilySpec, where: str = "the checkpoint") -> PeftModules:
    """`{module_path: {"<w>_lora_a": A, "<w>_lora_b": B}}` -> `{hf_module: (lora_A [r, in], lora_B [out, r])}`.

    Errors start with `where`, which names the checkpoint.
    """
    modules: PeftModules = {}
    for path, params in sorted(tree.items()):
        try:
            target, layer = family.target_for_path(path)
        except KeyError:
            raise UserError(
                f"{where} has LoRA parameters for {path!r}, which is not a LoRA-targetable module of family "
                f"{family.name}; it cannot be expressed as an HF PEFT adapter"
            ) from None
        names = lora_names.pair(target.weight_name)
        if set(params) != set(names):
            raise UserError(f"{where}: the LoRA parameters for {path!r} are {sorted(params)}, expected {list(names)}")
        try:
            a, b = target.to_peft(np.asarray(params[names[0]]), np.asarray(params[names[1]]))
        except einops.EinopsError as e:
            shapes = [list(np.shape(params[n])) for n in names]
            raise UserError(f"{where}: the LoRA parameters for {path!r} have shapes {shapes}, which a {family.name} {target.hf} cannot have ({e})") from e
        modules[expand(target.hf, layer)] = (a, b)  # transposed views; safetensors writes them in C order
    return modules


def peft_to_lora_tree(
    modules: Mapping[str, tuple[np.ndarray, np.ndarray]],
    family: FamilySpec,
    weight_shapes: Mapping[str, tuple[int, ...]],
    *,
    rank: int,
    where: str = "the adapter",
) -> LoraTree:
    """PEFT modules -> the trainer's LoRA tree, checked against the base model's weight shapes.

    `weight_shapes` is `{module_path: NNX weight shape}` of every LoRA-targetable module of
    the base model (`lora_trainer.lora.targetable_modules` of the abstract model); errors start
    with `where`, which names the adapter's file.
    """
    tree: LoraTree = {}
    for hf_module, (peft_a, peft_b) in sorted(modules.items()):
        try:
            target, layer = family.target_for_hf_module(hf_module)
        except KeyError:
            raise UserError(
                f"{where}: adapter tensor {KEY_PREFIX}{hf_module}.lora_A.weight targets {hf_module!r}, which the {family.name} "
                f"mapping does not know; LoRA-targetable modules are: {_known_modules(family)}"
            ) from None
        path = expand(target.nnx, layer)
        if path not in weight_shapes:
            raise UserError(
                f"{where}: adapter tensor {KEY_PREFIX}{hf_module}.lora_A.weight targets layer {layer}, but the base model has "
                f"{len({p.split('/')[1] for p in weight_shapes})} layers: the adapter was made for a different base model"
            )
        weight_shape = weight_shapes[path]
        out_dim, in_dim = target.weight.hf_shape(weight_shape)
        for key, got, want in (
            ("lora_A", peft_a.shape, (rank, in_dim)),
            ("lora_B", peft_b.shape, (out_dim, rank)),
        ):
            if tuple(got) != want:
                raise UserError(
                    f"{where}: adapter tensor {KEY_PREFIX}{hf_module}.{key}.weight has shape {list(got)} but the base model's "
                    f"{hf_module} needs {list(want)} (r={rank}, weight [out={out_dim}, in={in_dim}]): the adapter does "
                    "not fit this base model"
                )
        a, b = target.from_peft(peft_a, peft_b, weight_shape)
        # Views, not copies: Orbax and device_put copy them anyway.
        tree[path] = dict(zip(lora_names.pair(target.weight_name), (a, b), strict=True))
    return tree


def target_regex(module_paths: Iterable[str], family: FamilySpec, all_paths: Iterable[str]) -> str:
    """A targetModules regex that full-matches exactly `module_paths` among the model's `all_paths`.

    The family's `auto` regex when the adapter covers every projection, per-projection over
    every layer (`layers/\\d+/(attn/q_proj|...)`) when it covers whole projections, else the
    explicit list of paths.
    """
    chosen, every = set(module_paths), set(all_paths)
    if chosen == every:
        return family.auto_target_regex
    kinds = sorted({t.nnx for t in family.lora_targets if any(_matches(t.nnx, p) for p in chosen)})
    regex = "layers/\\d+/(" + "|".join(re.escape(k.split("{i}/", 1)[1]) for k in kinds) + ")" if all(
        k.startswith("layers/{i}/") for k in kinds
    ) else ""
    if regex and {p for p in every if re.fullmatch(regex, p)} == chosen:
        return regex
    return "(" + "|".join(re.escape(p) for p in sorted(chosen)) + ")"


def _matches(template: str, path: str) -> bool:
    prefix, _, suffix = template.partition("{i}")
    middle = path[len(prefix) : len(path) - len(suffix)] if path.startswith(prefix) and path.endswith(suffix) else ""
    return middle.isdigit()


def short_names(hf_modules: Iterable[str]) -> tuple[str, ...]:
    """PEFT's `target_modules`: the last component of each HF module name (`q_proj`, ...)."""
    return tuple(sorted({m.rsplit(".", 1)[-1] for m in hf_modules}))


def peft_target_modules(hf_modules: Iterable[str], family: FamilySpec, num_layers: int | None = None) -> tuple[str, ...] | str:
    """PEFT's `target_modules` for an adapter on these HF modules: their short names, or for the
    decoder of a multimodal model a regex that keeps them inside it (the vision tower has its own
    `q_proj`, `k_proj` and `v_proj`, which short names would adapt too).

    An adapter on some layers only (`num_layers` known, the base's) gets a regex of exactly its
    modules: short names would make PEFT wrap every layer (and train the extra ones when the
    adapter is trained further).
    """
    modules = sorted(set(hf_modules))
    names = short_names(modules)
    if num_layers is not None:
        every = {expand(t.hf, i) for t in family.lora_targets if t.hf.rsplit(".", 1)[-1] in names for i in range(num_layers)}
        if set(modules) != every:
            return "(" + "|".join(re.escape(m) for m in modules) + ")"
    if not family.multimodal:
        return names
    assert family.nested_text is not None
    return re.escape(family.nested_text.module_prefix) + r".*\.(" + "|".join(names) + ")"
