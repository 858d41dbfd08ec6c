"""run-local's pieces without training: manifest handling, path resolution, what the terminal shows."""

from __future__ import annotations

import io
import os
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml

from lora_operator import local
from lora_operator.cli import main as cli_main
from lora_trainer import exit_codes
from lora_trainer.errors import UserError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def write_manifest(tmp_path: Path, spec: dict, **top: object) -> Path:
    doc = {"apiVersion": "lora-operator.dev/v1alpha1", "kind": "LoraFinetune", "metadata": {"name": "t"}, "spec": spec, **top}
    path = tmp_path / "lft.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


MINIMAL = {"model": {"source": "m"}, "dataset": {"train": "d.jsonl"}, "output": {"uri": "out"}}


def test_demo_manifest_loads_and_names_its_cluster_only_fields() -> None:
    name, spec = local.load_manifest(EXAMPLES / "lora-finetune.yaml")
    assert name == "tiny-llama-demo"
    assert local.cluster_only_fields_set(spec) == ["tpu", "queueName", "maxRestarts"]
    assert set(local.CLUSTER_ONLY_FIELDS) >= {"tpu", "image", "queue_name", "service_account_name", "env", "resources"}


def test_relative_paths_resolve_against_the_manifest_and_output_against_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec_dict = {
        "model": {"source": "models/tiny"},
        "dataset": {"train": "data/train.jsonl", "eval": "gs://bucket/eval.jsonl"},
        "lora": {"restoreFrom": "/abs/adapter"},
        "output": {"uri": "out"},
    }
    _, spec = local.load_manifest(write_manifest(tmp_path, spec_dict))
    base = tmp_path / "manifests"
    resolved = local.resolve_local_paths(spec, base)
    assert resolved.model.source == str(base / "models" / "tiny")
    assert resolved.dataset.train == str(base / "data" / "train.jsonl")
    assert resolved.dataset.eval == "gs://bucket/eval.jsonl"
    assert resolved.lora.restore_from == "/abs/adapter"
    assert resolved.output.uri == str(base / "out")
    monkeypatch.chdir(tmp_path)
    assert local.resolve_local_paths(spec, base, "elsewhere").output.uri == str(tmp_path / "elsewhere")
    assert local.resolve_local_paths(spec, base, "gs://bkt/run").output.uri == "gs://bkt/run"
    with pytest.raises(local.ManifestError, match="--output 'gs://b/run'.*spec.output.uri"):
        local.resolve_local_paths(spec, base, "gs://b/run")  # bucket names have 3+ characters
    # The train config is the operator's, only with the paths changed.
    assert resolved.train_config().training == spec.train_config().training


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("kind: [unclosed", "not valid YAML"),
        ("apiVersion: v1\nkind: ConfigMap\n", "expected exactly one LoraFinetune"),
        ("apiVersion: lora-operator.dev/v1\nkind: LoraFinetune\nspec: {}\n", "apiVersion"),
        (
            "apiVersion: lora-operator.dev/v1alpha1\nkind: LoraFinetune\nmetadata: {name: x}\n"
            "spec: {model: {source: m}, dataset: {train: d}, output: {uri: o}, training: {steps: 0}}\n",
            "spec.training.steps",
        ),
        (
            "apiVersion: lora-operator.dev/v1alpha1\nkind: LoraFinetune\nmetadata: {name: x}\n"
            "spec: {model: {source: m}, dataset: {train: d}, output: {uri: o}, lora: {rnak: 8}}\n",
            "spec.lora.rnak",
        ),
    ],
)
def test_bad_manifest_is_one_paragraph_naming_the_field_and_a_user_error_exit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, needle: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    rc = cli_main(["run-local", "-f", str(path)])
    err = capsys.readouterr().err
    assert rc == exit_codes.USER_ERROR
    assert needle in err and str(path) in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_manifest_that_is_not_utf8_or_has_odd_metadata(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"apiVersion: lora-operator.dev/v1alpha1\nkind: LoraFinetune\nmetadata: {name: caf\xe9}\n")
    odd = write_manifest(tmp_path, MINIMAL, metadata="just-a-name")
    for path, needle in ((latin1, "not UTF-8 text"), (odd, "metadata must be a mapping")):
        assert cli_main(["run-local", "-f", str(path)]) == exit_codes.USER_ERROR
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err


def test_accelerator_oom_is_a_user_error_paragraph(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import jax

    def oom(*_args: object) -> None:
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 76032315012 bytes.")

    monkeypatch.setattr(local, "_run", oom)
    assert cli_main(["run-local", "-f", str(write_manifest(tmp_path, MINIMAL))]) == exit_codes.USER_ERROR
    err = capsys.readouterr().err
    assert err.startswith("lora-operator run-local: out of accelerator memory") and "training.globalBatchSize" in err
    assert err.count("\n") == 1


def test_missing_manifest_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["run-local", "-f", str(tmp_path / "nope.yaml")]) == exit_codes.USER_ERROR
    assert "cannot read the manifest" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (119, "119s"), (120, "2m"), (151, "2m31s"), (600, "10m"), (179 * 60, "179m"), (3 * 3600, "3h"),
     (3 * 3600 + 300, "3h5m"), (8 * 3600, "8h"), (47 * 3600, "47h"), (50 * 3600, "2d2h"), (30 * 86400, "30d"), (800 * 86400, "2y70d")],
)
def test_age_is_printed_like_kubectl(seconds: int, text: str) -> None:
    assert local.human_duration(seconds) == text


