"""The LoRA tree <-> PEFT mapping as pure functions (no model runs)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from lora_trainer.adapters.mapping import lora_tree_to_peft, peft_to_lora_tree, short_names, target_regex
from lora_trainer.errors import UserError
from lora_trainer.models import get_family

#: A Gemma-3-shaped config (GQA, head_dim != hidden / heads) small enough to map in microseconds.
CONFIG = {"hidden_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
          "intermediate_size": 40, "vocab_size": 64, "num_hidden_layers": 3}  # fmt: skip


@pytest.fixture(scope="module")
def gemma3():
    family = get_family("gemma3")
    return family, family.lora_weight_shapes(CONFIG)


def _random_tree(family, shapes, rank, rng):
    tree = {}
    for path, shape in shapes.items():
        target, _ = family.target_for_path(path)
        a_shape, b_shape = target.lora_shapes(shape, rank)
        w = target.weight_name
        tree[path] = {f"{w}_lora_a": rng.standard_normal(a_shape).astype(np.float32), f"{w}_lora_b": rng.standard_normal(b_shape).astype(np.float32)}
    return tree


def test_tree_to_peft_and_back_is_exact_and_uses_hf_layouts(gemma3):
    family, shapes = gemma3
    tree = _random_tree(family, shapes, 3, np.random.default_rng(0))
    peft = lora_tree_to_peft(tree, family)
    a, b = peft["model.layers.2.self_attn.q_proj"]
    assert a.shape == (3, 48) and b.shape == (4 * 8, 3)  # [r, in], [out, r]
    a, b = peft["model.layers.0.self_attn.o_proj"]
    assert a.shape == (3, 4 * 8) and b.shape == (48, 3)
    # q_einsum's B is [r, heads, head_dim]: PEFT's output row n*head_dim + h is head n, dim h.
    q_b = tree["layers/1/attn/q_einsum"]["w_lora_b"]
    assert np.array_equal(peft["model.layers.1.self_attn.q_proj"][1][2 * 8 + 5], q_b[:, 2, 5])
    back = peft_to_lora_tree(peft, family, shapes, rank=3)
    assert sorted(back) == sorted(tree)
    for path in tree:
        for name in tree[path]:
            assert np.array_equal(back[path][name], tree[path][name]), f"{path}/{name}"
    assert short_names(peft) == ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")


def test_layer_beyond_the_base_is_refused(gemma3):
    family, shapes = gemma3
    tree = _random_tree(family, {"layers/0/mlp/up_proj": shapes["layers/0/mlp/up_proj"]}, 2, np.random.default_rng(1))
    peft = {m.replace("layers.0", "layers.7"): ab for m, ab in lora_tree_to_peft(tree, family).items()}
    with pytest.raises(UserError, match=r"layers\.7\.mlp\.up_proj\.lora_A\.weight targets layer 7, but the base model has 3 layers"):
        peft_to_lora_tree(peft, family, shapes, rank=2)


def test_target_regex_matches_exactly_the_adapters_modules(gemma3):
    family, shapes = gemma3
    assert target_regex(shapes, family, shapes) == family.auto_target_regex
    qv = [p for p in shapes if p.endswith(("q_einsum", "v_proj"))]
    regex = target_regex(qv, family, shapes)
    assert regex == r"layers/\d+/(attn/kv_einsum/v_proj|attn/q_einsum)"
    some = ["layers/0/attn/q_einsum", "layers/2/mlp/down_proj"]
    regex = target_regex(some, family, shapes)
    assert {p for p in shapes if re.fullmatch(regex, p)} == set(some)
