"""`restoreFrom` of an HF PEFT adapter: the same tree `convert` stores, rank checked, alpha folded into B."""

from __future__ import annotations

import numpy as np
import pytest
from hf_side import make_peft_adapter

from lora_trainer.adapters.convert import convert, load_peft_as_lora_tree
from lora_trainer.checkpoint import read_lora
from lora_trainer.errors import UserError
from lora_trainer.models import get_family
from lora_trainer.models.loading import build_abstract, read_hf_config


@pytest.fixture(scope="module")
def setup(tiny_base, tmp_path_factory):
    base = tiny_base("gemma3")
    adapter = make_peft_adapter(base, tmp_path_factory.mktemp("restore") / "peft", rank=4, alpha=8.0, seed=5)
    family = get_family("gemma3")
    model = build_abstract(family, read_hf_config(base), "float32")  # shapes are all restoreFrom needs
    return base, adapter, family, model


def test_tree_equals_the_converted_checkpoint(setup, tmp_path):
    base, adapter, family, model = setup
    tree = load_peft_as_lora_tree(str(adapter), family, model, rank=4, alpha=8.0)
    convert("hf-peft", "orbax", str(adapter), str(tmp_path / "orbax"), base=str(base))
    stored, _ = read_lora(str(tmp_path / "orbax"))
    assert sorted(tree) == sorted(stored)
    for path, params in tree.items():
        for name, arr in params.items():
            assert np.array_equal(arr, stored[path][name]), f"{path}/{name}"


def test_rank_mismatch_is_refused(setup):
    _, adapter, family, model = setup
    with pytest.raises(UserError, match="rank r=4 but lora.rank is 8"):
        load_peft_as_lora_tree(str(adapter), family, model, rank=8)


def test_other_alpha_rescales_b_exactly(setup):
    _, adapter, family, model = setup
    same = load_peft_as_lora_tree(str(adapter), family, model, alpha=8.0)
    doubled = load_peft_as_lora_tree(str(adapter), family, model, alpha=16.0)
    for path, params in same.items():
        for name, arr in params.items():
            # scale alpha/r doubles, so B halves: the product B @ A * alpha / r is unchanged.
            want = arr * np.float32(0.5) if name.endswith("_lora_b") else arr
            assert np.array_equal(doubled[path][name], want), f"{path}/{name}"
