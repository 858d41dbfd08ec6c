"""`FamilySpec`: everything the trainer and the adapter code need to know about one model family."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from lora_trainer.models.mapping import LoraTarget, WeightRule, axis_sizes, expand

if TYPE_CHECKING:  # the declarations are read without JAX (detection, config.Family)
    import jax.numpy as jnp
    from flax import nnx

HFConfig = Mapping[str, Any]
#: How the families' tables write the HF names of the decoder: `model.layers.{i}...`, `model.norm.weight`.
_DECODER = "model."


@dataclasses.dataclass(frozen=True)
class NestedText:
    """Where a multimodal checkpoint of a family keeps the text decoder the family trains.

    Gemma 3 4B-27B ship as `Gemma3ForConditionalGeneration` (model_type `gemma3`), with a vision
    tower beside the decoder. Only the decoder is trained, and three things move with it:
    its config is config.json's `text_config`, which transformers writes sparse (the rest are
    the text config class's defaults); its modules are named `model.language_model.*` in the HF
    model, so PEFT's keys and vLLM's LoRA loader use that prefix; and its tensors are stored as
    `language_model.model.*` (transformers' legacy on-disk names, which it still writes; some
    checkpoints store the module names instead).
    """

    model_type: str
    """config.json `model_type` of the multimodal checkpoints."""
    config_key: str
    """config.json key of the decoder's config."""
    defaults: Mapping[str, Any]
    """The decoder config class's defaults, for keys the sparse `text_config` leaves out."""
    module_prefix: str
    """What stands for `model.` in the decoder's HF module names."""
    tensor_prefixes: tuple[str, ...]
    """What stands for `model.` in the decoder's stored tensor names, the usual first."""


def _renamed(name: str, prefix: str) -> str:
    assert name.startswith(_DECODER), name
    return prefix + name[len(_DECODER) :]


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
    """The `auto` targetModules regex: all attention and MLP projections (full-matched against NNX module
    paths such as `layers/0/attn/q_proj`)."""
    nested_text: NestedText | None = None
    """Multimodal checkpoints whose text decoder this family trains (None: text-only checkpoints only)."""
    multimodal: bool = False
    """True for `multimodal_view()`: the HF names are those of the decoder inside a multimodal model."""
    decoder_tensors: str = _DECODER
    """The prefix of the decoder's stored tensor names; a multimodal checkpoint's others are its vision side."""
    tiny_config: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)
    """config.json fields of the family's tiny test model on top of `tiny_models`' shared ones (`model_type`
    and `architectures` included), as in the real checkpoints."""

    def for_checkpoint(self, hf_config: HFConfig, tensor_keys: Iterable[str] = ()) -> tuple[FamilySpec, dict[str, Any]]:
        """(the spec with this checkpoint's HF names, the decoder's config): what loading and conversion use.

        A text-only checkpoint gets this spec and its own config.json; a multimodal one the
        `multimodal_view` (its tensor names as `tensor_keys` store them) and the full `text_config`.
        """
        nested = self.nested_text
        if nested is None or hf_config.get("model_type") != nested.model_type:
            return self, dict(hf_config)
        keys = list(tensor_keys)
        prefix = next((p for p in nested.tensor_prefixes if any(k.startswith(p) for k in keys)), nested.tensor_prefixes[0])
        return self.multimodal_view(prefix), {**nested.defaults, **(hf_config.get(nested.config_key) or {})}

    def multimodal_view(self, tensor_prefix: str | None = None) -> FamilySpec:
        """This family with the HF names of its decoder inside a multimodal checkpoint (`nested_text`)."""
        nested = self.nested_text
        if nested is None:
            raise ValueError(f"family {self.name} has no multimodal checkpoints")
        if self.multimodal:
            return self
        prefix = tensor_prefix or nested.tensor_prefixes[0]
        weights = {rule: dataclasses.replace(rule, hf=_renamed(rule.hf, prefix)) for rule in self.weights}
        targets = tuple(
            dataclasses.replace(t, hf=_renamed(t.hf, nested.module_prefix), weight=weights[t.weight]) for t in self.lora_targets
        )
        return dataclasses.replace(
            self, weights=tuple(weights.values()), lora_targets=targets, multimodal=True, decoder_tensors=prefix
        )

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
            layer = _layer_in(target.nnx, module_path)
            if layer is not None:
                return target, layer
        raise KeyError(module_path)

    def target_for_hf_module(self, hf_module: str) -> tuple[LoraTarget, int]:
        """The LoraTarget and layer index of an HF module name (`model.layers.3.self_attn.q_proj`).

        A multimodal decoder's module may also carry its stored-tensor prefix: transformers 4.50-4.51
        named the modules so (`language_model.model.layers...`), PEFT adapters saved then keep those
        keys, and PEFT still loads them on today's models.
        """
        if self.multimodal and self.nested_text is not None:
            for prefix in self.nested_text.tensor_prefixes:
                if hf_module.startswith(prefix):
                    hf_module = self.nested_text.module_prefix + hf_module[len(prefix) :]
                    break
        for target in self.lora_targets:
            layer = _layer_in(target.hf, hf_module)
            if layer is not None:
                return target, layer
        raise KeyError(hf_module)

    def hf_module_name(self, module_path: str) -> str:
        """NNX module path -> HF module name (`layers/0/attn/q_proj` -> `model.layers.0.self_attn.q_proj`)."""
        target, i = self.target_for_path(module_path)
        return expand(target.hf, i)

    def nnx_module_path(self, hf_module: str) -> str:
        """HF module name -> NNX module path."""
        target, i = self.target_for_hf_module(hf_module)
        return expand(target.nnx, i)


def _layer_in(template: str, name: str) -> int | None:
    """The layer index `name` fills into `template`'s `{i}` (`layers/{i}/attn/q_proj`); None if it does not match."""
    prefix, suffix = template.split("{i}")
    if len(name) <= len(prefix) + len(suffix) or not (name.startswith(prefix) and name.endswith(suffix)):
        return None
    middle = name[len(prefix) : len(name) - len(suffix)]
    return int(middle) if middle.isdigit() else None
