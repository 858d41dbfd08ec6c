"""Checkpoint format: round trips, keep-N, and only committed steps are ever visible (local and gs://)."""

from __future__ import annotations

import json

import logging
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from lora_trainer import checkpoint as ckpt
from lora_trainer import storage
from lora_trainer.errors import RetriableError, UserError

META = {
    "family": "llama3",
    "baseModel": "gs://models/tiny",
    "rank": 2,
    "alpha": 4.0,
    "dropout": 0.0,
    "targetModules": ".*/(q_proj|v_proj)",
    "quantization": None,
    "modulePaths": ["layers/0/attn/q_proj", "layers/0/attn/v_proj"],
}


def _tree(seed: int) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {
        "layers/0/attn/q_proj": {
            "w_lora_a": rng.standard_normal((8, 2)).astype(np.float32),
            "w_lora_b": rng.standard_normal((2, 2, 4)).astype(np.float32),
        },
        "layers/0/attn/v_proj": {
            "w_lora_a": rng.standard_normal((8, 2)).astype(np.float32),
            "w_lora_b": rng.standard_normal((2, 1, 4)).astype(np.float32),
        },
    }


def _assert_tree_equal(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_write_read_lora_round_trip_local(tmp_path):
    root = str(tmp_path / "adapter")
    ckpt.write_lora(root, 7, _tree(0), META)
    tree, meta = ckpt.read_lora(root)
    _assert_tree_equal(tree, _tree(0))
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(tree))
    assert meta == {**META, "step": 7}
    # A step directory is accepted wherever a root is.
    tree2, meta2 = ckpt.read_lora(str(tmp_path / "adapter" / "7"))
    _assert_tree_equal(tree2, tree)
    assert meta2["step"] == 7
    assert ckpt.read_metadata(f"file://{root}")["rank"] == 2


def _layered_tree(seed: int, layers: int = 3) -> dict[str, dict[str, np.ndarray]]:
    """Per-layer modules (stackable), plus one module outside the layers."""
    rng = np.random.default_rng(seed)
    tree = {
        f"layers/{i}/{kind}": {
            "w_lora_a": rng.standard_normal((8, 2)).astype(np.float32),
            "w_lora_b": rng.standard_normal((2, *out)).astype(np.float32),
        }
        for i in range(layers)
        for kind, out in (("attn/q_proj", (2, 4)), ("attn/kv_einsum/k_proj", (1, 4)))
    }
    tree["embedder"] = {"w_lora_a": rng.standard_normal((5, 2)).astype(np.float32)}
    return tree


def test_adapter_only_checkpoints_are_layer_stacked(tmp_path):
    root = str(tmp_path / "adapter")
    tree = _layered_tree(0)
    ckpt.write_lora(root, 0, tree, META)
    stored = ckpt.read_metadata(root)["loraLayout"]
    assert stored == {"stacked": {"layers/{i}/attn/kv_einsum/k_proj": [0, 1, 2], "layers/{i}/attn/q_proj": [0, 1, 2]}, "axes": {}}
    got, meta = ckpt.read_lora(root)
    _assert_tree_equal(got, tree)
    assert list(got) == sorted(tree)
    assert "loraLayout" not in meta  # the layout is undone, not passed on
    # Stacked groups come back as views of one array per parameter, not as copies.
    q = [got[f"layers/{i}/attn/q_proj"]["w_lora_a"] for i in range(3)]
    assert q[0].base is not None and all(x.base is q[0].base for x in q)
    # Orbax holds one array per stacked parameter.
    assert (tmp_path / "adapter" / "0" / "lora" / "layers" / "{i}" / "attn" / "q_proj.w_lora_a").is_dir()
    assert not (tmp_path / "adapter" / "0" / "lora" / "layers" / "0").exists()


