"""`lora-operator run-local -f CR.yaml`: run a LoraFinetune on this machine, no cluster.

The same spec the operator reads, the same train config it ships in the ConfigMap
(`spec.train_config()`), the same trainer entry point (`lora_trainer.train.run_training`,
in-process on the CPU or the one local accelerator) and the same post-job export the export
Job runs (`export_checkpoint` to `<output>/hf-adapter`, and `<output>/merged` when asked).
Cluster-only fields (TPU, image, queue, ...) are reported once and ignored.

What a person sees: a live progress bar while it trains (plain lines when stdout is not a
terminal), then the status table `kubectl get lorafinetunes` would print, the adapter path and a
loss curve (`loss.png` next to `metrics.jsonl`). Any failure is one paragraph on stderr and a
non-zero exit code from `lora_trainer.exit_codes`.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import yaml
from pydantic import ValidationError

from lora_operator.api import API_VERSION, LoraFinetuneSpec, Phase
from lora_operator.crdgen import lora_finetune_crd
from lora_operator.run_progress import progress_status
from lora_operator.render import InvalidSpec, check_jobset_name, output_uris
from lora_trainer import exit_codes, storage
from lora_trainer.config import TrainConfig, did_you_mean, validation_problems, yaml_problem
from lora_trainer.errors import TrainerError, UserError, device_oom_message
from lora_trainer.progress_record import ProgressRecord

_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*://")
#: Spec fields that only mean something on a cluster (everything the spec adds to TrainConfig).
CLUSTER_ONLY_FIELDS = tuple(f for f in LoraFinetuneSpec.model_fields if f not in TrainConfig.model_fields)


class ManifestError(UserError):
    """The manifest file cannot be run; the message names the file, the field and the fix."""


# --- the manifest -------------------------------------------------------------------------


def load_manifest(path: Path) -> tuple[str, LoraFinetuneSpec]:
    """The LoraFinetune's name and validated spec from a YAML file holding exactly one of them."""
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]
    except UnicodeDecodeError as e:
        raise ManifestError(f"{path}: not UTF-8 text (byte {e.start + 1}); save the manifest as UTF-8") from e
    except OSError as e:
        raise ManifestError(f"{path}: cannot read the manifest ({e.strerror}); pass an existing LoraFinetune YAML with -f") from e
    except yaml.YAMLError as e:
        raise ManifestError(f"{path}: not valid YAML{yaml_problem(e)}; fix the syntax") from e
    objs = [d for d in docs if isinstance(d, dict) and d.get("kind") == "LoraFinetune"]
    if len(objs) != 1:
        kinds = [d.get("kind") if isinstance(d, dict) else type(d).__name__ for d in docs]
        raise ManifestError(f"{path}: expected exactly one LoraFinetune, found kinds {kinds}; run-local runs one LoraFinetune per file")
    obj = objs[0]
    if obj.get("apiVersion") != API_VERSION:
        raise ManifestError(f"{path}: apiVersion is {obj.get('apiVersion')!r}; set it to {API_VERSION!r}")
    unknown = sorted(set(obj) - {"apiVersion", "kind", "metadata", "spec", "status"})
    if unknown:  # kubectl refuses them too; a misspelt `spec:` left only "spec.model: Field required"
        raise ManifestError(
            f"{path}: unknown top-level field {unknown[0]!r}{did_you_mean(unknown[0], ['metadata', 'spec'])}; "
            "a LoraFinetune has apiVersion, kind, metadata and spec"
        )
    metadata = obj.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise ManifestError(f"{path}: metadata must be a mapping such as `metadata: {{name: my-run}}`, got {metadata!r}")
    if metadata.get("name") is not None:
        try:  # the cluster's rule, so a name that runs here is one `kubectl apply` takes
            check_jobset_name(str(metadata["name"]))
        except InvalidSpec as e:
            raise ManifestError(f"{path}: {e}") from e
    name = str(metadata.get("name") or path.stem)
    try:
        spec = LoraFinetuneSpec.model_validate(obj.get("spec") or {})
    except ValidationError as e:
        problems = validation_problems(e, "spec.")
        raise ManifestError(f"{path}: invalid LoraFinetune {name!r}: {problems}") from e
    return name, spec


