"""Multi-host: the pod environment -> jax.distributed arguments, the mesh, and a real two-process run."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gcs_emulator import free_port
from trainer_fixtures import finish, progress_lines, start_trainer, train_config, trainer_env, wait_for_step, write_config

from lora_trainer import checkpoint, exit_codes
from lora_trainer.config import MeshSpec
from lora_trainer.distributed import ClusterEnv, cluster_env, mesh_shape
from lora_trainer.errors import UserError


def test_cluster_env_from_pod_environment():
    assert cluster_env({}) == ClusterEnv("single")
    explicit = {"JAX_COORDINATOR_ADDRESS": "job-w-0-0.job:8476", "JAX_PROCESS_COUNT": "4", "JAX_PROCESS_ID": "3"}
    assert cluster_env(explicit) == ClusterEnv("explicit", "job-w-0-0.job:8476", 4, 3)
    # Process id from the JobSet job index and the Indexed Job completion index (2 slices x 2 hosts).
    derived = {**explicit, "LORA_JOB_INDEX": "1", "LORA_HOSTS_PER_SLICE": "2", "JOB_COMPLETION_INDEX": "1"}
    del derived["JAX_PROCESS_ID"]
    assert cluster_env(derived).process_id == 3
    # GKE TPU: JAX's own detection reads TPU_WORKER_* / MEGASCALE_*; one host is a single process.
    assert cluster_env({"TPU_WORKER_ID": "1", "TPU_WORKER_HOSTNAMES": "h0,h1"}) == ClusterEnv("tpu", None, 2, 1)
    assert cluster_env({"TPU_WORKER_ID": "0", "TPU_WORKER_HOSTNAMES": "h0", "MEGASCALE_NUM_SLICES": "2"}).process_count == 2
    assert cluster_env({"TPU_WORKER_ID": "0", "TPU_WORKER_HOSTNAMES": "h0"}) == ClusterEnv("single")


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"JAX_COORDINATOR_ADDRESS": "h:1"}, "JAX_PROCESS_COUNT"),
        ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_COUNT": "2"}, "JOB_COMPLETION_INDEX"),
        ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_COUNT": "2", "JAX_PROCESS_ID": "2"}, r"outside 0\.\.1"),
        ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_COUNT": "two", "JAX_PROCESS_ID": "0"}, "not an integer"),
    ],
)
def test_bad_cluster_env_is_a_user_error(env, match):
    with pytest.raises(UserError, match=match):
        cluster_env(env)


def test_mesh_shape():
    assert mesh_shape(MeshSpec(), 8) == (1, 8, 1)
    assert mesh_shape(MeshSpec(tp=2), 8) == (1, 4, 2)
    assert mesh_shape(MeshSpec(fsdp=2, tp=2), 8) == (2, 2, 2)
    with pytest.raises(UserError, match="tp=3"):
        mesh_shape(MeshSpec(tp=3), 8)
    with pytest.raises(UserError, match="fsdp \\* tp = 6"):
        mesh_shape(MeshSpec(fsdp=3, tp=2), 8)



def _gloo_env() -> dict[str, str]:
    """What each of two local one-device CPU processes needs to join one jax.distributed run (gloo),
    besides its process id."""
    return {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}", "JAX_PROCESS_COUNT": "2", "JAX_NUM_CPU_DEVICES": "1", "JAX_PLATFORMS": "cpu"}


def _one_process_and_two(one: str, two: str, logs: Path) -> list[subprocess.Popen[bytes]]:
    """Run config `one` in one process with two CPU devices and config `two` in two one-device
    processes joined by gloo (logs `one.log`, `p0.log`, `p1.log` under `logs`); returns them finished."""
    common = _gloo_env()
    procs = [
        start_trainer(one, logs / "one.log", JAX_NUM_CPU_DEVICES="2", JAX_PLATFORMS="cpu"),
        start_trainer(two, logs / "p0.log", JAX_PROCESS_ID="0", **common),
        start_trainer(two, logs / "p1.log", JAX_PROCESS_ID="1", **common),
    ]
    finish(procs, timeout=400)
    return procs


_ALLGATHER = """
import json, jax
from lora_trainer import distributed
distributed.initialize()
me = jax.process_index()
blobs = {
    "uneven": bytes([65 + me]) * (3 + 5 * me),  # 3 and 8 bytes in rounds of 2 (4 bytes over 2 processes)
    "one empty": b"" if me == 0 else b"xyz",
    "all empty": b"",
}
print(json.dumps({k: [b.decode() for b in distributed.allgather_bytes(v, round_bytes=4)] for k, v in blobs.items()}))
"""


@pytest.mark.slow
def test_allgather_bytes_pools_blobs_of_any_size_across_real_processes(tmp_path):
    """The transport that pools the processes' tokenized shares (`data.Share`): JAX collectives
    (gloo here), blobs of unequal sizes in several padded rounds, and empty ones."""
    script = tmp_path / "allgather.py"
    script.write_text(_ALLGATHER)
    common = _gloo_env()
    procs = [
        subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=trainer_env(**common, JAX_PROCESS_ID=str(k)))
        for k in (0, 1)
    ]
    outs = finish(procs, timeout=120)
    assert [p.returncode for p in procs] == [0, 0], [err.decode()[-2000:] for _, err in outs]
    want = {"uneven": ["AAA", "BBBBBBBB"], "one empty": ["", "xyz"], "all empty": ["", ""]}
    assert [json.loads(out.decode().splitlines()[-1]) for out, _ in outs] == [want, want]


@pytest.mark.slow
def test_two_processes_train_and_resume_the_same_adapter_as_one_process_with_two_devices(tmp_path):
    # Micro-batches of 2 rows, one per host: Tunix alone declared such a batch replicated (each host
    # trained on its row as the whole batch; 0.04 off); the eval batches likewise.
    base = train_config(tmp_path, "", steps=5, checkpointEvery=3, gradientAccumulation=2)
    base["dataset"]["eval"] = base["dataset"]["train"]
    one = write_config(tmp_path / "one.json", {**base, "output": {"uri": str(tmp_path / "one")}})
    two = write_config(tmp_path / "two.json", {**base, "output": {"uri": str(tmp_path / "two")}})
    single = start_trainer(one, tmp_path / "one.log", JAX_NUM_CPU_DEVICES="2", JAX_PLATFORMS="cpu")
    common = _gloo_env()
    procs = [
        start_trainer(two, tmp_path / "p0.log", JAX_PROCESS_ID="0", **common),
        # The second host finds its id the way a JobSet pod does: job index * hosts per slice + completion index.
        start_trainer(two, tmp_path / "p1.log", LORA_JOB_INDEX="0", LORA_HOSTS_PER_SLICE="2", JOB_COMPLETION_INDEX="1", **common),
    ]
    finish([single, *procs], timeout=400)
    codes = [p.returncode for p in [single, *procs]]
    logs = {name: (tmp_path / f"{name}.log").read_text()[-3000:] for name in ("one", "p0", "p1")}
    assert codes == [exit_codes.OK] * 3, logs
    assert "joining a 2-process run as process 1" in logs["p1"]
    for k in (0, 1):  # each process tokenized every other row of the 32 and they pooled them; the eval set is the
        # same file, so both then read what process 0 had kept of it (`token_cache`: every process must have it)
        log = (tmp_path / f"p{k}.log").read_text()
        assert log.count(f"(this process tokenized 16 of them, process {k} of 2)") == 1
        assert log.count("examples read from") == 1, log[-3000:]
    assert '"step": 5' in logs["p0"] and '"step"' not in logs["p1"]  # progress from process 0 only

    a, meta_a = checkpoint.read_lora(str(tmp_path / "one" / "checkpoints"))
    b, meta_b = checkpoint.read_lora(str(tmp_path / "two" / "checkpoints"))
    assert meta_a["step"] == meta_b["step"] == 5
    diff = max(float(np.max(np.abs(a[m][n] - b[m][n]))) for m in a for n in a[m])
    moved = max(float(np.max(np.abs(a[m][n]))) for m in a for n in a[m] if n.endswith("_b"))
    assert moved > 1e-3  # B starts at zero: training moved it
    assert diff <= 1e-6, diff
    evals = [[r["eval/loss"] for r in map(json.loads, (tmp_path / n / "metrics.jsonl").read_text().splitlines()) if "eval/loss" in r]
             for n in ("one", "two")]
    assert len(evals[0]) == 1 and evals[1] == pytest.approx(evals[0], abs=1e-6), evals

    # Resumed in two processes from step 3 (step 5 taken away), the run ends where it did. Both runs
    # save mid-run, which two processes survive only with Orbax's barriers off the devices
    # (`checkpoint._prepare_orbax`): their save at step 3 died with gloo's "collective mismatch".
    # Each process reads the checkpoint whole and places only its own devices' parts (`placed_like`).
    shutil.copytree(tmp_path / "two", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "5")
    resumed = write_config(tmp_path / "resumed.json", {**base, "output": {"uri": str(tmp_path / "resumed")}})
    common = _gloo_env()
    procs = [start_trainer(resumed, tmp_path / f"r{k}.log", JAX_PROCESS_ID=str(k), **common) for k in (0, 1)]
    finish(procs, timeout=400)
    assert [p.returncode for p in procs] == [exit_codes.OK] * 2, [(tmp_path / f"r{k}.log").read_text()[-3000:] for k in (0, 1)]
    assert "resuming from step 3" in (tmp_path / "r1.log").read_text()
    c, meta_c = checkpoint.read_lora(str(tmp_path / "resumed" / "checkpoints"))
    assert meta_c["step"] == 5
    assert max(float(np.max(np.abs(b[m][n] - c[m][n]))) for m in b for n in b[m]) <= 1e-6


@pytest.mark.slow
def test_tensor_parallelism_across_hosts_feeds_every_host_the_whole_batch(tmp_path):
    """tp=2 over two one-device hosts: no mesh axis splits the rows, so both hosts feed every row.
    With a fixed half of each batch per host, each host's half was taken for the whole batch
    (step 1's loss 6.47 against 6.39): the adapter must equal one process with two devices."""
    cfg = train_config(tmp_path, "", steps=3, checkpointEvery=3, mesh={"tp": 2})
    paths = {n: write_config(tmp_path / f"{n}.json", {**cfg, "output": {"uri": str(tmp_path / n)}}) for n in ("one", "two")}
    procs = _one_process_and_two(paths["one"], paths["two"], tmp_path)
    codes = [p.returncode for p in procs]
    assert codes == [exit_codes.OK] * 3, {n: (tmp_path / f"{n}.log").read_text()[-3000:] for n in ("one", "p0", "p1")}
    losses = {n: [r["loss"] for r in progress_lines(tmp_path / f"{n}.log")] for n in ("one", "p0")}
    assert losses["p0"] == pytest.approx(losses["one"], abs=1e-5), losses
    a, _ = checkpoint.read_lora(str(tmp_path / "one" / "checkpoints"))
    b, _ = checkpoint.read_lora(str(tmp_path / "two" / "checkpoints"))
    assert max(float(np.max(np.abs(a[m][n] - b[m][n]))) for m in a for n in a[m]) <= 1e-6


@pytest.mark.slow
def test_a_bfloat16_base_trains_sharded_by_fsdp_and_by_tp(tmp_path):
    """bf16 (the default dtype) runs its matmuls through `accumulating_dot`'s custom backward; on a
    two-device mesh, split by fsdp or by tensor parallelism, it trains to one device's losses (an
    error that both layouts share, such as a gradient summed twice, would not be seen otherwise)."""
    procs = {}
    for name, mesh, devices in (("fsdp", {"fsdp": 2}, "2"), ("tp", {"tp": 2}, "2"), ("one", {}, "1")):
        cfg = train_config(tmp_path / name, str(tmp_path / name / "out"), steps=5, checkpointEvery=5, mesh=mesh)
        cfg["model"]["dtype"] = "bfloat16"
        path = write_config(tmp_path / f"{name}.json", cfg)
        procs[name] = start_trainer(path, tmp_path / f"{name}.log", JAX_NUM_CPU_DEVICES=devices, JAX_PLATFORMS="cpu")
    finish(list(procs.values()), timeout=400)
    codes = {name: p.returncode for name, p in procs.items()}
    logs = {name: (tmp_path / f"{name}.log").read_text()[-3000:] for name in procs}
    assert set(codes.values()) == {exit_codes.OK}, logs
    losses = {name: [r["loss"] for r in progress_lines(tmp_path / f"{name}.log")] for name in procs}
    assert len(losses["one"]) == 5 and all(np.isfinite(losses["one"])) and losses["one"][-1] < losses["one"][0], losses
    for name in ("fsdp", "tp"):  # bf16 rounding differs with the split of the products, not more
        assert losses[name] == pytest.approx(losses["one"], rel=1e-2), losses


@pytest.mark.slow
def test_tp_that_does_not_divide_the_heads_replicates_that_axis(tmp_path):
    """3 query heads over tp=2 (Qwen2.5-0.5B's 14 over tp=4 alike): the loader replicates the axis
    it cannot split, and the LoRA factors and optimizer state follow it; they kept the weight's
    `tp` annotation, and the first step raised IndivisibleError (exit 1). Same losses as one device."""
    from lora_trainer.tiny_models import make_tiny_hf_model

    model = make_tiny_hf_model("llama3", tmp_path / "odd-heads", seed=0, num_attention_heads=3, num_key_value_heads=1,
                               hidden_size=48, head_dim=16, intermediate_size=96)
    procs = {}
    for name, mesh, devices in (("tp", {"tp": 2}, "2"), ("one", {}, "1")):
        cfg = train_config(tmp_path / name, str(tmp_path / name / "out"), steps=3, checkpointEvery=3, mesh=mesh)
        cfg["model"]["source"] = str(model)
        procs[name] = start_trainer(write_config(tmp_path / f"{name}.json", cfg), tmp_path / f"{name}.log",
                                    JAX_NUM_CPU_DEVICES=devices, JAX_PLATFORMS="cpu")
    finish(list(procs.values()), timeout=400)
    codes = {name: p.returncode for name, p in procs.items()}
    assert codes == {"tp": exit_codes.OK, "one": exit_codes.OK}, {n: (tmp_path / f"{n}.log").read_text()[-3000:] for n in procs}
    losses = {name: [r["loss"] for r in progress_lines(tmp_path / f"{name}.log")] for name in procs}
    assert losses["tp"] == pytest.approx(losses["one"], rel=1e-4), losses


@pytest.mark.slow
def test_qlora_trains_sharded_by_fsdp_and_by_tp(tmp_path):
    """QLoRA (nf4) on a two-device mesh: the base weights are quantized where they lie (compiled,
    see lora_provider._CompiledQuantize) and train to one device's losses, split by fsdp or by tp."""
    procs = {}
    for name, mesh, devices in (("fsdp", {"fsdp": 2}, "2"), ("tp", {"tp": 2}, "2"), ("one", {}, "1")):
        cfg = train_config(tmp_path / name, str(tmp_path / name / "out"), steps=3, checkpointEvery=3, mesh=mesh)
        cfg["lora"]["quantization"] = {"weightQtype": "nf4", "tileSize": 16}
        procs[name] = start_trainer(write_config(tmp_path / f"{name}.json", cfg), tmp_path / f"{name}.log",
                                    JAX_NUM_CPU_DEVICES=devices, JAX_PLATFORMS="cpu")
    finish(list(procs.values()), timeout=400)
    codes = {name: p.returncode for name, p in procs.items()}
    assert set(codes.values()) == {exit_codes.OK}, {n: (tmp_path / f"{n}.log").read_text()[-3000:] for n in procs}
    losses = {name: [r["loss"] for r in progress_lines(tmp_path / f"{name}.log")] for name in procs}
    assert len(losses["one"]) == 3 and all(np.isfinite(losses["one"]))
    for name in ("fsdp", "tp"):
        assert losses[name] == pytest.approx(losses["one"], rel=1e-4), losses


@pytest.mark.slow
def test_scanned_layers_stack_across_two_processes_and_train_the_unrolled_adapter(tmp_path):
    """`training.scanLayers` on a 2-process fsdp mesh: each weight is stacked where it lies, as one
    global array sharded like the weight (every process runs the same stacking), and the run trains
    the adapter one unrolled process with two devices does."""
    from lora_trainer.tiny_models import make_tiny_hf_model

    model = make_tiny_hf_model("llama3", tmp_path / "two-layers", seed=0, num_hidden_layers=2)
    paths = {}
    for name, scan in (("one", False), ("two", True)):
        cfg = train_config(tmp_path / name, str(tmp_path / name / "out"), steps=3, checkpointEvery=3, scanLayers=scan)
        cfg["model"]["source"] = str(model)
        paths[name] = write_config(tmp_path / f"{name}.json", cfg)
    procs = _one_process_and_two(paths["one"], paths["two"], tmp_path)
    logs = {n: (tmp_path / f"{n}.log").read_text() for n in ("one", "p0", "p1")}
    assert [p.returncode for p in procs] == [exit_codes.OK] * 3, {n: log[-3000:] for n, log in logs.items()}
    assert "2 decoder layers, scanned" in logs["p0"] and "2 decoder layers, unrolled" in logs["one"]
    a, _ = checkpoint.read_lora(str(tmp_path / "one" / "out" / "checkpoints"))
    b, _ = checkpoint.read_lora(str(tmp_path / "two" / "out" / "checkpoints"))
    assert len(a) == 14 and a.keys() == b.keys()
    # float32 sums in another order (two processes, scanned layers) after 3 steps
    assert max(float(np.max(np.abs(a[m][n] - b[m][n]))) for m in a for n in a[m]) <= 2e-6


@pytest.mark.slow
def test_a_tensor_parallel_run_compiles_its_step_once_and_its_restart_not_at_all(tmp_path):
    """The step returns each carried array where it came in (`tunix_trainer._placed_as`): XLA had
    returned LoRA factors passed replicated split over `tp`, and the second step compiled again for
    them. A restart then calls the step the run kept (`step_record`), compiling nothing, in a new
    process of two devices, and trains on to the end."""
    cfg = write_config(tmp_path / "tp.json", train_config(tmp_path, str(tmp_path / "out"), steps=8, checkpointEvery=4, mesh={"tp": 2}))
    env = {"JAX_NUM_CPU_DEVICES": "2", "JAX_PLATFORMS": "cpu", "JAX_LOG_COMPILES": "1"}
    proc = start_trainer(cfg, tmp_path / "first.log", **env)
    wait_for_step(proc, tmp_path / "first.log", 2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == exit_codes.PREEMPTED, (tmp_path / "first.log").read_text()[-3000:]
    proc = start_trainer(cfg, tmp_path / "restart.log", **env)
    finish([proc], timeout=300)
    first, restart = ((tmp_path / f"{n}.log").read_text() for n in ("first", "restart"))
    assert proc.returncode == exit_codes.OK, restart[-3000:]
    assert first.count("Finished XLA compilation of jit(_train_step)") == 1, first[-3000:]
    assert "not traced again" in restart and "compilation of jit(_train_step)" not in restart, restart[-3000:]
    assert progress_lines(tmp_path / "restart.log")[-1]["step"] == 8
