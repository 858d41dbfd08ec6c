"""`lora-trainer train`: load the base, apply LoRA, train with Tunix's PeftTrainer, checkpoint, resume.

How the pieces fit, and why:
  - Tunix `PeftTrainer` runs every optimizer step (its jitted train step differentiates only
    the `nnx.LoRAParam`s; gradient accumulation is its `optax.MultiSteps`). Its own
    checkpointing is switched off (`checkpoint_root_directory=None`): its layout
    (`model_params`/`optimizer_state`, batches skipped by counting) is not the format other
    components read (docs/dev/contracts.md), and it cannot store the data position or the
    adapter metadata. So this module drives Orbax around the trainer, one step at a time:
    `trainer.train([micro-batches of one step])` returns at a step boundary, where the loop
    checkpoints, logs, evaluates, or stops on SIGTERM.
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
import signal
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.interpreters import pxla
from tunix.sft import peft_trainer

from lora_trainer import checkpoint, data, distributed, host_memory, schedule, storage
from lora_trainer import metrics as mfu_metrics
from lora_trainer.config import TrainConfig, TrainingSpec
from lora_trainer.cross_entropy import token_nll
from lora_trainer.errors import Interrupted, RetriableError, TrainerError, UserError
from lora_trainer.lora import apply_lora, lora_state, resolve_target_regex, set_lora_state
from lora_trainer.lora_provider import no_lora_dropout
from lora_trainer.models import load_model
from lora_trainer.progress import IntervalTimer, ProgressCallback, ProgressSink, progress_record

log = logging.getLogger(__name__)

_REPLICATED = jax.sharding.PartitionSpec()
#: How every batch array is split: its rows over the mesh's data and fsdp axes together.
_BATCH = jax.sharding.PartitionSpec(("data", "fsdp"))

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


# --------------------------------------------------------------------------- loss and inputs


def model_inputs(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Batch -> loss-fn kwargs: a causal mask that never crosses packed examples or padding (segment 0)."""
    seg = batch["segment_ids"]
    length = seg.shape[1]
    causal = jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)
    return {
        "input_tokens": batch["input_tokens"],
        "input_mask": batch["input_mask"],
        "segment_ids": seg,
        "positions": batch["positions"],
        "attention_mask": causal[None] & same,
        **({"loss_norm": batch["loss_norm"]} if "loss_norm" in batch else {}),
    }