def cluster_only_fields_set(spec: LoraFinetuneSpec) -> list[str]:
    """camelCase names of the cluster-only fields the manifest sets (they are ignored locally)."""
    aliases = {f: LoraFinetuneSpec.model_fields[f].alias or f for f in CLUSTER_ONLY_FIELDS}
    return [aliases[f] for f in CLUSTER_ONLY_FIELDS if f in spec.model_fields_set]


def _resolve(uri: str, base: Path) -> str:
    """A scheme-less relative path resolved against `base`; URIs and absolute paths unchanged."""
    if _SCHEME.match(uri) or Path(uri).is_absolute():
        return uri
    return str((base / uri).resolve())


def resolve_local_paths(spec: LoraFinetuneSpec, base: Path, output: str | None = None) -> LoraFinetuneSpec:
    """Relative paths in the spec resolved against the manifest's directory (`base`), and the
    output replaced by `output` (a CLI argument, so relative to the working directory)."""
    wire = spec.model_dump(by_alias=True, exclude_none=True, mode="json")
    wire["model"]["source"] = _resolve(wire["model"]["source"], base)
    for key in ("train", "eval"):
        if key in wire["dataset"]:
            wire["dataset"][key] = _resolve(wire["dataset"][key], base)
    if "restoreFrom" in wire.get("lora", {}):
        wire["lora"]["restoreFrom"] = _resolve(wire["lora"]["restoreFrom"], base)
    wire["output"]["uri"] = _resolve(output, Path.cwd()) if output else _resolve(wire["output"]["uri"], base)
    cache = wire.get("training", {}).get("compilationCache", {})
    if "uri" in cache:
        cache["uri"] = _resolve(cache["uri"], base)
    try:
        return LoraFinetuneSpec.model_validate(wire)
    except ValidationError as e:
        problems = validation_problems(e, "spec.")
        raise ManifestError(
            f"after resolving local paths against {base}{f' and --output {output!r}' if output else ''}: {problems}; "
            "use paths without spaces or colons, or a gs:// URI"
        ) from e


# --- what the terminal shows ---------------------------------------------------------------


def display_path(uri: str) -> str:
    """A local path under the working directory shown relative to it (shorter); anything else as is."""
    if _SCHEME.match(uri):
        return uri
    try:
        return str(Path(uri).resolve().relative_to(Path.cwd()))
    except ValueError:
        return uri


def human_duration(seconds: float) -> str:
    """A duration as kubectl prints AGE (k8s.io/apimachinery duration.HumanDuration)."""
    s = max(int(seconds), 0)
    if s < 120:
        return f"{s}s"
    m, h, d = s // 60, s // 3600, s // 86400
    if m < 10:
        return f"{m}m{s % 60}s" if s % 60 else f"{m}m"
    if m < 180:
        return f"{m}m"
    if h < 8:
        return f"{h}h{m % 60}m" if m % 60 else f"{h}h"
    if h < 48:
        return f"{h}h"
    if h < 24 * 8:
        return f"{d}d{h % 24}h" if h % 24 else f"{d}d"
    if d < 365 * 2:
        return f"{d}d"
    if d < 365 * 8:
        return f"{d // 365}y{d % 365}d" if d % 365 else f"{d // 365}y"
    return f"{d // 365}y"


def _eta(record: ProgressRecord) -> str:
    if record.eta is not None:
        return record.eta
    if record.eta_seconds is not None:
        return human_duration(record.eta_seconds)
    return "?"


