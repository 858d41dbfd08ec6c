"""`FamilySpec`: everything the trainer and the adapter code need to know about one model family."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
from flax import nnx

from lora_trainer.models.families.common import axis_sizes
from lora_trainer.models.mapping import LoraTarget, WeightRule, expand

HFConfig = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """One model family: how to build its Tunix NNX model and how its weights map to HF.

    `build(hf_config, dtype, rngs)` returns the NNX model with every hyperparameter taken
    from config.json; `weights` is the one HF <-> NNX table used for loading, merging and
    export; `lora_targets` lists the projections LoRA can target with their HF module names.
    """

    name: str
    """Registry key, as in the train config's `model.family`."""
    model_types: tuple[str, ...]
    """config.json `model_type` values of this family."""
    architectures: tuple[str, ...]
    """config.json `architectures` entries of this family."""
    build: Callable[[HFConfig, jnp.dtype, nnx.Rngs], nnx.Module]
    """Build the NNX model (random weights) from config.json; raises UserError on unsupported settings."""
    weights: tuple[WeightRule, ...]
    """HF <-> NNX weight table."""
    lora_targets: tuple[LoraTarget, ...]
    """LoRA-targetable projections."""
    auto_target_regex: str
    """The `auto` targetModules regex (from target_modules.yaml): all attention and MLP projections."""

    def num_layers(self, hf_config: HFConfig) -> int:
        return int(hf_config["num_hidden_layers"])

    def module_paths(self, hf_config: HFConfig) -> list[str]:
        """Every LoRA-targetable NNX module path of a model, e.g. `layers/0/attn/q_proj`."""
        n = self.num_layers(hf_config)
        return [expand(t.nnx, i) for i in range(n) for t in self.lora_targets]

    def lora_weight_shapes(self, hf_config: HFConfig) -> dict[str, tuple[int, ...]]:
        """{module path: NNX weight shape} of every LoRA target, from config.json alone.

        For the adapter converter, which needs only these shapes: building even an abstract
        8B model (`nnx.eval_shape`) takes seconds.
        """
        sizes = axis_sizes(hf_config)
        return {
            expand(t.nnx, i): tuple(sizes[a] for a in t.weight.nnx_axes.split())
            for i in range(self.num_layers(hf_config))
            for t in self.lora_targets
        }

    def target_for_path(self, module_path: str) -> tuple[LoraTarget, int]:
        """The LoraTarget and layer index of an NNX module path; KeyError if unknown."""
        for target in self.lora_targets:
            prefix, suffix = target.nnx.split("{i}")
            if module_path.startswith(prefix) and module_path.endswith(suffix):
                middle = module_path[len(prefix) : len(module_path) - len(suffix)]
                if middle.isdigit():
                    return target, int(middle)
        raise KeyError(module_path)

    def target_for_hf_module(self, hf_module: str) -> tuple[LoraTarget, int]:
        """The LoraTarget and layer index of an HF module name (`model.layers.3.self_attn.q_proj`)."""
        for target in self.lora_targets:
            prefix, suffix = target.hf.split("{i}")
            if hf_module.startswith(prefix) and hf_module.endswith(suffix):
                middle = hf_module[len(prefix) : len(hf_module) - len(suffix)]
                if middle.isdigit():
                    return target, int(middle)
        raise KeyError(hf_module)

    def hf_module_name(self, module_path: str) -> str:
        """NNX module path -> HF module name (`layers/0/attn/q_proj` -> `model.layers.0.self_attn.q_proj`)."""
        target, i = self.target_for_path(module_path)
        return expand(target.hf, i)

    def nnx_module_path(self, hf_module: str) -> str:
        """HF module name -> NNX module path."""
        target, i = self.target_for_hf_module(hf_module)
        return expand(target.nnx, i)