def lm_loss(
    model: nnx.Module,
    input_tokens: jax.Array,
    input_mask: jax.Array,
    segment_ids: jax.Array,
    positions: jax.Array,
    attention_mask: jax.Array,
    loss_norm: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean next-token cross-entropy over loss-masked targets (float32), plus token counts for progress.

    The value differentiated is the summed loss over `loss_norm` (each row holds the same value;
    see `data.BatchStream`) when the batch has one, so that accumulated micro-batches weigh every
    token of the optimizer step alike; the aux `loss` is always this batch's own mean.

    A target counts only if it is in the loss mask and in the same packed example as the
    token predicting it. Every position's logits are used as they come (the last position,
    which predicts nothing, gets weight 0): slicing `logits[:, :-1]` would copy the
    [batch, seq, vocab] tensor forward and pad its gradient back, the two largest
    non-matmul costs of a step on the benchmark model.
    """
    logits, _ = model(input_tokens, positions, None, attention_mask)
    targets = jnp.roll(input_tokens, -1, axis=1)
    weight = (input_mask[:, 1:] > 0) & (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] > 0)
    weight = jnp.pad(weight, ((0, 0), (0, 1))).astype(jnp.float32)
    nll = token_nll(logits, targets)  # float32, from the logits in their own dtype (see cross_entropy)
    n = weight.sum()
    total = (nll * weight).sum()
    loss = total / jnp.maximum(n, 1.0)
    objective = loss if loss_norm is None else total / jnp.max(loss_norm)
    return objective, {"loss": loss, "target_tokens": n, "tokens": (segment_ids > 0).sum()}


class LoraPeftTrainer(peft_trainer.PeftTrainer):
    """Tunix's PeftTrainer, keeping each micro-step's loss and token counts (the loss fn's aux)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.train_aux: list[dict[str, jax.Array]] = []
        self.eval_aux: list[dict[str, jax.Array]] = []
        self.is_managed_externally = True  # this module owns the step count, checkpoints and stopping

    def _post_process_train_step(self, aux: Any) -> None:
        self.train_aux.append(aux)

    def _shard_optimizer(self, mesh: jax.sharding.Mesh) -> None:
        """Tunix's optimizer placement, then every replicated model/optimizer array on the mesh's `P()`.

        Called once, just before the train step is first jitted (after any resume/restore). The
        jitted step returns replicated arrays as `NamedSharding(mesh, P())`, while loading, Qwix
        and the optimizer's init leave some as `P(None, None, None)` or on a `SingleDeviceSharding`
        (e.g. the step counts): without this the step compiles a second time on its second call.
        Values are not touched (a placement only), so resumed runs stay bitwise identical.
        """
        super()._shard_optimizer(mesh)
        if not mesh.empty:
            for obj in (self.model, self.optimizer):
                nnx.update(obj, jax.tree.map(functools.partial(_replicated_on, mesh), nnx.state(obj)))

    def jit_train_and_eval_step(self, skip_jit: bool = False, cache_nnx_graph: bool = False) -> tuple[Any, Any]:
        """Tunix's jitted steps, with the model donated to both (Tunix donates only the optimizer).

        Why: `nnx.jit` returns the state of every graph node it is given, frozen base weights
        included, and XLA can alias an output to an input only if that input is donated; so every
        train and eval step wrote a fresh copy of the whole base model. On a Qwen2.5-0.5B-shaped
        model on CPU: 7.4 GB of host memory instead of 3.1 GB after a few steps and an eval pass,
        and a 4.1 s train step instead of 1.8 s (docs/benchmarks.md). Donated, the unchanged
        weights are their own inputs; `nnx.jit` puts the returned arrays back into the model.
        """
        if skip_jit or self._jitted_train_step_fn is not None:
            return super().jit_train_and_eval_step(skip_jit, cache_nnx_graph)
        self._shard_optimizer(pxla.thread_resources.env.physical_mesh)  # as Tunix does, before the first jit
        train_step = nnx.jit(self.create_train_step_fn(), donate_argnames=("model", "optimizer"))
        eval_step = nnx.jit(self.create_eval_step_fn(), donate_argnames=("model",))

        def bind(f: Any, *args: Any) -> functools.partial:  # as Tunix binds them: its train() reads `.func.jitted_fn`
            return functools.partial(nnx.cached_partial(f, *args)) if cache_nnx_graph else functools.partial(f, *args)

        self._jitted_train_step_fn = bind(train_step, self.model, self.optimizer)
        self._jitted_eval_step_fn = bind(eval_step, self.model)
        return self._jitted_train_step_fn, self._jitted_eval_step_fn

    def _eval_step(self, model: nnx.Module, inputs: Any) -> Any:
        """Tunix's eval step, traced without LoRA dropout so eval loss is deterministic."""
        with no_lora_dropout():
            return super()._eval_step(model, inputs)

    def _post_process_eval_step(self, aux: Any) -> None:
        self.eval_aux.append(aux)


def _replicated_on(mesh: jax.sharding.Mesh, x: Any) -> Any:
    """`x` placed as `NamedSharding(mesh, P())` if it is a fully replicated array not already so placed."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(x, jax.Array) or sharding is None or not sharding.is_fully_replicated:
        return x
    named = isinstance(sharding, jax.sharding.NamedSharding)
    if named and sharding.mesh == mesh and sharding.spec == _REPLICATED:
        return x
    target = jax.sharding.NamedSharding(mesh, _REPLICATED)
    if not named and not target.is_fully_addressable:
        return x  # a one-device array onto a multi-process mesh: leave it to jit (a second compile, not an error)
    return jax.device_put(x, target)


def make_trainer(model: nnx.Module, t: TrainingSpec) -> LoraPeftTrainer:
    """Tunix's PeftTrainer for `model` (which must hold LoRAParams) with AdamW + schedule, our loss and inputs.

    Batches are sharded over the mesh's (data, fsdp) axes together; Tunix's own checkpointing is off.
    The steps take the model's arrays (donated, see `LoraPeftTrainer.jit_train_and_eval_step`): once
    it has trained, a model sharing them, such as the one `apply_lora` was given, cannot run again.
    """
    if not jax.tree.leaves(nnx.state(model, nnx.LoRAParam)):
        raise UserError("the model has no LoRA parameters; refusing to train (the trainer would update every base weight)")
    trainer = LoraPeftTrainer(
        model,
        schedule.optimizer(t),
        peft_trainer.TrainingConfig(
            eval_every_n_steps=t.eval_every or t.steps,
            max_steps=None,
            gradient_accumulation_steps=t.gradient_accumulation if t.gradient_accumulation > 1 else None,
            checkpoint_root_directory=None,
            data_sharding_axis=tuple(_BATCH),
            pbar_description=None,
        ),
    )
    trainer.with_loss_fn(lm_loss, has_aux=True).with_gen_model_input_fn(model_inputs)
    return trainer


def on_mesh(batch: dict[str, np.ndarray], mesh: jax.sharding.Mesh) -> dict[str, jax.Array]:
    """A global batch (every host holds all of it) as global arrays, rows split over the mesh's
    (data, fsdp) axes: each host places only the rows its own devices hold.

    Tunix shards a per-host batch itself, deciding by the host's *local* shape: with several
    hosts, a micro-batch whose rows per host did not divide data x fsdp (2 hosts x 4 chips, 8
    rows) was declared replicated, and where the mesh did not split rows across hosts (tensor
    parallelism spanning them) each host's share was taken for the whole batch: every host trained
    on other rows, silently. Arrays already on the mesh with this sharding pass Tunix untouched.
    """
    sharding = jax.sharding.NamedSharding(mesh, _BATCH)
    return {k: jax.make_array_from_callback(v.shape, sharding, lambda index, v=v: v[index]) for k, v in batch.items()}


def _weighted_loss(aux: list[dict[str, jax.Array]]) -> tuple[float, int, int]:
    """(token-weighted mean loss, loss tokens, tokens) over micro-steps; blocks on the device."""
    host = jax.device_get(aux)
    n = sum(float(a["target_tokens"]) for a in host)
    loss = sum(float(a["loss"]) * float(a["target_tokens"]) for a in host) / max(n, 1.0)
    return loss, int(n), sum(int(a["tokens"]) for a in host)


# --------------------------------------------------------------------------- state <-> checkpoint


def _flat(state: nnx.State) -> dict[str, jax.Array]:
    """A flat `{"a/b/0/c": array}` view of an NNX state: string keys only, so Orbax stores any optimizer."""
    out = {}
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
            value = jax.random.key_data(value)
        out["/".join(map(str, path))] = value
    return out


def _load_flat(module: nnx.Module, which: Any, flat: dict[str, Any]) -> None:
    """Write a `_flat` dict back into `module`'s variables selected by `which` (same paths required)."""
    state = nnx.state(module, which)
    for path, var in nnx.to_flat_state(state):
        key = "/".join(map(str, path))
        old = var.get_value()
        new = flat[key]
        if jnp.issubdtype(old.dtype, jax.dtypes.prng_key):
            new = jax.random.wrap_key_data(new, impl=jax.random.key_impl(old))
        var.set_value(new)
    nnx.update(module, state)


def _train_state(trainer: LoraPeftTrainer) -> dict[str, Any]:
    """The `optimizer` item: optax state (with its step count) and the model's RNG state (dropout)."""
    return {
        "opt": _flat(nnx.state(trainer.optimizer)),
        "rng": _flat(nnx.state(trainer.model, nnx.RngState)),
    }


def _restore_train_state(trainer: LoraPeftTrainer, saved: dict[str, Any]) -> None:
    _load_flat(trainer.optimizer, ..., saved["opt"])
    _load_flat(trainer.model, nnx.RngState, saved["rng"])


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


def _count(model: nnx.Module, kind: Any = nnx.Param) -> str:
    """How many parameters of `kind` the model holds, for a log line: `494.0M`, `1.24B`."""
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, kind)))
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