def _tokens_per_second(record: ProgressRecord) -> str:
    tps = record.tokens_per_second
    if tps is None:
        return "? tok/s"
    return f"{tps / 1000:.1f}k tok/s" if tps >= 1000 else f"{tps:.0f} tok/s"


def progress_line(record: ProgressRecord | dict[str, Any], *, bar_width: int = 0) -> str:
    """One progress record as text: `[####....] 120/300  loss 2.3456  1.2k tok/s  ETA 35s`
    (the bar only when bar_width > 0)."""
    rec = record if isinstance(record, ProgressRecord) else ProgressRecord.parse(record) or ProgressRecord()
    step, total = rec.step or 0, max(rec.total_steps or 0, 1)
    loss = rec.loss
    text = f"step {step}/{total}  loss {loss:.4f}" if loss is not None else f"step {step}/{total}  loss ?"
    if rec.untimed():
        text += "  (compiled the train step; timing from the next step)"  # the trainer leaves this step untimed
    else:
        text += f"  {_tokens_per_second(rec)}  ETA {_eta(rec)}"
    if bar_width > 0:
        done = min(bar_width, bar_width * step // total)
        text = f"[{'#' * done}{'.' * (bar_width - done)}] {100 * step // total:3d}%  {text}"
    return text


class ProgressView:
    """Shows trainer progress records: a bar redrawn in place on a terminal, else one line each."""

    def __init__(self, out: TextIO, *, live: bool) -> None:
        self.out = out
        self.live = live
        self.line = ""
        self.printed = ""

    def __call__(self, record: dict[str, Any]) -> None:
        if self.live:
            width = shutil.get_terminal_size((100, 20)).columns
            self.line = progress_line(record, bar_width=max(10, min(30, width - 70)))[: width - 1].ljust(width - 1)
            self.out.write("\r" + self.line)
        else:
            text = progress_line(record)
            if text == self.printed:  # the same step again, now naming its checkpoint: nothing new to show
                return
            self.printed = text
            self.out.write(text + "\n")
        self.out.flush()

    def clear(self) -> None:
        """Blank the bar's line (before a log line is printed on the same terminal)."""
        if self.line:
            self.out.write("\r" + " " * len(self.line) + "\r")
            self.out.flush()

    def redraw(self) -> None:
        if self.line:
            self.out.write("\r" + self.line)
            self.out.flush()

    def close(self) -> None:
        """End the in-place line so what follows starts on a fresh one."""
        if self.line:
            self.out.write("\n")
            self.out.flush()
            self.line = ""


class _AboveTheBar(io.TextIOBase):
    """A stderr that prints log lines above the live bar instead of through it."""

    def __init__(self, view: ProgressView, stream: TextIO) -> None:
        self.view = view
        self.stream = stream

    def write(self, text: str) -> int:
        self.view.clear()
        n = self.stream.write(text)
        self.stream.flush()
        if text.endswith("\n"):
            self.view.redraw()
        return n

    def flush(self) -> None:
        self.stream.flush()


@contextlib.contextmanager
def _trainer_output(view: ProgressView) -> Iterator[None]:
    """While training: the trainer's JSON progress lines on stdout are replaced by the view
    (they reach it through `on_progress`), and its stderr logs print above a live bar."""
    stderr = _AboveTheBar(view, sys.stderr) if view.live else sys.stderr
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull), contextlib.redirect_stderr(stderr):
        yield


def _json_path(obj: dict[str, Any], path: str) -> Any:
    node: Any = obj
    for part in path.strip(".").split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def status_table(obj: dict[str, Any], now: datetime) -> str:
    """`kubectl get lorafinetunes` for one object: NAME plus the CRD's default printer columns."""
    columns = [c for c in lora_finetune_crd()["spec"]["versions"][0]["additionalPrinterColumns"] if not c.get("priority")]
    header = ["NAME", *(c["name"].upper() for c in columns)]
    row = [obj["metadata"]["name"]]
    for c in columns:
        value = _json_path(obj, c["jsonPath"])
        if value is not None and c["type"] == "date":
            value = human_duration((now - datetime.fromisoformat(value)).total_seconds())
        row.append("<none>" if value is None else str(value))
    widths = [max(len(h), len(v)) for h, v in zip(header, row, strict=True)]
    lines = ["   ".join(x.ljust(w) for x, w in zip(cells, widths, strict=True)).rstrip() for cells in (header, row)]
    return "\n".join(lines)


