"""Training: only LoRA params move, loss falls, and a run writes checkpoints, metrics and progress."""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.interpreters import pxla
from trainer_fixtures import arithmetic_rows, parse, tiny_llama, train_config, write_jsonl

from lora_trainer import checkpoint, data, schedule, tunix_trainer
from lora_trainer import train as train_module
from lora_trainer.config import DatasetSpec, LoraSpec, TrainingSpec
from lora_trainer.errors import Preempted, UserError
from lora_trainer.lora import apply_lora, lora_state, lora_variables, read_lora, set_lora_state
from lora_trainer.loss import lm_loss, model_inputs
from lora_trainer.models import load_model
from lora_trainer.progress import IntervalTimer, format_eta, progress_record
from lora_trainer.train import evals_due, incompatibilities, run_training
from lora_trainer.tunix_trainer import make_trainer

PROGRESS_KEYS = {
    "step", "totalSteps", "loss", "learningRate", "tokensPerSecond", "stepTimeSeconds",
    "etaSeconds", "eta", "mfu", "lastCheckpoint", "time",
}  # fmt: skip


def _base_params(model: nnx.Module) -> dict:
    state = nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
    return {"/".join(map(str, p)): np.array(v.get_value()) for p, v in nnx.to_flat_state(state)}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bfloat16: the default, on XLA:CPU's native bf16 dots
def test_only_lora_params_train_and_loss_falls(tmp_path, dtype):
    loaded = load_model(str(tiny_llama()), dtype=dtype)
    applied = apply_lora(loaded.model, LoraSpec(rank=4, alpha=8.0), loaded.family, seed=0)
    base_before = _base_params(applied.model)
    lora_before = jax.tree.map(np.array, lora_state(applied.model))
    assert len(applied.module_paths) == 7  # q, k, v, o, gate, up, down of the one layer

    spec = DatasetSpec(train=write_jsonl(tmp_path / "t.jsonl", arithmetic_rows(32)), max_seq_len=32)
    tok = data.load_tokenizer(tiny_llama())
    seqs = data.to_sequences(data.tokenize_file(spec.train, spec, tok), spec)
    stream = data.BatchStream(seqs, global_batch=8, seq_len=32, seed=0, pad_id=tok.pad_token_id)
    trainer = make_trainer(applied.model, TrainingSpec(steps=20, learning_rate=0.01, schedule="constant"))
    losses = []
    for _ in range(20):
        trainer.train([next(stream)])
        losses.append(float(trainer.train_aux[-1]["loss"]))

    assert np.mean(losses[-3:]) < 0.6 * np.mean(losses[:3]), losses
    base_after = _base_params(trainer.model)
    assert base_after.keys() == base_before.keys() and len(base_after) >= 9
    for name, before in base_before.items():
        assert np.array_equal(before, base_after[name]), f"base param {name} changed"
    lora_after = lora_state(trainer.model)
    for path, params in lora_before.items():
        for name, before in params.items():
            assert not np.array_equal(before, np.asarray(lora_after[path][name])), f"LoRA param {path}/{name} did not train"