# --------------------------------------------------------------------------- signals


class _StopRequest:
    """Set by SIGTERM (preemption, pod deletion), or by Ctrl-C when `interruptible` (the local mode);
    checked at step boundaries by every process."""

    def __init__(self, *, interruptible: bool = False) -> None:
        self._event = threading.Event()
        self._interruptible = interruptible
        self.interrupted = False

    def _on_interrupt(self, *_: Any) -> None:
        """The first Ctrl-C stops at the next step boundary, once a checkpoint is saved (a Ctrl-C in
        the middle of a save printed dozens of tracebacks from Orbax's threads); a second one quits."""
        if self.interrupted:
            raise KeyboardInterrupt
        self.interrupted = True
        self._event.set()
        log.warning("interrupted: stopping after this step to save a checkpoint (Ctrl-C again to quit at once)")

    @contextlib.contextmanager
    def installed(self) -> Iterator[_StopRequest]:
        if threading.current_thread() is not threading.main_thread():
            yield self  # signal handlers can only be set from the main thread (e.g. a test harness thread)
            return
        previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, lambda *_: self._event.set())}
        if self._interruptible:
            previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_interrupt)
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def error(self, step: int, root: str) -> TrainerError:
        """What stopping at `step` (its checkpoint committed, if any) is reported as."""
        if self.interrupted:
            if not step:
                return Interrupted("interrupted before the first step; nothing was saved")
            return Interrupted(f"interrupted: checkpoint step {step} is saved in {root}; run the same command again to resume from there")
        if not step:
            return RetriableError("received SIGTERM before the first step; no checkpoint to save, exiting")
        return RetriableError(
            f"received SIGTERM: checkpoint step {step} is saved in {root}; exiting so the JobSet "
            "restarts and the run resumes from there"
        )

    def requested(self) -> bool:
        """True on every process if any process got SIGTERM (so all stop at the same step)."""
        flag = self._event.is_set()
        if jax.process_count() == 1:
            return flag
        from jax.experimental import multihost_utils

        return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