# --- the loss curve -------------------------------------------------------------------------


def read_metrics(text: str) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (blank and malformed lines skipped: the file may be cut
    short by a kill, and a plot should still come out)."""
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _series(records: list[dict[str, Any]], *keys: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for r in records:
        value = next((r[k] for k in keys if isinstance(r.get(k), int | float)), None)
        if isinstance(r.get("step"), int) and value is not None:
            steps.append(r["step"])
            values.append(float(value))
    return steps, values


def loss_plot_png(records: list[dict[str, Any]], title: str) -> bytes:
    """A PNG of training loss (and eval loss when present) over steps."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    train = _series(records, "loss")
    if not train[0]:
        raise UserError("metrics.jsonl has no records with `step` and `loss`; nothing to plot")
    fig = Figure(figsize=(7, 4), dpi=100)
    ax = fig.subplots()
    # Markers while the points are few: a single record drew no line at all.
    ax.plot(*train, marker="o" if len(train[0]) < 20 else None, markersize=3, label="train loss", color="tab:blue")
    evaluation = _series(records, "eval/loss", "evalLoss")
    if evaluation[0]:
        ax.plot(*evaluation, "o-", label="eval loss", color="tab:orange")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


# --- the run ----------------------------------------------------------------------------------


def _device_summary() -> str:
    """What the TPU column shows locally: the JAX platform and device count, e.g. `local cpu x1`."""
    import jax

    devices = jax.devices()
    return f"local {devices[0].platform} x{len(devices)}"


def _say(message: str) -> None:
    print(f"run-local: {message}", flush=True)


def _export(checkpoint_root: str, uris: dict[str, str]) -> None:
    """The export Job's work (`lora-trainer export`), for each output the spec asks for."""
    from lora_trainer.adapters.export import export_checkpoint

    for key, uri in uris.items():
        _say(f"exporting {'the merged model' if key == 'merged' else 'the HF PEFT adapter'} to {display_path(uri)}")
        export_checkpoint(checkpoint_root, uri, merged=key == "merged")


def _plot(metrics_uri: str, records: list[dict[str, Any]], title: str) -> str:
    """Write loss.png next to metrics.jsonl; returns its URI."""
    plot_uri = storage.join(metrics_uri.rsplit("/", 1)[0], "loss.png")
    storage.write_bytes(plot_uri, loss_plot_png(records, title))
    return plot_uri


@contextlib.contextmanager
def _sole_run(output_uri: str) -> Iterator[None]:
    """Hold `<output>/.run-local.lock` while training and exporting: a second run-local on the same
    output refuses (two at once both reported Succeeded, each overwriting the other's checkpoints,
    metrics and adapter). gs:// outputs have no such lock; an output that cannot be written is
    left for the trainer to report."""
    if storage.is_gcs(output_uri):
        yield
        return
    storage.check_output_location(output_uri, "output.uri")  # the trainer's own first check, made earlier
    try:
        lock = (storage.absolute_local_path(output_uri) / ".run-local.lock").open("a+")
    except OSError:
        yield
        return
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            raise UserError(
                f"output {display_path(output_uri)} is in use by another run-local ({holder}): wait for it to finish, "
                "or give this run its own output (--output DIR or spec.output.uri)"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()}\n")
        lock.flush()
        yield


