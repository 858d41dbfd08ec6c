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


@pytest.mark.slow
def test_training_starts_from_a_peft_adapter(tiny_base, tmp_path):
    """`lora.restoreFrom` of an adapter made by `peft`: the run starts from exactly its weights
    (a learning rate of 1e-12 keeps one step from moving them visibly), and exports them back."""
    import json

    from safetensors.numpy import load_file

    from lora_trainer.adapters.export import export_checkpoint
    from lora_trainer.adapters.peft_format import WEIGHTS_NAME
    from lora_trainer.config import TrainConfig
    from lora_trainer.train import run_training

    base = tiny_base("llama3")
    adapter = make_peft_adapter(base, tmp_path / "peft", rank=4, alpha=8.0, seed=6)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"text": f"hello world {i}"}) + "\n" for i in range(4)))
    cfg = TrainConfig.model_validate(
        {
            "model": {"source": str(base), "dtype": "float32"},
            "dataset": {"train": str(tmp_path / "train.jsonl"), "format": "text", "maxSeqLen": 8},
            "lora": {"rank": 4, "alpha": 8.0, "restoreFrom": str(adapter)},
            "training": {"steps": 1, "globalBatchSize": 2, "learningRate": 1e-12, "schedule": "constant", "checkpointEvery": 1},
            "output": {"uri": str(tmp_path / "run")},
        }
    )
    root = str(run_training(cfg).checkpoint_root)
    export_checkpoint(root, str(tmp_path / "back"))
    original, again = load_file(str(adapter / WEIGHTS_NAME)), load_file(str(tmp_path / "back" / WEIGHTS_NAME))
    assert sorted(original) == sorted(again)
    for key, arr in original.items():
        np.testing.assert_allclose(again[key], arr, rtol=1e-6, atol=1e-9, err_msg=key)