def test_views_are_stacked_in_their_memory_order(tmp_path):
    """An imported PEFT adapter is views of its file ([r, in] seen as [in, r]; [out, r] seen as
    [r, heads, head_dim]): stored in the order its bytes have, read back as the same views."""
    rng = np.random.default_rng(3)
    peft = {i: (rng.standard_normal((2, 8)).astype(np.float32), rng.standard_normal((8, 2)).astype(np.float32)) for i in range(3)}
    tree = {f"layers/{i}/attn/q_proj": {"w_lora_a": a.T, "w_lora_b": b.T.reshape(2, 2, 4)} for i, (a, b) in peft.items()}
    tree["layers/0/mlp"] = tree["layers/1/mlp"] = {"w_lora_a": np.ones((4, 4), np.float32)[:, ::2]}  # no contiguous order
    root = str(tmp_path / "adapter")
    ckpt.write_lora(root, 0, tree, META)
    layout = ckpt.read_metadata(root)["loraLayout"]
    assert layout["axes"] == {"layers/{i}/attn/q_proj": {"w_lora_a": [1, 0], "w_lora_b": [1, 2, 0]}}
    got, _ = ckpt.read_lora(root)
    _assert_tree_equal(got, tree)
    for i, (a, b) in peft.items():
        # The stored bytes are PEFT's own: the per-layer arrays are plain views back to PEFT's layout.
        np.testing.assert_array_equal(got[f"layers/{i}/attn/q_proj"]["w_lora_a"].T, a)
        assert got[f"layers/{i}/attn/q_proj"]["w_lora_a"].T.flags.c_contiguous
        assert got[f"layers/{i}/attn/q_proj"]["w_lora_b"].transpose(1, 2, 0).reshape(8, 2).flags.c_contiguous


def test_memory_order():
    x = np.zeros((3, 4, 5), np.float32)
    assert ckpt._memory_order(x) == [0, 1, 2]
    assert ckpt._memory_order(x.transpose(2, 0, 1)) == [1, 2, 0]
    assert ckpt._memory_order(x[:, ::2]) == [0, 1, 2]  # strided: no order is contiguous, stored as is


def test_unequal_or_odd_groups_stay_per_path(tmp_path):
    tree = _layered_tree(1, layers=2)
    tree["layers/1/attn/q_proj"]["w_lora_b"] = np.ones((2, 3, 4), np.float32)  # shapes differ from layer 0's
    tree["layers/0/attn/kv_einsum/k_proj"]["w_lora_a"] = tree["layers/0/attn/kv_einsum/k_proj"]["w_lora_a"].astype(np.float16)
    tree["blocks/07/mlp"] = {"w_lora_a": np.zeros((2, 2), np.float32)}  # `07` would not come back as `07`
    tree["blocks/8/mlp"] = {"w_lora_a": np.zeros((2, 2), np.float32)}
    tree["stages/3/only"] = {"w_lora_a": np.zeros((2, 2), np.float32)}  # a group of one
    for i in (0, 1):  # a path that already holds the placeholder
        tree[f"odd{{i}}/{i}/x"] = {"w_lora_a": np.full((2,), i, np.float32)}
    root = str(tmp_path / "adapter")
    ckpt.write_lora(root, 0, tree, META)
    assert ckpt.read_metadata(root)["loraLayout"] == {"stacked": {}, "axes": {}}
    got, _ = ckpt.read_lora(root)
    _assert_tree_equal(got, tree)
    assert got["layers/0/attn/kv_einsum/k_proj"]["w_lora_a"].dtype == np.float16


def test_per_path_compressed_checkpoints_still_load(tmp_path):
    """What earlier versions wrote (and training still writes per path): no layout record, zstd arrays."""
    root = tmp_path / "old"
    tree = _layered_tree(2)
    mgr = ocp.CheckpointManager(
        root,
        options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True),
        item_handlers={
            "lora": ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_compression=True),
            "metadata": ocp.JsonCheckpointHandler(),
        },
    )
    mgr.save(3, args=ocp.args.Composite(lora=ocp.args.PyTreeSave(tree), metadata=ocp.args.JsonSave({**META, "step": 3})))
    mgr.wait_until_finished()
    mgr.close()
    zarray = json.loads((root / "3" / "lora" / "layers" / "0" / "attn" / "q_proj.w_lora_a" / ".zarray").read_text())
    assert zarray["compressor"]["id"] == "zstd"
    got, meta = ckpt.read_lora(str(root))
    _assert_tree_equal(got, tree)
    assert meta == {**META, "step": 3}


def test_new_checkpoints_are_uncompressed(tmp_path):
    root = tmp_path / "adapter"
    ckpt.write_lora(str(root), 0, _tree(0), META)
    zarray = json.loads((root / "0" / "lora" / "layers" / "0" / "attn" / "q_proj.w_lora_a" / ".zarray").read_text())
    assert zarray["compressor"] is None


def test_relative_and_digit_named_roots(tmp_path, monkeypatch):
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    ckpt.write_lora("../adapters/777", 0, _tree(0), META)  # TensorStore alone refuses `..` in a path
    for root in ("../adapters/777", str(tmp_path / "adapters" / "777"), "../adapters/777/0"):
        tree, meta = ckpt.read_lora(root)  # 777 is the adapter's root, not a step of `adapters`
        _assert_tree_equal(tree, _tree(0))
        assert meta["step"] == 0