def test_state_variables_found_after_the_first_step_read_the_later_steps(tmp_path):
    """A save reads the state through variables found once (`AsyncSaves`): the steps must update
    those variables, never replace them, or every later checkpoint would hold the first one's state."""
    loaded = load_model(str(tiny_llama()), dtype="float32")
    applied = apply_lora(loaded.model, LoraSpec(rank=4, alpha=8.0, dropout=0.1), loaded.family, seed=0)
    spec = DatasetSpec(train=write_jsonl(tmp_path / "t.jsonl", arithmetic_rows(16)), max_seq_len=32)
    tok = data.load_tokenizer(tiny_llama())
    stream = data.BatchStream(data.to_sequences(data.tokenize_file(spec.train, spec, tok), spec), global_batch=4, seq_len=32, seed=0, pad_id=tok.pad_token_id)
    trainer = make_trainer(applied.model, TrainingSpec(steps=3, learning_rate=0.01, schedule="constant"))
    trainer.train([next(stream)])
    found = lora_variables(trainer.model), tunix_trainer.optimizer_variables(trainer)
    first = jax.tree.map(np.array, (read_lora(found[0]), tunix_trainer.read_optimizer(found[1])))
    trainer.train([next(stream)])
    trainer.train([next(stream)])
    later = jax.tree.map(np.array, (read_lora(found[0]), tunix_trainer.read_optimizer(found[1])))
    jax.tree.map(np.testing.assert_array_equal, later, (lora_state(trainer.model), tunix_trainer.optimizer_state(trainer)))
    changed = jax.tree.leaves(jax.tree.map(lambda a, b: not np.array_equal(a, b), first, later))
    assert sum(changed) > len(changed) / 2  # LoRA, both AdamW moments, the step counts and the dropout RNG moved on


def test_eval_runs_without_lora_dropout_and_training_with_it(tmp_path):
    loaded = load_model(str(tiny_llama()), dtype="float32")
    noisy = apply_lora(loaded.model, LoraSpec(rank=4, alpha=8.0, dropout=0.5), loaded.family, seed=0).model
    plain = apply_lora(loaded.model, LoraSpec(rank=4, alpha=8.0), loaded.family, seed=0).model
    rng = np.random.default_rng(3)
    params = {p: {n: rng.standard_normal(np.shape(v)).astype(np.float32) for n, v in d.items()} for p, d in lora_state(noisy).items()}
    set_lora_state(noisy, params)
    set_lora_state(plain, params)
    spec = DatasetSpec(train=write_jsonl(tmp_path / "t.jsonl", arithmetic_rows(16)), max_seq_len=32)
    tok = data.load_tokenizer(tiny_llama())
    stream = data.BatchStream(data.to_sequences(data.tokenize_file(spec.train, spec, tok), spec), global_batch=4, seq_len=32, seed=0, pad_id=tok.pad_token_id)
    batch = next(stream)
    expected = float(lm_loss(plain, **model_inputs({k: jax.numpy.asarray(v) for k, v in batch.items()}))[0])

    trainer = make_trainer(noisy, TrainingSpec(steps=2, learning_rate=1e-9, schedule="constant"))
    evals = []
    for _ in range(2):
        trainer.train([], eval_ds=[batch])
        evals.append(float(trainer.eval_aux.pop()["loss"]))
    assert evals == pytest.approx([expected, expected], rel=1e-5)
    trainer.train([batch])
    assert abs(float(trainer.train_aux[-1]["loss"]) - expected) > 1e-3  # the train step still drops out


def test_gradient_accumulation_is_one_batch_of_the_same_examples(tmp_path):
    """globalBatchSize 8 in 1, 2 or 4 micro-batches: one optimizer step's gradient (AdamW's first
    moment, 0.1 x the gradient) is the same, though the examples' completions run 1-59 tokens:
    every loss token of the step weighs alike. With each micro-batch's own mean it was 3% off here
    (22% in an audit with longer completions)."""
    rows = [{"prompt": f"Q {i}?", "completion": " A." + " more words" * (i % 5 * 3)} for i in range(8)]
    spec = DatasetSpec(train=write_jsonl(tmp_path / "t.jsonl", rows), format="prompt-completion", max_seq_len=64)
    tok = data.load_tokenizer(tiny_llama())
    seqs = data.to_sequences(data.tokenize_file(spec.train, spec, tok), spec)
    assert len({s.loss_targets() for s in seqs}) >= 3
    first_moment = {}
    for accumulation in (1, 2, 4):
        loaded = load_model(str(tiny_llama()), dtype="float32")  # its own: the trainer's steps take the model's arrays
        model = apply_lora(loaded.model, LoraSpec(rank=4, alpha=8.0), loaded.family, seed=0).model
        trainer = make_trainer(model, TrainingSpec(steps=1, global_batch_size=8, gradient_accumulation=accumulation,
                                                   learning_rate=0.01, schedule="constant"))
        stream = data.BatchStream(seqs, global_batch=8 // accumulation, seq_len=64, seed=0, pad_id=tok.pad_token_id,
                                  accumulation=accumulation)
        trainer.train([next(stream) for _ in range(accumulation)])
        state = nnx.to_flat_state(nnx.state(trainer.optimizer))
        first_moment[accumulation] = {
            "/".join(map(str, path)).split("/mu/")[1]: np.asarray(v.get_value()) for path, v in state if "mu" in path
        }
    assert len(first_moment[1]) == 14
    for accumulation in (2, 4):
        for name, want in first_moment[1].items():
            got = first_moment[accumulation][name]
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), (accumulation, name)