def test_progress_line_and_bar() -> None:
    record = {"step": 150, "totalSteps": 300, "loss": 2.34567, "tokensPerSecond": 1234.0, "eta": "35s"}
    assert local.progress_line(record) == "step 150/300  loss 2.3457  1.2k tok/s  ETA 35s"
    assert local.progress_line(record, bar_width=10).startswith("[#####.....]  50%  step 150/300")
    assert "ETA 2m30s" in local.progress_line({"step": 1, "totalSteps": 2, "etaSeconds": 150})
    untimed = {"step": 1, "totalSteps": 2, "loss": 2.0, "tokensPerSecond": None, "stepTimeSeconds": None, "eta": None}
    assert local.progress_line(untimed) == "step 1/2  loss 2.0000  (compiled the train step; timing from the next step)"


def test_progress_view_redraws_on_a_terminal_and_prints_lines_otherwise() -> None:
    records = [{"step": s, "totalSteps": 4, "loss": 3.0 - s / 2, "tokensPerSecond": 10.0, "eta": "1s"} for s in (1, 2)]
    plain = io.StringIO()
    view = local.ProgressView(plain, live=False)
    for r in records:
        view(r)
        view({**r, "lastCheckpoint": f"out/checkpoints/{r['step']}"})  # the trainer's record again once its checkpoint committed
    view.close()
    assert plain.getvalue().splitlines() == [local.progress_line(r) for r in records]
    live = io.StringIO()
    view = local.ProgressView(live, live=True)
    for r in records:
        view(r)
    view.close()
    assert live.getvalue().count("\r") == 2 and live.getvalue().endswith("\n") and live.getvalue().count("\n") == 1


def test_status_table_has_the_kubectl_get_columns() -> None:
    created = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    obj = {
        "metadata": {"name": "tiny-llama-demo", "creationTimestamp": created.isoformat()},
        "spec": {},
        "status": {"phase": "Succeeded", "tpu": "local cpu x1", "progress": "300/300", "loss": "0.8123", "restarts": 0,
                   "preemptions": 0},
    }
    header, row = local.status_table(obj, created + timedelta(seconds=151)).splitlines()
    assert header.split() == ["NAME", "PHASE", "TPU", "STEP", "LOSS", "RESTARTS", "PREEMPTIONS", "AGE"]
    assert row.split() == ["tiny-llama-demo", "Succeeded", "local", "cpu", "x1", "300/300", "0.8123", "0", "0", "2m31s"]
    # Columns line up as kubectl's do: each header starts where its value starts.
    assert row.index("Succeeded") == header.index("PHASE") and row.index("2m31s") == header.index("AGE")


def test_loss_plot_is_a_png_of_the_metrics(tmp_path: Path) -> None:
    import matplotlib.image

    lines = [json.dumps({"step": s, "loss": 5.0 / s}) for s in range(1, 30)] + ["", "{truncated", json.dumps({"step": 10, "eval/loss": 1.0})]
    records = local.read_metrics("\n".join(lines))
    assert len(records) == 30
    png = local.loss_plot_png(records, "t")
    path = tmp_path / "loss.png"
    path.write_bytes(png)
    image = matplotlib.image.imread(path)
    assert image.shape[:2] == (400, 700)
    with pytest.raises(local.UserError, match="nothing to plot"):
        local.loss_plot_png([{"step": 1}], "t")


def test_paths_under_the_working_directory_are_shown_relative(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert local.display_path(str(tmp_path / "out" / "hf-adapter")) == "out/hf-adapter"
    assert local.display_path("/elsewhere/x") == "/elsewhere/x"
    assert local.display_path("gs://bkt/run") == "gs://bkt/run"


def test_one_run_local_per_output(tmp_path: Path) -> None:
    """A second run-local on an output in use refuses, naming the holder (two at once both reported
    Succeeded, each overwriting the other's checkpoints and adapter); free again once the first ends."""
    out = str(tmp_path / "out")
    with local._sole_run(out):
        with pytest.raises(UserError, match=rf"in use by another run-local \(pid {os.getpid()}\).*--output"), local._sole_run(out):
            pass
    with local._sole_run(out):
        pass


def test_manifest_typos_are_named_with_the_field_meant(tmp_path: Path) -> None:
    """A misspelt field gets the closest real name (it was "Extra inputs are not permitted"); a
    misspelt top-level key is refused (`metdata:` ran under the file's name, `spce:` said only
    that spec.model was missing); a name the cluster refuses is refused here too."""
    spec = {**MINIMAL, "trainng": {}, "dataset": {"train": "d.jsonl", "maxSeqlen": 64}, "lora": {"targetModules": ["q_proj", "v_proj"]}}
    with pytest.raises(local.ManifestError) as e:
        local.load_manifest(write_manifest(tmp_path, spec))
    assert "spec.trainng: unknown field; did you mean 'training'?" in str(e.value)
    assert "spec.dataset.maxSeqlen: unknown field; did you mean 'maxSeqLen'?" in str(e.value)
    assert "spec.lora.targetModules: one regex, not a list: write '.*(q_proj|v_proj)'" in str(e.value)
    doc = {"apiVersion": "lora-operator.dev/v1alpha1", "kind": "LoraFinetune", "metdata": {"name": "t"}, "spec": MINIMAL}
    (tmp_path / "top.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(local.ManifestError, match="unknown top-level field 'metdata'; did you mean 'metadata'"):
        local.load_manifest(tmp_path / "top.yaml")
    with pytest.raises(local.ManifestError, match="metadata.name: 'My_Demo' cannot name a JobSet.*'my-demo'"):
        local.load_manifest(write_manifest(tmp_path, MINIMAL, metadata={"name": "My_Demo"}))
