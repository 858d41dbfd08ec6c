"""Tiny HF base models per family, built once per session (each takes a few seconds)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # hf_side is a helper module beside the tests


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory: pytest.TempPathFactory):
    """`tiny_base(family, sharded=False)` -> directory of a tiny random HF checkpoint (cached)."""
    from lora_trainer.tiny_models import make_tiny_hf_model

    made: dict[tuple[str, bool], Path] = {}

    def get(family: str, sharded: bool = False) -> Path:
        key = (family, sharded)
        if key not in made:
            made[key] = make_tiny_hf_model(family, tmp_path_factory.mktemp(f"base-{family}"), sharded=sharded)
        return made[key]

    return get