def test_learning_rate_schedules():
    cos = schedule.learning_rate_schedule(TrainingSpec(steps=10, learning_rate=1.0, warmup_steps=2, schedule="cosine"))
    assert [float(cos(s)) for s in (0, 1, 2)] == pytest.approx([0.0, 0.5, 1.0])
    assert float(cos(6)) == pytest.approx(0.5) and float(cos(10)) == pytest.approx(0.0)
    lin = schedule.learning_rate_schedule(TrainingSpec(steps=10, learning_rate=1.0, schedule="linear"))
    assert [float(lin(s)) for s in (0, 5, 10)] == pytest.approx([1.0, 0.5, 0.0])
    const = schedule.learning_rate_schedule(TrainingSpec(steps=10, learning_rate=0.3, warmup_steps=3, schedule="constant"))
    assert [float(const(s)) for s in (0, 3, 9)] == pytest.approx([0.0, 0.3, 0.3])
    # Weight decay reaches AdamW: a zero gradient still shrinks a parameter.
    opt = schedule.optimizer(TrainingSpec(steps=10, learning_rate=0.1, schedule="constant", weight_decay=0.5))
    params = {"w": jax.numpy.ones(2)}
    updates, _ = opt.update({"w": jax.numpy.zeros(2)}, opt.init(params), params)
    assert float(optax.apply_updates(params, updates)["w"][0]) == pytest.approx(1 - 0.1 * 0.5)


def test_progress_record_schema_and_eta():
    rec = progress_record(
        step=10, total_steps=100, loss=1.5, learning_rate=1e-4, tokens_per_second=1000.0,
        step_time_seconds=41.5, mfu=None, last_checkpoint="gs://b/run/checkpoints/10",
    )  # fmt: skip
    assert set(rec) == PROGRESS_KEYS
    assert rec["etaSeconds"] == pytest.approx(90 * 41.5) and rec["eta"] == "1h02m"
    assert rec["time"].endswith("Z")
    assert [format_eta(s) for s in (0, 59, 61, 3600)] == ["0s", "59s", "1m01s", "1h00m"]
    assert progress_record(**{**_REC, "loss": float("nan")})["loss"] is None


def test_the_eta_counts_the_eval_passes_still_due():
    """The ETA said 9s with two 20 s eval passes to come (real-size audit): steps only."""
    t = TrainingSpec(steps=10, learning_rate=1e-4, eval_every=4)
    assert [evals_due(s, t) for s in (0, 3, 4, 7, 8, 9, 10)] == [3, 3, 2, 2, 1, 1, 0]  # at 4, 8 and the end
    assert [evals_due(s, TrainingSpec(steps=8, learning_rate=1e-4, eval_every=4)) for s in (0, 4, 7, 8)] == [2, 1, 1, 0]
    assert [evals_due(s, TrainingSpec(steps=5, learning_rate=1e-4)) for s in (0, 4, 5)] == [1, 1, 0]  # the end only
    rec = progress_record(**{**_REC, "step": 2, "total_steps": 10, "step_time_seconds": 1.5, "pending_seconds": 3 * 20.0})
    assert rec["etaSeconds"] == pytest.approx(8 * 1.5 + 60.0) and rec["eta"] == "1m12s"