def test_damaged_committed_steps_are_user_errors(tmp_path):
    root = tmp_path / "c"
    ckpt.write_lora(str(root), 3, _tree(0), META)
    (root / "3" / "metadata" / "metadata").write_text("{broken")
    with pytest.raises(UserError, match=r"checkpoint .*c/3 is committed but incomplete or damaged.*delete that step"):
        ckpt.read_metadata(str(root))
    ckpt.write_lora(str(root), 4, _tree(0), META)
    shutil.rmtree(root / "4" / "lora")
    with pytest.raises(UserError, match=r"c/4 is committed but incomplete or damaged"):
        ckpt.read_lora(str(root))


def test_write_lora_requires_full_metadata(tmp_path):
    with pytest.raises(UserError, match="modulePaths"):
        ckpt.write_lora(str(tmp_path / "a"), 1, _tree(0), {k: v for k, v in META.items() if k != "modulePaths"})
    assert ckpt.latest_committed_step(str(tmp_path / "a")) is None


def test_missing_or_uncommitted_steps_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="no committed checkpoint"):
        ckpt.read_lora(str(tmp_path / "nothing"))
    root = str(tmp_path / "c")
    ckpt.write_lora(root, 3, _tree(0), META)
    with pytest.raises(UserError, match=r"step 4 is not a committed checkpoint.*\[3\]"):
        ckpt.read_lora(root, step=4)


def test_local_half_written_step_is_invisible(tmp_path):
    root = tmp_path / "ck"
    ckpt.write_lora(str(root), 2, _tree(0), META)
    # What a process killed mid-save leaves behind: Orbax's temporary directory.
    tmp = root / "5.orbax-checkpoint-tmp-1234567"
    (tmp / "lora").mkdir(parents=True)
    (tmp / "lora" / "manifest.ocdbt").write_bytes(b"partial")
    assert ckpt.committed_steps(str(root)) == [2]
    assert ckpt.latest_committed_step(str(root)) == 2
    assert ckpt.read_lora(str(root))[1]["step"] == 2


def test_storage_outages_are_retriable():
    with pytest.raises(RetriableError, match="gs://b/run"):
        with ckpt._storage_faults("gs://b/run"):
            raise ValueError("Error writing gs://b/run/1/lora: UNAVAILABLE: HTTP response code: 503")
    with pytest.raises(RetriableError):
        with ckpt._storage_faults("/local"):
            raise ConnectionResetError("reset")
    with pytest.raises(ValueError, match="bad tree"):  # anything else is not retried
        with ckpt._storage_faults("gs://b/run"):
            raise ValueError("bad tree")
    oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4096 bytes.")
    with pytest.raises(jax.errors.JaxRuntimeError):  # device OOM while saving: a user error, not GCS throttling
        with ckpt._storage_faults("gs://b/run"):
            raise oom


def _sharded_targets(lora, opt):
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return (
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), lora),
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), opt),
    )


def test_training_checkpoints_keep_n_and_full_restore(tmp_path):
    root = str(tmp_path / "run" / "checkpoints")
    store = ckpt.TrainingCheckpoints(root, keep=2)
    opt = {"mu": {"x": jnp.arange(3.0)}, "count": jnp.asarray(0, jnp.int32)}
    for step in (1, 2, 3):
        store.save(
            step,
            lora=jax.tree.map(jnp.asarray, _tree(step)),
            optimizer={**opt, "count": jnp.asarray(step, jnp.int32)},
            data={"epoch": 0, "position": step * 4},
            metadata=META,
        )
    store.close()
    assert ckpt.committed_steps(root) == [2, 3]
    # A later step a killed process left half-written goes when the next run opens the checkpoints.
    (tmp_path / "run" / "checkpoints" / "4.orbax-checkpoint-tmp-1234567" / "lora").mkdir(parents=True)

    store = ckpt.TrainingCheckpoints(root, keep=2)
    assert store.latest_step() == 3
    lora, optimizer, data, meta = store.read(3)
    store.close()
    _assert_tree_equal(lora, _tree(3))
    assert int(optimizer["count"]) == 3
    assert isinstance(optimizer["mu"]["x"], np.ndarray)  # on the host: read before the trainer exists
    lora_t, opt_t = _sharded_targets(_tree(0), opt)
    placed = ckpt.placed_like(optimizer, opt_t, "step 3")
    assert placed["mu"]["x"].sharding == opt_t["mu"]["x"].sharding and placed["count"].dtype == jnp.int32
    _assert_tree_equal(ckpt.placed_like(lora, lora_t, "step 3"), _tree(3))
    assert data == {"epoch": 0, "position": 12}
    assert meta["step"] == 3 and meta["rank"] == 2
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["2", "3"]
    # read_lora reads training checkpoints too (export does this).
    _assert_tree_equal(ckpt.read_lora(root)[0], _tree(3))


