"""`lora-trainer train`: load the base, apply LoRA, train with Tunix's PeftTrainer, checkpoint, resume.

How the pieces fit, and why:
  - Tunix `PeftTrainer` runs every optimizer step (its jitted train step differentiates only
    the `nnx.LoRAParam`s; gradient accumulation is its `optax.MultiSteps`). Its own
    checkpointing is switched off (`checkpoint_root_directory=None`): its layout
    (`model_params`/`optimizer_state`, batches skipped by counting) is not the format other
    components read (docs/dev/contracts.md), and it cannot store the data position or the
    adapter metadata. So this module drives Orbax around the trainer, one step at a time:
    `trainer.train([micro-batches of one step])` returns at a step boundary, where the loop
    checkpoints, logs, evaluates, or stops on SIGTERM. What happens inside a step (loss,
    optimizer, donation, batch placement) is `tunix_trainer`'s; stopping is `stop`'s.
  - Resume is exact: the LoRA params, the full optimizer state (step count included, so the
    schedule continues) and the data position come from the latest committed checkpoint,
    so a killed-and-restarted run computes the same adapter as an uninterrupted one.
  - A checkpoint of a run with other LoRA settings in the same output is refused, naming what
    changed, instead of being silently mixed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from lora_trainer import backend_start, checkpoint, compile_cache, data, distributed, schedule, step_record, storage, trainer_logging, tunix_trainer
from lora_trainer import metrics as mfu_metrics
from lora_trainer.async_saves import AsyncSaves
from lora_trainer.background import in_background, prompt_handoffs
from lora_trainer.config import TrainConfig, TrainingSpec
from lora_trainer.errors import UserError
from lora_trainer.lora import apply_lora, resolve_target_regex, set_lora_state
from lora_trainer.models import LoadedModel, late_weights, layer_stack, load_model, remat
from lora_trainer.models.loading import host_device, place_on_mesh
from lora_trainer.models.attention import choose_kernel, padded_length
from lora_trainer.progress import IntervalTimer, ProgressCallback, ProgressSink, progress_record
from lora_trainer.stop import StopRequest
from lora_trainer.token_cache import TokenCache

log = logging.getLogger(__name__)

#: Metadata keys whose change makes an existing checkpoint unusable, with the config field users change.
_COMPATIBILITY = (
    ("baseModel", "model.source"),
    ("family", "model.family"),
    ("rank", "lora.rank"),
    ("alpha", "lora.alpha"),
    ("targetModules", "lora.targetModules"),
    ("quantization", "lora.quantization"),
)


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What a finished run produced."""

    final_step: int
    checkpoint_root: str
    metrics_path: str
    final_loss: float | None = None
    eval_loss: float | None = None


def incompatibilities(saved: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """What differs between a checkpoint's metadata and this config, as `field: checkpoint X, config Y`. Pure.

    A base model at another path with the same files (`baseModelFingerprint`) is the same base: a
    project directory moved or renamed, which the local mode's absolute paths follow."""
    same_files = bool(saved.get("baseModelFingerprint")) and saved.get("baseModelFingerprint") == expected.get("baseModelFingerprint")
    return [
        f"{field} (checkpoint: {saved.get(key)!r}, config: {expected[key]!r})"
        for key, field in _COMPATIBILITY
        if _comparable(key, saved.get(key)) != _comparable(key, expected[key]) and not (key == "baseModel" and same_files)
    ]


def evals_due(step: int, t: TrainingSpec) -> int:
    """Eval passes still to run after `step`: every `evalEvery` steps, and at the end. Pure; the
    one statement of the eval schedule (a pass runs at `step` when this drops from `step - 1`)."""
    if step >= t.steps:
        return 0
    every = t.eval_every or t.steps
    return t.steps // every - step // every + (t.steps % every != 0)


def _parameters(model: nnx.Module, kind: Any = nnx.Param) -> int:
    """How many parameters of `kind` the model holds."""
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, kind)))