def test_interval_timer_leaves_eval_and_checkpoint_time_out():
    now = [0.0]
    timer = IntervalTimer(lambda: now[0])
    now[0] = 2.0  # two steps
    assert timer.lap() == 2.0
    with timer.paused():  # the eval and the checkpoint after that log line
        now[0] = 30.0
    now[0] = 31.0  # the next step
    assert timer.lap() == 1.0
    now[0] = 32.0
    with timer.paused():  # an eval between log lines
        now[0] = 40.0
    now[0] = 41.0
    assert timer.lap() == 2.0


def test_interval_timer_laps_at_a_past_moment_and_carries_the_pause_that_ran_past_it():
    """A step's record is written after the next step is queued: its interval ends when the step did."""
    now = [0.0]
    timer = IntervalTimer(lambda: now[0])
    with timer.paused():  # the first step (compiling), and its memory report after it ended at 5.0
        now[0] = 6.0
    now[0] = 6.5
    assert timer.lap(at=5.0) == 0.0  # all of it paused
    now[0] = 8.0  # the next step ended at 7.5
    assert timer.lap(at=7.5) == pytest.approx(2.5 - 1.0)  # less the pause's second past 5.0
    now[0] = 9.0
    with timer.paused():  # a save after the step that ended at 9.0
        now[0] = 9.5
    assert timer.lap(at=9.0) == pytest.approx(1.5)  # the save counts towards the next interval
    now[0] = 11.0
    assert timer.lap(at=10.8) == pytest.approx(1.8 - 0.5)


def test_a_records_interval_runs_from_one_steps_end_to_the_next(tmp_path, monkeypatch):
    """Records are written once the next step is queued (a save's, an eval's and the last at once).
    Lapped when written, the intervals around each save read 0.48 s and 1.57 s for 0.98 s steps
    on a v5e chip; they now run between the moments the steps finished. Here queuing a step
    returns 50 ms late, as the chip's queue returns halfway into the step it queued."""
    finished: list[float] = []
    original_finished, original_train = train_module._finished_at, tunix_trainer.LoraPeftTrainer.train

    def finished_spy(arrays):
        finished.append(original_finished(arrays))
        return finished[-1]

    def late_train(self, train_ds, *args, **kwargs):
        original_train(self, train_ds, *args, **kwargs)
        time.sleep(0.05)

    monkeypatch.setattr(train_module, "_finished_at", finished_spy)
    monkeypatch.setattr(tunix_trainer.LoraPeftTrainer, "train", late_train)
    records: list[dict] = []
    run_training(parse(train_config(tmp_path, str(tmp_path / "out"), steps=6, checkpointEvery=6)), on_progress=records.append)
    timed = [r["stepTimeSeconds"] for r in records if r.get("stepTimeSeconds")][:5]
    assert len(finished) == 6 and len(timed) == 5
    # From step 3 on (step 2's interval also loses what the first step's pause ran past its end);
    # the last record, written at once, read 50 ms short when lapped as written.
    assert timed[1:] == pytest.approx(list(np.diff(finished)[1:]), abs=0.005)


_REC = dict(step=1, total_steps=2, loss=1.0, learning_rate=0.1, tokens_per_second=1.0, step_time_seconds=1.0, mfu=0.5, last_checkpoint=None)


