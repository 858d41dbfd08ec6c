"""Tiny random HF checkpoints with each family's real hyperparameter shape, built offline.

Every test and the local demo need a base model, and nothing here may reach a model hub.
These builders write what `save_pretrained` writes for the real models (config.json,
safetensors, tokenizer files), only small: 2 layers, hidden 64, head_dim 16, GQA with
4 query / 2 key-value heads, and the family's real quirks (Llama 3.1's `rope_scaling` of
type `llama3` and theta 500000, Qwen3's qk-norm and theta 1e6, Qwen2.5's q/k/v bias,
Gemma 3's sliding-window/global layers, local rope base, +1 norms and embedding scale).
Defaults that would hide layout bugs (square projections, MHA, zero weights) are avoided.
Weights are random but not tiny, so a mapping error shows up as a large logit difference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: Special tokens every tiny tokenizer carries; the chat template uses the last two.
SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|start|>", "<|end|>")

#: A ChatML-like template. `{% generation %}` marks assistant text so data code can ask
#: `apply_chat_template(..., return_assistant_tokens_mask=True)` for the loss mask.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}\n"
    "{% else %}{{ message['content'] }}<|end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. ",
    "A LoRA adapter adds a low-rank update to a frozen weight matrix. ",
    "Question: what is two plus two? Answer: four. ",
    "user assistant system: hello, how are you today? I am fine, thank you. ",
    "0123456789 +-*/=()[]{}<>,.;:!?'\" the and of to in is it that for on with as ",
)

#: Shared by every family: tiny, with GQA (4 query heads / 2 KV heads) and an explicit head_dim.
_COMMON: dict[str, Any] = {
    "vocab_size": 272,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "initializer_range": 0.2,
}

def _family_configs() -> dict[str, dict[str, Any]]:
    """Per-family config.json fields on top of _COMMON: each family's `tiny_config` (its declaration)."""
    from lora_trainer.models.registry import FAMILIES, get_family

    return {name: dict(get_family(name).tiny_config) for name in FAMILIES}


#: Multimodal kinds: kind -> (the decoder's family, the config.json fields around its `text_config`).
#: Gemma 3 4B-27B's layout (`Gemma3ForConditionalGeneration`: a SigLIP vision tower, a projector
#: and the family's decoder as `text_config`), the vision side tiny too.
MULTIMODAL: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma3-multimodal": ("gemma3", {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
        },
        "mm_tokens_per_image": 4,
        # Ids at the top of the tiny vocabulary, which the tiny tokenizer never produces.
        "boi_token_index": 268,
        "eoi_token_index": 269,
        "image_token_index": 270,
    }),
}


def _decoder_family(kind: str) -> str:
    """The family of a tiny model kind's decoder: the kind itself, or a `MULTIMODAL` kind's decoder."""
    return MULTIMODAL[kind][0] if kind in MULTIMODAL else kind


def tiny_config_dict(family: str, **overrides: Any) -> dict[str, Any]:
    """The config.json fields of a tiny model of `family` (before token ids are added).

    For a `MULTIMODAL` kind, `overrides` apply to the decoder's `text_config`.
    """
    if family in MULTIMODAL:
        decoder, outer = MULTIMODAL[family]
        text = tiny_config_dict(decoder, **overrides)
        del text["architectures"]
        return {**outer, "text_config": text, "tie_word_embeddings": text["tie_word_embeddings"]}
    configs = _family_configs()
    if family not in configs:
        raise ValueError(f"no tiny model for family {family!r}; known: {sorted(configs) + sorted(MULTIMODAL)}")
    cfg = {**_COMMON, **configs[family], **overrides}
    if "num_hidden_layers" in overrides and "layer_types" in cfg and "layer_types" not in overrides:
        pattern = ("sliding_attention", "full_attention")
        cfg["layer_types"] = [pattern[i % 2] for i in range(cfg["num_hidden_layers"])]
    return cfg


def build_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer trained on a built-in corpus, as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_CORPUS) * 8, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|start|>", "<|end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _hf_model(family: str, cfg: dict[str, Any], seed: int) -> Any:
    """The transformers model for a config dict, with every weight random (norms too)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**cfg)  # a multimodal kind: AutoModelForCausalLM builds the whole model
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                # Non-trivial norm scales catch a missing or doubled `1 +` and swapped norms.
                # Gemma stores w of a `(1 + w)` scale, the others the scale itself.
                offset = 0.0 if _decoder_family(family) == "gemma3" else 1.0
                p.copy_(offset + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (p.shape[-1] ** -0.5))
    return model.eval()


def make_tiny_hf_model(
    family: str, out_dir: str | Path, *, seed: int = 0, sharded: bool = False, **overrides: Any
) -> Path:
    """Write a tiny random HF checkpoint of `family` (config, safetensors, tokenizer) to out_dir.

    `overrides` replace config.json fields (e.g. `num_hidden_layers=4, hidden_size=128`);
    `sharded=True` writes several safetensors shards plus `model.safetensors.index.json`.
    Returns out_dir.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config_dict(family, **overrides)
    text = cfg.get("text_config", cfg)
    tokenizer = build_tokenizer(text["vocab_size"])
    if len(tokenizer) > text["vocab_size"]:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but vocab_size is {text['vocab_size']}")
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    cfg.update(ids)
    text.update(ids)
    model = _hf_model(family, cfg, seed)
    max_shard = "64KB" if sharded else "2GB"
    model.save_pretrained(out, safe_serialization=True, max_shard_size=max_shard)
    tokenizer.save_pretrained(out)
    return out
