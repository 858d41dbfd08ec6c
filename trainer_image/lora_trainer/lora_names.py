"""The names of a weight's LoRA pair, as Qwix gives them: `<weight>_lora_a` and `<weight>_lora_b`.

Why one module: the trainer's LoRA state, its checkpoints, their metadata checks and the HF PEFT
mapping all key LoRA params by these names; spelled out in each, a change in Qwix would be
followed in some and not others. Pure strings, so the adapter tools import it without JAX.
"""

from __future__ import annotations

A = "_lora_a"
B = "_lora_b"


def pair(weight: str) -> tuple[str, str]:
    """The LoRA params of `weight` (`w`, `kernel`): its down (A) and up (B) projections' names."""
    return weight + A, weight + B


def weight_of(name: str) -> str | None:
    """The weight a LoRA param named `name` belongs to; None when `name` is not a LoRA param's."""
    for suffix in (A, B):
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return None


def is_up(name: str) -> bool:
    """Whether `name` is a B (up-projection) param: the one LoRA's alpha/rank scale is folded into."""
    return name.endswith(B) and weight_of(name) is not None