def test_incompatibilities_name_the_changed_fields():
    saved = {"baseModel": "gs://m/a", "family": "llama3", "rank": 8, "alpha": 16.0, "targetModules": "x", "quantization": None}
    assert incompatibilities(saved, dict(saved)) == []
    assert incompatibilities(saved, {**saved, "baseModel": "gs://m/a/"}) == []  # the same directory
    # The same files at another path (a moved project directory) are the same base; other files are not.
    moved = {**saved, "baseModel": "/new/place/tiny", "baseModelFingerprint": "f1"}
    assert incompatibilities({**saved, "baseModel": "/old/place/tiny", "baseModelFingerprint": "f1"}, moved) == []
    assert incompatibilities({**saved, "baseModel": "/old/place/tiny", "baseModelFingerprint": "f0"}, moved) != []
    changed = incompatibilities(saved, {**saved, "rank": 4, "baseModel": "gs://m/b"})
    assert changed == ["model.source (checkpoint: 'gs://m/a', config: 'gs://m/b')", "lora.rank (checkpoint: 8, config: 4)"]


@pytest.mark.slow
def test_run_writes_checkpoints_metrics_progress_and_tensorboard(tmp_path):
    out = tmp_path / "out"
    cfg = train_config(tmp_path, str(out), steps=6, checkpointEvery=2, checkpointsToKeep=2, gradientAccumulation=2, evalEvery=4)
    # The eval set holds an example longer than any training example (batches of their own length).
    longer = {"prompt": "Question: 1 + 2 + 3 + 4 + 5 + 6?", "completion": " Answer: 21."}
    cfg["dataset"]["eval"] = write_jsonl(tmp_path / "data" / "eval.jsonl", [*arithmetic_rows(3), longer])
    cfg["dataset"]["maxSeqLen"] = 64
    seen = []

    def observe(record: dict) -> None:  # what a reader sees when each record is published
        seen.append({**record, "committed": checkpoint.committed_steps(str(out / "checkpoints"))})

    result = run_training(parse(cfg), on_progress=observe)

    assert result.final_step == 6
    assert checkpoint.committed_steps(result.checkpoint_root) == [4, 6]
    tree, meta = checkpoint.read_lora(result.checkpoint_root)
    assert meta["family"] == "llama3" and meta["baseModel"] == str(tiny_llama())
    assert (meta["rank"], meta["alpha"], meta["dropout"], meta["quantization"], meta["step"]) == (4, 8.0, 0.0, None, 6)
    assert meta["targetModules"].startswith("layers/")  # `auto` resolved to the family's regex
    assert sorted(tree) == meta["modulePaths"] and len(tree) == 7

    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train_lines = [x for x in lines if "loss" in x]
    assert [x["step"] for x in train_lines] == [1, 2, 3, 4, 5, 6]
    assert all(set(x) == PROGRESS_KEYS for x in train_lines)
    assert [x["step"] for x in lines if x.get("eval/loss", 0) > 0] == [4, 6]  # every evalEvery steps, and at the end
    # Step 1 compiled the train step: no throughput for its line (its ETA was the compile time x the
    # steps left); the later lines time only training steps.
    assert [train_lines[0][k] for k in ("tokensPerSecond", "stepTimeSeconds", "etaSeconds", "eta")] == [None] * 4
    assert all(x["tokensPerSecond"] > 0 and x["stepTimeSeconds"] > 0 and isinstance(x["eta"], str) for x in train_lines[1:])
    # Saves commit in the background while training goes on: a line names the newest checkpoint
    # committed by then (step 6 is saved after its line).
    assert train_lines[-1]["lastCheckpoint"] in (None, f"{out}/checkpoints/2", f"{out}/checkpoints/4")
    assert train_lines[0]["mfu"] is None  # CPU: peak unknown
    progress = json.loads((out / "progress.json").read_text())
    assert set(progress) == PROGRESS_KEYS and progress["step"] == 6 and progress["totalSteps"] == 6
    assert progress["lastCheckpoint"] == str(out / "checkpoints" / "6")  # rewritten once step 6 committed
    # Every record names a checkpoint that had committed when it was published (never one in
    # flight), newer ones over time; each save is announced once, by a record of its own.
    named = [None if r["lastCheckpoint"] is None else int(r["lastCheckpoint"].rsplit("/", 1)[1]) for r in seen]
    assert all(n is None or (n <= r["step"] and n in r["committed"]) for n, r in zip(named, seen))
    assert [n for n in named if n is not None] == sorted(n for n in named if n is not None)
    announced = [n for prev, n, r in zip([None, *named], named, seen) if n != prev]
    assert announced == [2, 4, 6]
    assert [r["step"] for r in seen if "loss" in r].count(6) >= 1 and named[-1] == 6
    assert seen[-1]["loss"] == progress["loss"]
    assert any(p.name.startswith("events.out.tfevents") for p in (out / "tensorboard").iterdir())
    assert result.final_loss == pytest.approx(progress["loss"]) and result.eval_loss is not None


