"""Checkpoint format: round trips, keep-N, and only committed steps are ever visible (local and gs://)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
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

    store = ckpt.TrainingCheckpoints(root, keep=2)
    assert store.latest_step() == 3
    lora_t, opt_t = _sharded_targets(_tree(0), opt)
    lora, optimizer, data, meta = store.restore(3, lora_target=lora_t, optimizer_target=opt_t)
    store.close()
    _assert_tree_equal(lora, _tree(3))
    assert int(optimizer["count"]) == 3
    assert isinstance(optimizer["mu"]["x"], jax.Array)
    assert data == {"epoch": 0, "position": 12}
    assert meta["step"] == 3 and meta["rank"] == 2
    # read_lora reads training checkpoints too (export does this).
    _assert_tree_equal(ckpt.read_lora(root)[0], _tree(3))


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
    """A real adapter has hundreds of arrays; saving them concurrently must work on gs:// too."""
    rng = np.random.default_rng(0)
    tree = {f"layers/{i}/mlp/up_proj": {"kernel_lora_a": rng.standard_normal((8, 2)).astype(np.float32),
                                         "kernel_lora_b": rng.standard_normal((2, 8)).astype(np.float32)} for i in range(40)}
    root = f"gs://{gcs_bucket}/test_checkpoint/many"
    ckpt.write_lora(root, 1, tree, META)
    _assert_tree_equal(ckpt.read_lora(root)[0], tree)
