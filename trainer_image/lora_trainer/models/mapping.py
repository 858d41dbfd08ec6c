"""The HF <-> NNX weight layout, as one declarative table per family.

A `WeightRule` names an HF safetensors key and the NNX parameter it becomes, with the
axes of each written in einops notation using Tunix's axis letters (d = embed,
n = query heads, k = kv heads, h = head_dim, f = MLP hidden, v = vocab). The same rule
converts in both directions, so loading base weights, merging adapters and exporting
PEFT tensors cannot disagree about the head-flatten order or a transpose.

A `LoraTarget` names a LoRA-targetable NNX module and its HF module; its A/B shapes and
their PEFT 2-D flattening follow from the weight rule: HF weights are [out, in], Qwix
creates A over the weight's contracting (input) axes and B over the rest, in the NNX
weight's axis order.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import einops
import numpy as np

HFConfig = Mapping[str, Any]


def _groups(pattern: str) -> list[str]:
    """Top-level axis groups of an einops pattern: '(n h) d' -> ['(n h)', 'd']."""
    return re.findall(r"\([^)]*\)|\S+", pattern)


def _letters(pattern: str) -> list[str]:
    return re.findall(r"[a-z]+", pattern)


@dataclasses.dataclass(frozen=True)
class WeightRule:
    """One HF tensor <-> one NNX parameter. `{i}` in both names stands for the layer index."""

    hf: str
    """HF safetensors key, e.g. `model.layers.{i}.self_attn.q_proj.weight`."""
    nnx: str
    """NNX parameter path joined by `/`, e.g. `layers/{i}/attn/q_proj/w`."""
    hf_axes: str
    """Axes of the HF tensor, e.g. `(n h) d` for a [heads*head_dim, embed] weight."""
    nnx_axes: str
    """Axes of the NNX parameter, e.g. `d n h`."""
    when: Callable[[HFConfig], bool] | None = None
    """Only present when this returns True for the HF config (e.g. untied lm_head)."""

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf

    def applies(self, hf_config: HFConfig) -> bool:
        return self.when is None or self.when(hf_config)

    def to_nnx(self, array: np.ndarray, nnx_shape: tuple[int, ...]) -> np.ndarray:
        """HF tensor -> NNX layout (shape checked by einops against nnx_shape's axis sizes)."""
        sizes = dict(zip(_letters(self.nnx_axes), nnx_shape, strict=True))
        return einops.rearrange(array, f"{self.hf_axes} -> {self.nnx_axes}", **sizes)

    def hf_shape(self, nnx_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The HF tensor shape that corresponds to an NNX parameter shape."""
        sizes = dict(zip(_letters(self.nnx_axes), nnx_shape, strict=True))
        return tuple(int(np.prod([sizes[a] for a in _letters(g)])) for g in _groups(self.hf_axes))


@dataclasses.dataclass(frozen=True)
class LoraTarget:
    """A LoRA-targetable projection: NNX module path <-> HF module name, plus its weight rule."""

    nnx: str
    """NNX module path with `{i}`, e.g. `layers/{i}/attn/q_proj` (what Qwix's regex matches)."""
    hf: str
    """HF module name with `{i}`, e.g. `model.layers.{i}.self_attn.q_proj` (PEFT's key stem)."""
    weight: WeightRule
    """The rule of the module's weight; its HF axes are `<out> <in>`."""

    @property
    def weight_name(self) -> str:
        """The NNX attribute of the weight (`w` or `kernel`); LoRA params are `<it>_lora_a/_b`."""
        return self.weight.nnx.rsplit("/", 1)[1]

    @property
    def _hf_out_in(self) -> tuple[str, str]:
        out, inp = _groups(self.weight.hf_axes)
        return out, inp

    @property
    def a_axes(self) -> str:
        """NNX axes of LoRA A without the rank: the weight's input (contracting) axes."""
        inp = set(_letters(self._hf_out_in[1]))
        return " ".join(a for a in _letters(self.weight.nnx_axes) if a in inp)

    @property
    def b_axes(self) -> str:
        """NNX axes of LoRA B without the rank: the weight's output axes."""
        out = set(_letters(self._hf_out_in[0]))
        return " ".join(a for a in _letters(self.weight.nnx_axes) if a in out)

    def lora_shapes(self, weight_shape: tuple[int, ...], rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(A shape, B shape) as Qwix creates them for an NNX weight of `weight_shape`."""
        sizes = dict(zip(_letters(self.weight.nnx_axes), weight_shape, strict=True))
        a = tuple(sizes[x] for x in self.a_axes.split()) + (rank,)
        b = (rank,) + tuple(sizes[x] for x in self.b_axes.split())
        return a, b

    def to_peft(self, lora_a: Any, lora_b: Any) -> tuple[Any, Any]:
        """NNX (A, B) -> PEFT (`lora_A.weight` [r, in], `lora_B.weight` [out, r])."""
        out, inp = self._hf_out_in
        return (
            einops.rearrange(lora_a, f"{self.a_axes} r -> r {inp}"),
            einops.rearrange(lora_b, f"r {self.b_axes} -> {out} r"),
        )

    def from_peft(self, peft_a: Any, peft_b: Any, weight_shape: tuple[int, ...]) -> tuple[Any, Any]:
        """PEFT (`lora_A.weight`, `lora_B.weight`) -> NNX (A, B) for an NNX weight of `weight_shape`."""
        out, inp = self._hf_out_in
        sizes = dict(zip(_letters(self.weight.nnx_axes), weight_shape, strict=True))
        return (
            einops.rearrange(peft_a, f"r {inp} -> {self.a_axes} r", **{a: sizes[a] for a in self.a_axes.split()}),
            einops.rearrange(peft_b, f"{out} r -> r {self.b_axes}", **{a: sizes[a] for a in self.b_axes.split()}),
        )


def expand(template: str, layer: int | None) -> str:
    return template if layer is None else template.replace("{i}", str(layer))


def expand_rules(rules: tuple[WeightRule, ...], hf_config: HFConfig, num_layers: int) -> Iterator[tuple[str, str, WeightRule]]:
    """(hf key, nnx path, rule) for every tensor of a model with `num_layers` layers."""
    for rule in rules:
        if not rule.applies(hf_config):
            continue
        layers: list[int | None] = list(range(num_layers)) if rule.per_layer else [None]
        for i in layers:
            yield expand(rule.hf, i), expand(rule.nnx, i), rule


def head_dim(hf_config: Mapping[str, Any]) -> int:
    """config.json `head_dim`, or hidden_size / num_attention_heads when absent (older configs)."""
    value = hf_config.get("head_dim")
    return int(value) if value else int(hf_config["hidden_size"]) // int(hf_config["num_attention_heads"])


def axis_sizes(hf_config: Mapping[str, Any]) -> dict[str, int]:
    """Sizes of the weight tables' axis letters (d embed, n query heads, k kv heads, h head_dim, f MLP, v vocab)."""
    heads = int(hf_config["num_attention_heads"])
    return {
        "d": int(hf_config["hidden_size"]),
        "n": heads,
        "k": int(hf_config.get("num_key_value_heads") or heads),
        "h": head_dim(hf_config),
        "f": int(hf_config["intermediate_size"]),
        "v": int(hf_config["vocab_size"]),
    }