def test_a_read_step_that_is_not_the_run_s_is_a_user_error_naming_it():
    lora_t, _ = _sharded_targets(_tree(0), {})
    other = _tree(1)
    other["layers/9/attn/q_proj"] = other.pop("layers/0/attn/q_proj")
    with pytest.raises(UserError, match=r"checkpoint ck/3 does not hold this run's arrays \(missing \[\"\['layers/0/attn/q_proj'\]"):
        ckpt.placed_like(other, lora_t, "ck/3")
    wider = jax.tree.map(lambda a: np.zeros((*a.shape[:-1], a.shape[-1] + 1), a.dtype), _tree(1))
    with pytest.raises(UserError, match=r"checkpoint ck/3 holds an array of shape \[.*\] where this run has"):
        ckpt.placed_like(wider, lora_t, "ck/3")


@pytest.mark.slow
def test_gcs_round_trip_and_commit_marker(gcs_bucket):
    root = f"gs://{gcs_bucket}/test_checkpoint/adapter"
    ckpt.write_lora(root, 4, _tree(1), META)
    ckpt.write_lora(root, 6, _tree(2), META)
    assert ckpt.committed_steps(root) == [4, 6]
    tree, meta = ckpt.read_lora(root)
    _assert_tree_equal(tree, _tree(2))
    assert meta["step"] == 6
    _assert_tree_equal(ckpt.read_lora(f"{root}/4")[0], _tree(1))

    # On gs:// a listed step directory is no proof: without commit_success.txt it is not a step.
    storage.write_text(f"{root}/9/lora/manifest.ocdbt", "partial")
    assert "9" in storage.listdir(root)
    assert ckpt.latest_committed_step(root) == 6
    # And a real step whose marker is gone (write interrupted before the marker) disappears too.
    storage._blob(f"{root}/6/commit_success.txt").delete()
    assert ckpt.committed_steps(root) == [4]
    assert ckpt.read_lora(root)[1]["step"] == 4


@pytest.mark.slow
def test_gcs_many_arrays(gcs_bucket):
    """A real adapter has hundreds of arrays: layer-stacked (with a per-path leftover) on gs:// too."""
    rng = np.random.default_rng(0)
    tree = {f"layers/{i}/mlp/up_proj": {"kernel_lora_a": rng.standard_normal((8, 2)).astype(np.float32),
                                         "kernel_lora_b": rng.standard_normal((2, 8)).astype(np.float32)} for i in range(40)}
    tree["layers/7/attn/q_proj"] = {"w_lora_a": np.ones((3, 2), np.float32)}  # stays per path
    root = f"gs://{gcs_bucket}/test_checkpoint/many"
    ckpt.write_lora(root, 1, tree, META)
    assert ckpt.read_metadata(root)["loraLayout"] == {"stacked": {"layers/{i}/mlp/up_proj": list(range(40))}, "axes": {}}
    _assert_tree_equal(ckpt.read_lora(root)[0], tree)


def test_orbax_warnings_about_what_is_done_on_purpose_are_not_printed(tmp_path, caplog):
    """OCDBT off, read-only readers, and the items an adapter-only read of a training checkpoint
    skips: `lora-trainer export` printed seven such warnings on success ("Item "optimizer" was
    found in the checkpoint, but could not be restored")."""
    root = str(tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="absl"):
        ckpt.write_lora(str(tmp_path / "a"), 1, _tree(0), META)
        assert ckpt.read_lora(str(tmp_path / "a"))[1]["step"] == 1
        store = ckpt.TrainingCheckpoints(root, keep=1)
        store.save(1, lora=jax.tree.map(jnp.asarray, _tree(1)), optimizer={"count": jnp.asarray(1)}, data={"batches": 1}, metadata=META)
        store.close()
        assert ckpt.read_lora(root)[1]["step"] == 1
    assert [r.getMessage() for r in caplog.records if r.name == "absl"] == []