def _count(model: nnx.Module, kind: Any = nnx.Param) -> str:
    """`_parameters` for a log line: `494.0M`, `1.24B`."""
    n = _parameters(model, kind)
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def base_fingerprint(model_dir: Path) -> str:
    """sha256 of a checkpoint directory's config.json and its safetensors files' names and sizes:
    cheap (no weights read), and it tells a moved copy of a base model from another model."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        digest.update(f"{f.name}:{f.stat().st_size}".encode())
    return digest.hexdigest()


def _comparable(key: str, value: Any) -> Any:
    """`model.source` with and without a trailing slash names the same model."""
    return value.rstrip("/") if key == "baseModel" and isinstance(value, str) else value


# --------------------------------------------------------------------------- the run


def _restore_adapter(uri: str, base_source: str, family: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """An existing adapter to start from: HF PEFT (has adapter_config.json) via the converter, else Orbax."""
    if storage.exists(storage.join(uri, "adapter_config.json")):
        from lora_trainer.adapters.convert import convert

        with tempfile.TemporaryDirectory(prefix="lora-restore-") as tmp:
            out = f"{tmp}/orbax"
            convert("hf-peft", "orbax", uri, out, base=base_source, family=family)
            return checkpoint.read_lora(out)
    if not checkpoint.committed_steps(uri) and not storage.exists(storage.join(uri, "metadata")):
        raise UserError(
            f"lora.restoreFrom {uri} holds neither an HF PEFT adapter (adapter_config.json) nor a committed Orbax "
            "LoRA checkpoint: point it at an adapter directory, a run's `<output>/checkpoints`, or one step in it"
        )
    return checkpoint.read_lora(uri)


def _check_restored(cfg: TrainConfig, meta: dict[str, Any]) -> None:
    """Rank and alpha of a `restoreFrom` adapter must be the config's (alpha is not visible in the tensors)."""
    for key, field in (("rank", "lora.rank"), ("alpha", "lora.alpha")):
        want = getattr(cfg.lora, key)
        if key in meta and float(meta[key]) != float(want):
            raise UserError(
                f"lora.restoreFrom {cfg.lora.restore_from} was trained with {key} {meta[key]} but {field} is {want}; "
                f"set {field} to {meta[key]}"
            )


def _longest(seqs: list[data.Sequence]) -> int:
    return max(len(s.tokens) for s in seqs)