# --------------------------------------------------------------------------- the run


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever `sys.stderr` is at emit time (test harnesses and the local mode swap it)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def _configure_logging() -> None:
    """Trainer logs to stderr (stdout carries only the JSON progress lines)."""
    logger = logging.getLogger("lora_trainer")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        logger.addHandler(_StderrHandler())
    logger.setLevel(logging.INFO)
    logger.propagate = False  # libraries (absl, Tunix) may configure the root logger; print once


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


def _seq_len(seqs: list[data.Sequence], max_seq_len: int) -> int:
    """Pad every batch to one length (one compilation): the longest sequence, rounded up to 8, capped."""
    longest = max(len(s.tokens) for s in seqs)
    return min(max_seq_len, -(-longest // 8) * 8)


def _flops_per_token(model: nnx.Module, hf_config: dict[str, Any], seq_len: int) -> float:
    base = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))))
    lora = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
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

    Raises UserError for bad input and RetriableError after a SIGTERM (checkpoint committed)
    or a storage outage; the CLI maps them to exit codes 3 and 42. With `interruptible` (the
    local mode), Ctrl-C is handled as SIGTERM is and raises Interrupted (130).
    """
    host_memory.retain_freed_memory()  # before JAX's thread pools start (see host_memory)
    _configure_logging()
    distributed.initialize()
    mesh = distributed.make_mesh(cfg.training.mesh)
    with _StopRequest(interruptible=interruptible).installed() as stop, warnings.catch_warnings():
        # Tunix 0.1.7 finds the mesh through the legacy `with mesh:` context (pxla.thread_resources).
        warnings.filterwarnings("ignore", category=DeprecationWarning, message=".*mesh.*")
        with mesh:
            return _Run(cfg, mesh, stop, on_progress).run()


class _Run:
    """One training run's state; `run()` reads top to bottom as the steps of a run."""

    def __init__(self, cfg: TrainConfig, mesh: jax.sharding.Mesh, stop: _StopRequest, on_progress: ProgressCallback | None):
        self.cfg = cfg
        self.mesh = mesh
        self.stop = stop
        self.on_progress = on_progress
        self.root = checkpoint.checkpoint_root(cfg.output.uri)
        self.primary = jax.process_index() == 0

    def run(self) -> TrainResult:
        cfg, t = self.cfg, self.cfg.training
        storage.check_output_location(cfg.output.uri, "output.uri")  # before minutes of loading
        start = time.perf_counter()
        loaded = load_model(cfg.model.source, family=cfg.model.family, dtype=cfg.model.dtype, mesh=self.mesh)
        log.info("loaded the %s model %s (%s parameters, %s) in %.1fs", loaded.family.name, cfg.model.source,
                 _count(loaded.model), cfg.model.dtype, time.perf_counter() - start)
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
        resume_step = checkpoint.latest_committed_step(self.root)
        if resume_step is not None:
            self._check_compatible(resume_step)
            if resume_step >= t.steps:
                log.info("training already finished at step %d (training.steps=%d); nothing to do", resume_step, t.steps)
                return self._result(resume_step)

        micro = t.global_batch_size // t.gradient_accumulation
        data_ways = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        if micro % data_ways:
            raise UserError(
                f"each micro-batch has {micro} rows (training.globalBatchSize / gradientAccumulation) but the mesh "
                f"splits batches {data_ways} ways (data x fsdp); make the micro-batch a multiple of {data_ways}"
            )
        tokenizer = data.load_tokenizer(loaded.local_dir)
        pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
        train_seqs = data.to_sequences(data.tokenize_file(cfg.dataset.train, cfg.dataset, tokenizer), cfg.dataset)
        seq_len = _seq_len(train_seqs, cfg.dataset.max_seq_len)
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
            train_seqs,
            global_batch=micro,
            seq_len=seq_len,
            seed=t.seed,
            pad_id=pad_id,
            accumulation=t.gradient_accumulation,
        )
        eval_ds = None
        if cfg.dataset.eval is not None:
            eval_seqs = data.to_sequences(data.tokenize_file(cfg.dataset.eval, cfg.dataset, tokenizer), cfg.dataset)
            eval_ds = data.eval_batches(
                eval_seqs,
                global_batch=micro,
                seq_len=_seq_len(eval_seqs, cfg.dataset.max_seq_len),  # its own: an eval example may be longer
                pad_id=pad_id,
            )

        restored = None
        if resume_step is None and cfg.lora.restore_from:
            restored = _restore_adapter(cfg.lora.restore_from, cfg.model.source, loaded.family.name)
            _check_restored(cfg, restored[1])
        start = time.perf_counter()
        applied = apply_lora(loaded.model, cfg.lora, loaded.family, seed=t.seed, batch_shape=(1, 8))
        quant = cfg.lora.quantization
        log.info("added LoRA (%s trainable parameters)%s in %.1fs", _count(applied.model, nnx.LoRAParam),
                 f" and quantized the base weights to {quant.weight_qtype}" if quant else "", time.perf_counter() - start)
        self.metadata["modulePaths"] = applied.module_paths
        if restored is not None:
            set_lora_state(applied.model, restored[0])  # module or shape mismatches are a UserError listing them
            log.info("starting from the adapter in %s", cfg.lora.restore_from)

        trainer = make_trainer(applied.model, t)

        store = checkpoint.TrainingCheckpoints(self.root, keep=t.checkpoints_to_keep)
        step = 0
        if resume_step is not None:
            lora, opt, position, _ = store.restore(
                resume_step, lora_target=lora_state(trainer.model), optimizer_target=_train_state(trainer)
            )
            set_lora_state(trainer.model, lora)
            _restore_train_state(trainer, opt)
            stream.restore(position)
            step = resume_step
            log.info("resuming from step %d (checkpoint %s)", step, checkpoint.step_uri(self.root, step))

        sink = ProgressSink(cfg.output.uri, primary=self.primary, resume_step=step, on_progress=self.on_progress)
        try:
            result = self._loop(trainer, stream, eval_ds, store, sink, step, loaded.hf_config, seq_len)
        except BaseException:
            # No flush after a fault: in a storage outage it would wait out the retry deadline again
            # and replace the error; the steps since the last checkpoint are redone on resume anyway.
            sink.close(flush=False)
            store.close()
            raise
        sink.close()
        store.close()
        return result

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
        trainer: LoraPeftTrainer,
        stream: data.BatchStream,
        eval_ds: list[dict[str, np.ndarray]] | None,
        store: checkpoint.TrainingCheckpoints,
        sink: ProgressSink,
        step: int,
        hf_config: dict[str, Any],
        seq_len: int,
    ) -> TrainResult:
        t = self.cfg.training
        lr = schedule.learning_rate_schedule(t)
        flops_per_token = _flops_per_token(trainer.model, hf_config, seq_len)
        kinds = [d.device_kind for d in jax.devices()]
        saved_step = step
        last_checkpoint = checkpoint.step_uri(self.root, step) if step else None
        loss = eval_loss = None
        # The first step in a process compiles the train step (seconds to minutes): it stays out of
        # the timed interval, or the first line's tokens/s and ETA were off by that much.
        timer, timed_steps, untimed_tokens, compiled = IntervalTimer(time.perf_counter), 0, 0, False
        eval_seconds = 0.0  # the last eval pass's duration, for the ETA (unknown, 0, until one ran)

        def save(at: int) -> None:
            nonlocal saved_step, last_checkpoint
            store.save(at, lora=lora_state(trainer.model), optimizer=_train_state(trainer), data=stream.state(), metadata=self.metadata)
            store.wait()
            saved_step, last_checkpoint = at, checkpoint.step_uri(self.root, at)
            sink.checkpointed(last_checkpoint)
            sink.flush()

        while step < t.steps:
            if self.stop.requested():
                if saved_step != step:
                    save(step)
                raise self.stop.error(step, self.root)
            micro_batches = [on_mesh(next(stream), self.mesh) for _ in range(t.gradient_accumulation)]
            if compiled:
                trainer.train(micro_batches)
                timed_steps += 1
            else:
                with timer.paused():
                    start = time.perf_counter()
                    trainer.train(micro_batches)
                    untimed_tokens = _weighted_loss(trainer.train_aux[-t.gradient_accumulation :])[2]  # waits for the step
                    log.info("step %d compiled the train step and ran in %.1fs (left out of tokens/s, step time and ETA)",
                             step + 1, time.perf_counter() - start)
                compiled = True
            step += 1
            if step % t.log_every == 0 or step == t.steps:
                loss, _, tokens = _weighted_loss(trainer.train_aux)
                trainer.train_aux.clear()
                elapsed = timer.lap()
                tps = (tokens - untimed_tokens) / elapsed if timed_steps else None
                record = progress_record(
                    step=step,
                    total_steps=t.steps,
                    loss=loss,
                    learning_rate=float(lr(step - 1)),
                    tokens_per_second=tps,
                    step_time_seconds=elapsed / timed_steps if timed_steps else None,
                    mfu=None if tps is None else mfu_metrics.mfu(tps, flops_per_token, kinds),
                    last_checkpoint=last_checkpoint,
                    pending_seconds=eval_seconds * evals_due(step, t),
                )
                sink.emit(record)
                timed_steps, untimed_tokens = 0, 0
            with timer.paused():
                # After a SIGTERM the checkpoint comes first: an eval pass could outlast the grace period.
                due = evals_due(step - 1, t) > evals_due(step, t)  # a pass runs at this step
                if eval_ds and due and not self.stop.requested():
                    first, start = not eval_seconds, time.perf_counter()
                    eval_loss = self._evaluate(trainer, (on_mesh(b, self.mesh) for b in eval_ds))
                    eval_seconds = time.perf_counter() - start
                    sink.scalar("eval/loss", eval_loss, step)
                    log.info("step %d: eval loss %.4f (%d batches in %.1fs%s)", step, eval_loss, len(eval_ds), eval_seconds,
                             ", the first compiling the eval step" if first else "")
                if step % t.checkpoint_every == 0 or step == t.steps:
                    save(step)
        if saved_step != step:
            save(step)
        return self._result(step, final_loss=loss, eval_loss=eval_loss)

    def _result(self, step: int, *, final_loss: float | None = None, eval_loss: float | None = None) -> TrainResult:
        return TrainResult(
            final_step=step,
            checkpoint_root=self.root,
            metrics_path=storage.join(self.cfg.output.uri, "metrics.jsonl"),
            final_loss=final_loss,
            eval_loss=eval_loss,
        )

    @staticmethod
    def _evaluate(trainer: LoraPeftTrainer, eval_ds: Iterable[dict[str, jax.Array]]) -> float:
        """One pass over the eval set with Tunix's eval step; token-weighted mean loss."""
        trainer.eval_aux.clear()
        trainer.train([], eval_ds=eval_ds)
        loss, _, _ = _weighted_loss(trainer.eval_aux)
        trainer.eval_aux.clear()
        return loss