def test_the_next_step_is_queued_before_a_steps_record_waits_for_its_loss(tmp_path, monkeypatch):
    """A record waits for its step's loss. Written before the next step was queued, the chip idled
    while the host wrote it and fed the next step. A save's, an eval's and the last step's record
    are written at once: their time is taken out of the interval, so the step must be done first."""
    events: list[object] = []
    train = tunix_trainer.LoraPeftTrainer.train

    def spy(self, train_ds, *args, **kwargs):
        if train_ds:
            events.append("step queued")
        return train(self, train_ds, *args, **kwargs)

    monkeypatch.setattr(tunix_trainer.LoraPeftTrainer, "train", spy)
    run_training(parse(train_config(tmp_path, str(tmp_path / "out"), steps=6, checkpointEvery=4)), on_progress=lambda r: events.append(r["step"]))
    q = "step queued"
    assert events[: events.index(6) + 1] == [q, q, 1, q, 2, q, 3, 4, q, q, 5, 6]  # then the end of the run writes step 6 again


def test_the_train_step_is_traced_once_ahead_on_a_thread_in_the_runs_mesh(tmp_path, monkeypatch):
    """`compile_ahead` traces and compiles the step while a restart restores its checkpoint. A
    second trace would mean the first step missed what was compiled ahead, and paid for it again;
    a trace outside the run's mesh, a program other than the run's (the splash kernel and Tunix's
    models read the mesh of the thread that traces)."""
    traces: list[tuple[str, bool]] = []
    create = tunix_trainer.LoraPeftTrainer.create_train_step_fn

    def spy(self):
        step = create(self)

        @functools.wraps(step)
        def traced(*args, **kwargs):
            traces.append((threading.current_thread().name, pxla.thread_resources.env.physical_mesh.empty))
            return step(*args, **kwargs)

        return traced

    monkeypatch.setattr(tunix_trainer.LoraPeftTrainer, "create_train_step_fn", spy)
    out = str(tmp_path / "out")
    run_training(parse(train_config(tmp_path, out, steps=2, checkpointEvery=2)))
    resumed = run_training(parse(train_config(tmp_path, out, steps=4, checkpointEvery=2)))  # from step 2's checkpoint
    assert resumed.final_step == 4
    assert traces == [("compile-ahead", False), ("compile-ahead", False)]  # one per process


def test_tunix_does_not_wait_for_the_queued_steps_at_the_end_of_train():
    """`train()` runs one optimizer step; Tunix's throttler waited there for every queued micro-step."""

    @jax.jit
    def slow(x, n):  # about a second's work on the CPU, dispatched asynchronously
        return jax.lax.fori_loop(0, n, lambda i, y: jnp.tanh(y @ y), x)

    x = jnp.eye(512) * 0.5
    slow(x, 1).block_until_ready()  # compiled
    start = time.perf_counter()
    slow(x, 10).block_until_ready()
    n = int(10 * 1.0 / max(time.perf_counter() - start, 1e-3)) + 10
    throttler = tunix_trainer._StepsInFlight(2)
    first = slow(x, n)
    throttler.add_computation(first)
    throttler.wait_for_next()  # one queued, below the limit
    throttler.wait_for_all()
    assert not first.is_ready()
    throttler.add_computation(slow(x, 1))
    throttler.wait_for_next()  # two queued: waits for the first
    assert first.is_ready()