def _flops_per_token(model: nnx.Module, hf_config: dict[str, Any], seq_len: int) -> float:
    base = _parameters(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
    lora = _parameters(model, nnx.LoRAParam)
    hidden, vocab = int(hf_config["hidden_size"]), int(hf_config["vocab_size"])
    embedding_lookup = 0 if hf_config.get("tie_word_embeddings") else hidden * vocab
    heads = int(hf_config["num_attention_heads"])
    head_dim = int(hf_config.get("head_dim") or hidden // heads)
    return mfu_metrics.lora_train_flops_per_token(
        matmul_params=base - embedding_lookup,
        lora_params=lora,
        num_layers=int(hf_config["num_hidden_layers"]),
        attn_width=heads * head_dim,
        seq_len=seq_len,
    )


def run_training(cfg: TrainConfig, *, on_progress: ProgressCallback | None = None, interruptible: bool = False) -> TrainResult:
    """Train (or resume) the LoRA adapter `cfg` describes; returns when `training.steps` are done.

    Raises UserError for bad input, Preempted after a SIGTERM (checkpoint committed) and
    RetriableError after a storage outage; the CLI maps them to exit codes 3, 43 and 42. With `interruptible` (the
    `lora-trainer train` CLI and the local mode), Ctrl-C from a terminal is handled as SIGTERM is
    and raises Interrupted (130).
    """
    trainer_logging.configure()  # before the backend starts: joining a multi-host run logs
    backend_start.ready()  # malloc tuned, multi-host run joined, backend started (on a thread if the CLI began it)
    mesh = distributed.make_mesh(cfg.training.mesh)
    cache = compile_cache.location(cfg.training.compilation_cache, cfg.output.uri)
    with StopRequest(interruptible=interruptible).installed() as stop, warnings.catch_warnings(), compile_cache.persistent(cache):
        # Tunix 0.1.7 finds the mesh through the legacy `with mesh:` context (pxla.thread_resources).
        warnings.filterwarnings("ignore", category=DeprecationWarning, message=".*mesh.*")
        with mesh:
            return _Run(cfg, mesh, stop, on_progress).run()


def _finished_at(arrays: Any) -> float:
    """When `arrays` are computed (`time.perf_counter`), waited for on a thread while the loop queues the next step."""
    jax.block_until_ready(arrays)
    return time.perf_counter()


@contextlib.contextmanager
def _on_host() -> Iterator[None]:
    """Compute on this process's CPU, outside the run's mesh.

    Tunix's models constrain activations to the legacy `with mesh:` mesh unless its first device is
    a CPU; on an accelerator that mesh holds no CPU device, so QLoRA's dummy forward on the host
    failed there with "incompatible devices" (found on a v5e chip, issue 21; a CPU run never
    constrains). An empty mesh is entered for the duration instead.
    """
    with jax.default_device(host_device()), jax.sharding.Mesh(np.empty((), dtype=object), ()):
        yield


@dataclasses.dataclass
class _Data:
    """The run's batches: the training stream, the eval set and the padded length of a training row."""

    stream: data.BatchStream
    eval_batches: list[dict[str, np.ndarray]] | None
    seq_len: int


class _Run:
    """One training run's state; `run()` reads top to bottom as the steps of a run."""

    def __init__(self, cfg: TrainConfig, mesh: jax.sharding.Mesh, stop: StopRequest, on_progress: ProgressCallback | None):
        self.cfg = cfg
        self.mesh = mesh
        self.stop = stop
        self.on_progress = on_progress
        self.root = checkpoint.checkpoint_root(cfg.output.uri)
        self.primary = jax.process_index() == 0
        self.backend = jax.default_backend()
        self.kernel = choose_kernel(cfg.training.attention, self.backend)

    def run(self) -> TrainResult:
        cfg, t = self.cfg, self.cfg.training
        storage.check_output_location(cfg.output.uri, "output.uri")  # before minutes of loading
        loaded = self._load_base()
        resume_step = checkpoint.latest_committed_step(self.root)
        if resume_step is not None:
            self._check_compatible(resume_step)
            if resume_step >= t.steps:
                log.info("training already finished at step %d (training.steps=%d); nothing to do", resume_step, t.steps)
                return self._result(resume_step)
        batches = self._data(loaded)
        restored = None
        if resume_step is None and cfg.lora.restore_from:
            restored = _restore_adapter(cfg.lora.restore_from, cfg.model.source, loaded.family.name)
            _check_restored(cfg, restored[1])
        model = self._adapter(loaded, restored, resuming=resume_step is not None)
        trainer = tunix_trainer.make_trainer(model, t, splash=self.kernel == "splash")
        store = checkpoint.TrainingCheckpoints(self.root, keep=t.checkpoints_to_keep)
        # Three things overlap here: the step traced and compiled (or read from the cache) on its
        # thread, the checkpoint read on another, the base's weights read on this one. The last two
        # are mostly native work, each waiting for the interpreter between its calls (`prompt_handoffs`).
        # The read begins here, not once the run knows its step: on a v5e, beside the data and LoRA
        # (Python, at the default switch interval) it made a 1B restart 2.1-2.7 s longer.
        with prompt_handoffs():
            reading = None if resume_step is None else in_background(lambda: store.read(resume_step), "restore")
            trainer.compile_ahead(tunix_trainer.on_mesh(batches.stream.peek(), self.mesh), self._records(loaded))
            if loaded.placeholders:
                self._read_weights(loaded)
            step = 0 if reading is None else self._resume(reading, trainer, batches.stream, resume_step)
        sink = ProgressSink(cfg.output.uri, primary=self.primary, resume_step=step, on_progress=self.on_progress)
        try:
            result = self._loop(trainer, batches, store, sink, step, loaded.hf_config)
        except BaseException:
            # No flush after a fault: in a storage outage it would wait out the retry deadline again
            # and replace the error; the steps since the last checkpoint are redone on resume anyway.
            sink.close(flush=False)
            store.close()
            raise
        sink.close()
        store.close()
        return result

    def _records(self, loaded: LoadedModel) -> step_record.Records | None:
        """Where the train step is kept for a restart to call without tracing it: the run's own
        compilation cache (`compile_cache.own_location`), never a cache shared between runs."""
        cache = compile_cache.own_location(self.cfg.training.compilation_cache, self.cfg.output.uri)
        if cache is None:
            return None
        return step_record.Records(cache, step_record.run_description(self.cfg, loaded.hf_config, self.kernel), write=self.primary)

    def _load_base(self) -> LoadedModel:
        """The base model on the mesh, and the checkpoint metadata that says what this run trains.

        Without QLoRA the weights are placeholders: `_read_weights` reads them once the train step
        is compiling (`late_weights`). QLoRA quantizes the values, on the host: the 16-bit base of
        a model that fits the chips only quantized never meets them."""
        cfg = self.cfg
        start = time.perf_counter()
        quantized = cfg.lora.quantization is not None
        loaded = load_model(cfg.model.source, family=cfg.model.family, dtype=cfg.model.dtype, mesh=self.mesh,
                            on_host=quantized, placeholders=not quantized)
        log.info("%s the %s model %s (%s parameters, %s) in %.1fs%s", "built" if loaded.placeholders else "loaded",
                 loaded.family.name, cfg.model.source, _count(loaded.model), cfg.model.dtype, time.perf_counter() - start,
                 "; its weights are read while the train step compiles" if loaded.placeholders else "")
        self.metadata = {
            "family": loaded.family.name,
            "multimodal": loaded.family.multimodal,
            "baseModel": storage.absolute_uri(cfg.model.source),  # export may run from another directory
            "rank": cfg.lora.rank,
            "alpha": cfg.lora.alpha,
            "dropout": cfg.lora.dropout,
            "targetModules": resolve_target_regex(cfg.lora.target_modules, loaded.family),
            "quantization": cfg.lora.quantization.to_wire() if cfg.lora.quantization else None,
            "numLayers": loaded.family.num_layers(loaded.hf_config),
            "baseModelFingerprint": base_fingerprint(loaded.local_dir),
        }
        return loaded

    def _read_weights(self, loaded: LoadedModel) -> None:
        """The base's weights into the model that `_adapter` made of its placeholders."""
        start = time.perf_counter()
        late_weights.read_into(loaded.model, loaded)
        log.info("loaded the base weights of %s in %.1fs, while the train step compiled", self.cfg.model.source,
                 time.perf_counter() - start)

    def _data(self, loaded: LoadedModel) -> _Data:
        """Tokenize this process's share of the data (or read what an earlier start tokenized); batches padded to one length per set."""
        cfg, t = self.cfg, self.cfg.training
        micro = t.global_batch_size // t.gradient_accumulation
        data_ways = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        if micro % data_ways:
            raise UserError(
                f"each micro-batch has {micro} rows (training.globalBatchSize / gradientAccumulation) but the mesh "
                f"splits batches {data_ways} ways (data x fsdp); make the micro-batch a multiple of {data_ways}"
            )
        share = data.Share(jax.process_index(), jax.process_count(), distributed.allgather_bytes)
        tokens = TokenCache(storage.join(cfg.output.uri, "tokenized"), loaded.local_dir, cfg.dataset, share, primary=self.primary)
        train_set, pad_id = tokens.tokenized(cfg.dataset.train)
        train_seqs = data.to_sequences(train_set, cfg.dataset)
        seq_len = padded_length(_longest(train_seqs), cfg.dataset.max_seq_len, self.kernel)
        if len(train_seqs) < t.global_batch_size:
            log.warning(
                "training.globalBatchSize is %d but the training data holds %d sequences%s: every step repeats some "
                "of them; lower globalBatchSize or add data", t.global_batch_size, len(train_seqs),
                " after packing" if cfg.dataset.packing else "",
            )  # fmt: skip
        max_positions = loaded.hf_config.get("max_position_embeddings")
        if isinstance(max_positions, int) and seq_len > max_positions:
            log.warning(
                "sequences of up to %d tokens, beyond the model's max_position_embeddings %d: it was never trained on "
                "those positions; lower dataset.maxSeqLen to %d unless the model is meant to extrapolate",
                seq_len, max_positions, max_positions,
            )  # fmt: skip
        stream = data.BatchStream(
            train_seqs, global_batch=micro, seq_len=seq_len, seed=t.seed, pad_id=pad_id, accumulation=t.gradient_accumulation
        )
        eval_batches = None
        if cfg.dataset.eval is not None:
            eval_seqs = data.to_sequences(tokens.tokenized(cfg.dataset.eval)[0], cfg.dataset)
            eval_len = padded_length(_longest(eval_seqs), cfg.dataset.max_seq_len, self.kernel)  # an eval example may be longer
            eval_batches = data.eval_batches(eval_seqs, global_batch=micro, seq_len=eval_len, pad_id=pad_id)
        return _Data(stream, eval_batches, seq_len)

    def _adapter(self, loaded: LoadedModel, restored: tuple[dict[str, Any], dict[str, Any]] | None,
                 *, resuming: bool) -> nnx.Module:
        """The base with (Q)LoRA applied (and a `restoreFrom` adapter loaded), set to rematerialise as configured.

        The LoRA model replaces the base in `loaded`: under QLoRA the base's 16-bit originals of the
        quantized weights are then freed (Qwix clones the model, so the original kept them alive).
        QLoRA is applied where the base was loaded, on the host, and the quantized model then
        moved onto the mesh. A resume, or a start from a `restoreFrom` adapter, builds LoRA's structure
        only: the checkpoint or the adapter holds every value."""
        cfg, quant = self.cfg, self.cfg.lora.quantization
        start = time.perf_counter()
        with _on_host() if quant else contextlib.nullcontext():
            applied = apply_lora(loaded.model, cfg.lora, loaded.family, seed=cfg.training.seed, batch_shape=(1, 8),
                                 structure_only=resuming or restored is not None)
        loaded.model = applied.model
        if quant:
            place_on_mesh(applied.model, self.mesh)
        log.info("added LoRA (%s trainable parameters%s)%s in %.1fs", _count(applied.model, nnx.LoRAParam),
                 f"; zeros until the {'checkpoint restores' if resuming else 'adapter sets'} them" if applied.zeros else "",
                 f" and quantized the base weights to {quant.weight_qtype}" if quant else "", time.perf_counter() - start)
        self.metadata["modulePaths"] = applied.module_paths
        if restored is not None:
            set_lora_state(applied.model, restored[0])  # module or shape mismatches are a UserError listing them
            log.info("starting from the adapter in %s", cfg.lora.restore_from)
        policy = remat.resolve(cfg.training.remat, self.backend)
        layers = remat.apply(applied.model, policy)
        loop = layer_stack.apply(applied.model, cfg.training.scan_layers)
        log.info("attention: %s kernel; rematerialisation: %s; %d decoder layers, %s", self.kernel, policy, layers, loop)
        return applied.model

    def _resume(self, reading: Future[tuple[Any, Any, dict[str, Any], dict[str, Any]]],
                trainer: tunix_trainer.LoraPeftTrainer, stream: data.BatchStream, step: int) -> int:
        """LoRA params, optimizer state and data position from the checkpoint read on its thread
        (`TrainingCheckpoints.read`, host arrays), placed like the trainer's own; returns the step."""
        lora, opt, position, _ = reading.result()
        where = checkpoint.step_uri(self.root, step)
        set_lora_state(trainer.model, lora)  # checks the tree and places each array (`checkpoint.placed`)
        tunix_trainer.restore_optimizer_state(trainer, checkpoint.placed_like(opt, tunix_trainer.optimizer_state(trainer), where))
        stream.restore(position)
        log.info("resuming from step %d (checkpoint %s)", step, where)
        return step

    def _check_compatible(self, step: int) -> None:
        saved = checkpoint.read_metadata(self.root, step)
        changed = incompatibilities(saved, self.metadata)
        if changed:
            raise UserError(
                f"output.uri {self.cfg.output.uri} already holds a checkpoint (step {step}) of a run with other LoRA "
                f"settings, so it cannot be resumed: changed {'; '.join(changed)}. Restore those settings to resume, "
                "or use a new output.uri to start over"
            )

    def _loop(
        self,
        trainer: tunix_trainer.LoraPeftTrainer,
        batches: _Data,
        store: checkpoint.TrainingCheckpoints,
        sink: ProgressSink,
        step: int,
        hf_config: dict[str, Any],
    ) -> TrainResult:
        t = self.cfg.training
        lr = schedule.learning_rate_schedule(t)
        flops_per_token = _flops_per_token(trainer.model, hf_config, batches.seq_len)
        mfu = functools.partial(mfu_metrics.mfu, flops_per_token=flops_per_token, device_kinds=[d.device_kind for d in jax.devices()])
        with AsyncSaves(self.root, store, sink, trainer, batches.stream, self.metadata, step) as saves:
            loss = eval_loss = None
            # The first step in a process compiles the train step (seconds to minutes): it stays out of
            # the timed interval, or the first line's tokens/s and ETA were off by that much.
            timer, timed_steps, untimed_tokens, compiled = IntervalTimer(time.perf_counter), 0, 0, False
            eval_seconds = 0.0  # the last eval pass's duration, for the ETA (unknown, 0, until one ran)
            # A logged step's record waits for its loss, so it is emitted once the next step is queued:
            # emitted at once, the chip idled while the host wrote it and fed the next step.
            pending: Callable[[], float] | None = None

            while step < t.steps:
                if self.stop.requested():
                    loss = pending() if pending else loss
                    saves.finish(step)
                    raise self.stop.error(step, self.root)
                micro_batches = [tunix_trainer.on_mesh(next(batches.stream), self.mesh) for _ in range(t.gradient_accumulation)]
                saves.poll()  # a save's handoff runs while the step below computes
                if compiled:
                    trainer.train(micro_batches)
                    timed_steps += 1
                else:
                    with timer.paused():
                        untimed_tokens = self._first_step(trainer, micro_batches, step)
                    compiled = True
                if pending:
                    loss, pending = pending(), None
                step += 1
                eval_due = bool(batches.eval_batches) and evals_due(step - 1, t) > evals_due(step, t)
                save_due = step % t.checkpoint_every == 0 and step < t.steps
                if step % t.log_every == 0 or step == t.steps:
                    pending = functools.partial(
                        self._emit_interval, list(trainer.train_aux), sink, step, timer, timed_steps, untimed_tokens,
                        lr=lr, mfu=mfu, saves=saves, eval_seconds=eval_seconds,
                        done=in_background(functools.partial(_finished_at, trainer.train_aux[-1]), "step-done"),
                    )
                    trainer.train_aux.clear()
                    timed_steps, untimed_tokens = 0, 0
                    if eval_due or save_due or step == t.steps:  # their time is paused: the step must be done first
                        loss, pending = pending(), None
                with timer.paused():
                    # After a SIGTERM the checkpoint comes first: an eval pass could outlast the grace period.
                    if eval_due and not self.stop.requested():
                        eval_loss, eval_seconds = self._eval_pass(trainer, batches, sink, step, first=not eval_seconds)
                    if save_due:
                        saves.start(step)
            saves.finish(step)
        return self._result(step, final_loss=loss, eval_loss=eval_loss)

    def _emit_interval(
        self,
        aux: list[dict[str, jax.Array]],
        sink: ProgressSink,
        step: int,
        timer: IntervalTimer,
        timed_steps: int,
        untimed_tokens: int,
        *,
        lr: Callable[[int], Any],
        mfu: Callable[[float], float | None],
        saves: AsyncSaves,
        eval_seconds: float,
        done: Future[float],
    ) -> float:
        """Emit the progress record of the interval ending at `step` (throughput over its timed steps,
        whose micro-steps left `aux`); its loss. The interval ends when the step did (`done`).

        Most records are emitted once the next step is queued, which can return halfway into that
        step; a save's, an eval's and the last are emitted at once. Lapped at emission, the
        intervals around each save read 0.48 s and 1.57 s for 0.98 s steps on a v5e chip."""
        t = self.cfg.training
        loss, _, tokens = tunix_trainer.weighted_loss(aux)
        elapsed = timer.lap(at=done.result())
        tps = (tokens - untimed_tokens) / elapsed if timed_steps else None
        record = progress_record(
            step=step,
            total_steps=t.steps,
            loss=loss,
            learning_rate=float(lr(step - 1)),
            tokens_per_second=tps,
            step_time_seconds=elapsed / timed_steps if timed_steps else None,
            mfu=None if tps is None else mfu(tps),
            last_checkpoint=saves.committed,
            pending_seconds=eval_seconds * evals_due(step, t),
        )
        sink.emit(record)
        return loss

    def _eval_pass(
        self, trainer: tunix_trainer.LoraPeftTrainer, batches: _Data, sink: ProgressSink, step: int, *, first: bool
    ) -> tuple[float, float]:
        """One pass over the eval batches at `step`: (its loss, its seconds)."""
        start = time.perf_counter()
        eval_loss = self._evaluate(trainer, (tunix_trainer.on_mesh(b, self.mesh) for b in batches.eval_batches))
        eval_seconds = time.perf_counter() - start
        sink.scalar("eval/loss", eval_loss, step)
        log.info("step %d: eval loss %.4f (%d batches in %.1fs%s)", step, eval_loss, len(batches.eval_batches),
                 eval_seconds, ", the first compiling the eval step" if first else "")
        return eval_loss, eval_seconds

    def _first_step(self, trainer: tunix_trainer.LoraPeftTrainer, micro_batches: list[dict[str, jax.Array]], step: int) -> int:
        """Run the step that compiles the train step; log its time and the compiled program's memory.
        Returns its tokens (left out of tokens/s)."""
        start = time.perf_counter()
        trainer.train(micro_batches)
        tokens = tunix_trainer.weighted_loss(trainer.train_aux[-len(micro_batches):])[2]  # waits for the step
        log.info("step %d compiled the train step and ran in %.1fs (left out of tokens/s, step time and ETA)",
                 step + 1, time.perf_counter() - start)
        memory = tunix_trainer.compiled_memory(trainer, micro_batches[0])
        if memory is not None:
            log.info("train step memory per device: %s", memory)
        return tokens

    def _result(self, step: int, *, final_loss: float | None = None, eval_loss: float | None = None) -> TrainResult:
        return TrainResult(
            final_step=step,
            checkpoint_root=self.root,
            metrics_path=storage.join(self.cfg.output.uri, "metrics.jsonl"),
            final_loss=final_loss,
            eval_loss=eval_loss,
        )

    @staticmethod
    def _evaluate(trainer: tunix_trainer.LoraPeftTrainer, eval_ds: Iterable[dict[str, jax.Array]]) -> float:
        """One pass over the eval set with Tunix's eval step; token-weighted mean loss."""
        trainer.eval_aux.clear()
        trainer.train([], eval_ds=eval_ds)
        loss, _, _ = tunix_trainer.weighted_loss(trainer.eval_aux)
        trainer.eval_aux.clear()
        return loss
