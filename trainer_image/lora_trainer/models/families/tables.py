"""The light half of the family helpers: the Llama-style weight tables and the lazy model builder.

Imports no JAX: a family's declaration (`families/<name>/__init__.py`) uses these, and detection,
the registry and `config.Family` read the declarations without loading any model code.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from lora_trainer.models.mapping import LoraTarget, WeightRule


def untied(hf_config: Mapping[str, Any]) -> bool:
    """True when config.json has a separate lm_head (tie_word_embeddings false)."""
    return not hf_config.get("tie_word_embeddings", False)


#: HF layer prefix shared by the Llama-style families (Llama 3, Qwen3, Qwen2).
LAYER = "model.layers.{i}"

#: The `auto` targets of a Llama-style model: every attention and MLP projection. Checkpoints record the
#: resolved regex and a resume compares it, so the text stays as it is.
LLAMA_STYLE_AUTO = r"layers/\d+/(attn/(q_proj|k_proj|v_proj|o_proj)|mlp/(gate_proj|up_proj|down_proj))"

#: The seven projections of a Llama-style decoder layer: (HF module, NNX module, weight, HF axes, NNX axes).
_PROJECTIONS = (
    ("self_attn.q_proj", "attn/q_proj", "w", "(n h) d", "d n h"),
    ("self_attn.k_proj", "attn/k_proj", "w", "(k h) d", "d k h"),
    ("self_attn.v_proj", "attn/v_proj", "w", "(k h) d", "d k h"),
    ("self_attn.o_proj", "attn/o_proj", "w", "d (n h)", "n h d"),
    ("mlp.gate_proj", "mlp/gate_proj", "kernel", "f d", "d f"),
    ("mlp.up_proj", "mlp/up_proj", "kernel", "f d", "d f"),
    ("mlp.down_proj", "mlp/down_proj", "kernel", "d f", "f d"),
)


def llama_style_tables(extra: tuple[WeightRule, ...] = ()) -> tuple[tuple[WeightRule, ...], tuple[LoraTarget, ...]]:
    """(weight table, LoRA targets) of a Tunix Llama-style model (llama3, qwen3, qwen2 share the layout).

    `extra` adds family-specific tensors (Qwen3's q/k norms, Qwen2's q/k/v biases).
    """
    projections = {
        nnx_mod: WeightRule(f"{LAYER}.{hf_mod}.weight", f"layers/{{i}}/{nnx_mod}/{w}", hf_axes, nnx_axes)
        for hf_mod, nnx_mod, w, hf_axes, nnx_axes in _PROJECTIONS
    }
    weights = (
        WeightRule("model.embed_tokens.weight", "embedder/input_embedding", "v d", "v d"),
        WeightRule(f"{LAYER}.input_layernorm.weight", "layers/{i}/input_layernorm/w", "d", "d"),
        WeightRule(f"{LAYER}.post_attention_layernorm.weight", "layers/{i}/post_attention_layernorm/w", "d", "d"),
        *projections.values(),
        *extra,
        WeightRule("model.norm.weight", "final_norm/w", "d", "d"),
        WeightRule("lm_head.weight", "lm_head/w", "v d", "d v", when=untied),
    )
    targets = tuple(
        LoraTarget(f"layers/{{i}}/{nnx_mod}", f"{LAYER}.{hf_mod}", projections[nnx_mod])
        for hf_mod, nnx_mod, *_ in _PROJECTIONS
    )
    return weights, targets


def lazy_build(module: str) -> Callable[[Mapping[str, Any], Any, Any], Any]:
    """The `build` of `module`, imported at its first call.

    Why: the family's model code imports Tunix, which pulls in torch, pandas and
    tensorboardX (~3 s). Export and conversion need only the weight and LoRA tables, so an
    AdapterConversion Job or the post-training export never pays for it.
    """

    def build(hf_config: Mapping[str, Any], dtype: Any, rngs: Any) -> Any:
        return importlib.import_module(module).build(hf_config, dtype, rngs)

    return build