def test_sigterm_saves_before_an_eval_pass(tmp_path):
    out = tmp_path / "out"
    cfg = train_config(tmp_path, str(out), steps=6, checkpointEvery=5, evalEvery=3)
    cfg["dataset"]["eval"] = cfg["dataset"]["train"]

    def preempt(record: dict) -> None:  # SIGTERM arrives during step 3, which would evaluate
        if record["step"] == 3 and record["lastCheckpoint"] is None:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(Preempted, match="checkpoint step 3 is saved"):
        run_training(parse(cfg), on_progress=preempt)
    assert checkpoint.committed_steps(str(out / "checkpoints")) == [3]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert not [x for x in lines if "eval/loss" in x]


@pytest.mark.slow
def test_restore_from_an_orbax_adapter(tmp_path, capsys):
    rng = np.random.default_rng(1)
    src = train_config(tmp_path, str(tmp_path / "unused"))
    loaded = load_model(str(tiny_llama()), dtype="float32")
    applied = apply_lora(loaded.model, LoraSpec(rank=4, alpha=8.0), loaded.family, seed=0)
    adapter = {p: {n: rng.standard_normal(np.shape(v)).astype(np.float32) * 0.01 for n, v in ps.items()} for p, ps in lora_state(applied.model).items()}
    meta = {"family": "llama3", "baseModel": str(tiny_llama()), "rank": 4, "alpha": 8.0, "dropout": 0.0,
            "targetModules": applied.target_regex, "quantization": None, "modulePaths": applied.module_paths}  # fmt: skip
    checkpoint.write_lora(str(tmp_path / "adapter"), 0, adapter, meta)

    # Alpha is not in the tensors, so it is checked against the adapter's metadata.
    bad = {**src, "lora": {"rank": 4, "alpha": 16.0, "restoreFrom": str(tmp_path / "adapter")}, "output": {"uri": str(tmp_path / "bad")}}
    with pytest.raises(UserError, match=r"trained with alpha 8\.0 but lora\.alpha is 16\.0"):
        run_training(parse(bad))
    missing = {**bad, "lora": {"rank": 4, "alpha": 8.0, "restoreFrom": str(tmp_path / "nothing")}}
    with pytest.raises(UserError, match=r"lora\.restoreFrom .*nothing holds neither an HF PEFT adapter"):
        run_training(parse(missing))

    # With a vanishing learning rate, one step leaves the restored adapter in place.
    ok = {**src, "lora": {"rank": 4, "alpha": 8.0, "restoreFrom": str(tmp_path / "adapter")}, "output": {"uri": str(tmp_path / "ok")}}
    ok["training"] = {**src["training"], "steps": 1, "learningRate": 1e-12, "warmupSteps": 0}
    capsys.readouterr()
    result = run_training(parse(ok))
    assert "zeros until the adapter sets them" in capsys.readouterr().err  # LoRA built from Qwix's forward traced, not run
    got, _ = checkpoint.read_lora(result.checkpoint_root)
    for p, ps in adapter.items():
        for n, v in ps.items():
            np.testing.assert_allclose(got[p][n], v, atol=1e-6)


def test_qlora_on_the_host_runs_outside_the_runs_mesh() -> None:
    """QLoRA's dummy forward runs on the host; Tunix's models constrain activations to the legacy
    `with mesh:` mesh unless its first device is a CPU, so on a TPU the host forward failed with
    "incompatible devices" (issue 21). Under `_on_host` that mesh is empty and arrays land on the CPU."""
    from jax.interpreters import pxla

    from lora_trainer.train import _on_host

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tp"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the legacy context Tunix reads
        with mesh:
            with _on_host():
                assert pxla.thread_resources.env.physical_mesh.empty
                assert {d.platform for d in jax.numpy.ones(2).devices()} == {"cpu"}
            assert pxla.thread_resources.env.physical_mesh == mesh
