"""Small helpers the family modules share: reading config.json and refusing what Tunix cannot run."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lora_trainer.errors import UserError


def head_dim(hf_config: Mapping[str, Any]) -> int:
    """config.json `head_dim`, or hidden_size / num_attention_heads when absent (older configs)."""
    value = hf_config.get("head_dim")
    return int(value) if value else int(hf_config["hidden_size"]) // int(hf_config["num_attention_heads"])


def require(hf_config: Mapping[str, Any], family: str, key: str, allowed: tuple[Any, ...], default: Any) -> None:
    """Refuse a config.json setting the family's NNX model does not implement, naming it."""
    value = hf_config.get(key, default)
    if value not in allowed:
        raise UserError(
            f"config.json: {key}={value!r} is not supported for family {family} "
            f"(supported: {', '.join(repr(a) for a in allowed)}); use a checkpoint with a standard {family} config"
        )