def _run(path: Path, output: str | None, view: ProgressView) -> tuple[dict[str, Any], str]:
    """Train, export and plot; returns the CR object as the operator would leave it and the
    list of output paths to print."""
    name, spec = load_manifest(path)
    ignored = cluster_only_fields_set(spec)
    if ignored:
        _say(f"ignoring cluster-only fields {', '.join(ignored)} (they apply when the operator runs this on Kubernetes)")
    spec = resolve_local_paths(spec, path.resolve().parent, output)
    cfg = spec.train_config()
    created = datetime.now(UTC).replace(microsecond=0)

    from lora_trainer import host_memory
    from lora_trainer.train import run_training

    host_memory.retain_freed_memory()  # as run_training does, but before _device_summary starts JAX's threads
    tpu = _device_summary()
    _say(
        f"training {name} on {tpu.removeprefix('local ')}: {cfg.training.steps} steps of "
        f"{display_path(cfg.model.source)}, output {display_path(cfg.output.uri)}"
    )
    last: dict[str, Any] = {}

    def on_progress(record: dict[str, Any]) -> None:
        last.update(record)
        view(record)

    with _sole_run(cfg.output.uri):
        try:
            with _trainer_output(view):
                result = run_training(cfg, on_progress=on_progress, interruptible=True)
        finally:
            view.close()
        uris = output_uris(spec)
        _export(str(result.checkpoint_root), uris)
    metrics_uri = str(result.metrics_path)
    records = read_metrics(storage.read_text(metrics_uri))
    plot_uri = _plot(metrics_uri, records, f"{name}: {cfg.model.source.rsplit('/', 1)[-1]}")
    if "loss" not in last:  # a rerun of a finished run reports nothing new: show the recorded end
        last = next((r for r in reversed(records) if {"loss", "total_steps"} <= ProgressRecord.model_validate(r).model_fields_set), {})

    status = {"phase": Phase.SUCCEEDED, "tpu": tpu, "restarts": 0, "preemptions": 0, **progress_status(last, cfg.training.steps)}
    status.update(step=result.final_step, progress=f"{result.final_step}/{cfg.training.steps}")
    obj = {"metadata": {"name": name, "creationTimestamp": created.isoformat()}, "spec": spec.to_wire(), "status": status}
    paths = {"adapter": uris.get("adapter"), "merged model": uris.get("merged"), "checkpoints": str(result.checkpoint_root),
             "metrics": metrics_uri, "loss curve": plot_uri}
    return obj, "\n".join(f"{label + ':':<14}{display_path(value)}" for label, value in paths.items() if value)


def run_local(path: Path, *, output: str | None, progress_bar: bool) -> int:
    """Run the LoraFinetune in `path` here; 0 on success, the trainer's exit code otherwise."""
    view = ProgressView(sys.stdout, live=progress_bar and sys.stdout.isatty())
    started = time.monotonic()
    try:
        obj, summary = _run(path, output, view)
    except TrainerError as e:
        view.close()
        print(f"lora-operator run-local: {e}", file=sys.stderr)
        return e.exit_code
    except MemoryError:
        view.close()
        print(
            "lora-operator run-local: out of host memory. Use a smaller training.globalBatchSize or "
            "dataset.maxSeqLen, or quantize the base model (lora.quantization).",
            file=sys.stderr,
        )
        return exit_codes.USER_ERROR
    except Exception as e:
        message = device_oom_message(e, "train")  # the same paragraph and exit code as `lora-trainer train`
        if message is None:
            raise
        view.close()
        print(f"lora-operator run-local: {message}", file=sys.stderr)
        return exit_codes.USER_ERROR
    except KeyboardInterrupt:
        view.close()
        print("lora-operator run-local: interrupted; checkpoints written so far are kept and a rerun resumes from the latest", file=sys.stderr)
        return 130
    print()
    print(status_table(obj, datetime.now(UTC)))
    print()
    print(summary)
    _say(f"done in {human_duration(time.monotonic() - started)}")
    return exit_codes.OK
