"""The train config: one set of pydantic models parsed by the trainer and embedded in the CRD."""

import json

import pytest
from pydantic import ValidationError

from lora_trainer.config import TrainConfig, dump_train_config, load_train_config, validation_problems

MINIMAL = {"model": {"source": "gs://models/llama"}, "dataset": {"train": "data/train.jsonl"}, "output": {"uri": "gs://runs/a"}}


def test_numbers_in_yaml_stay_numbers():
    cfg = TrainConfig.model_validate({**MINIMAL, "training": {"learningRate": "2e-4", "steps": 5}})  # YAML reads 2e-4 as a string
    assert cfg.training.learning_rate == 2e-4 and cfg.training.steps == 5


def test_round_trip_through_the_configmap_format(tmp_path):
    cfg = TrainConfig.model_validate(MINIMAL)
    path = tmp_path / "config.json"
    path.write_text(dump_train_config(cfg))
    assert load_train_config(path) == cfg
    assert cfg.to_wire()["training"]["globalBatchSize"] == 8


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"lora": {"rank": 0}}, "lora.rank"),
        ({"lora": {"targetModules": "(unclosed"}}, "lora.targetModules"),
        ({"lora": {"quantization": {"weightQtype": "nf4", "tileSize": 48}}}, "lora.quantization.tileSize"),
        ({"output": {"uri": "hf://org/model"}}, "output.uri"),
        ({"model": {"source": "s3://bucket/model"}}, "model.source"),
        ({"training": {"globalBatchSize": 6, "gradientAccumulation": 4}}, "training.globalBatchSize: globalBatchSize must be divisible by gradientAccumulation"),
        ({"training": {"evalEvery": 10}}, "training.evalEvery is set but dataset.eval is empty"),
        ({"lora": {"rnak": 8}}, "lora.rnak"),
        ({"training": {"seed": -1}}, "training.seed"),
        # What the CRD schema refuses, pydantic's lax mode would take (true as 1, "4" as 4).
        ({"training": {"steps": True}}, "training.steps"),
        ({"lora": {"rank": "4"}}, "lora.rank"),
        ({"dataset": {"train": "d.jsonl", "packing": "yes"}}, "dataset.packing"),  # numpy's shuffle takes no negative seed
    ],
)
def test_bad_input_names_the_field(patch, field):
    data = {**MINIMAL, **patch}
    with pytest.raises(ValidationError) as e:
        TrainConfig.model_validate(data)
    assert field in validation_problems(e.value)  # the whole dotted path, as the CR status shows it


def test_a_bad_command_line_is_a_user_error(capsys):
    from lora_trainer import cli, exit_codes

    assert cli.main(["convert", "--from", "peft", "--to", "orbax", "--source", "a", "--out", "b", "--base", "c"]) == exit_codes.USER_ERROR
    assert "invalid choice: 'peft'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0


def test_the_trainer_cli_refuses_a_bad_config_file_with_the_user_error_code(tmp_path, capsys):
    from lora_trainer import cli, exit_codes

    bad = tmp_path / "bad.yaml"
    bad.write_text(json.dumps({**MINIMAL, "training": {"steps": 0}}))
    bad_uri = tmp_path / "bad_uri.yaml"
    bad_uri.write_text(json.dumps({**MINIMAL, "output": {"uri": "hf://org/run"}}))
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed")
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"model: {source: caf\xe9}\n")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    cases = [
        (tmp_path / "absent.yaml", "cannot read"),
        (broken, "not valid YAML or JSON at line 1, column 17: expected ',' or ']'"),
        (latin1, "not UTF-8 text (byte 20)"),
        (empty, "invalid train config: top level: "),
        (bad, "training.steps"),
        # The same words as the operator's status condition, not pydantic's regex.
        (bad_uri, "output.uri: 'hf://org/run' is not a supported location; use a local path, gs://BUCKET/PATH or file:///PATH"),
    ]
    for path, message in cases:
        assert cli.main(["train", "--config", str(path)]) == exit_codes.USER_ERROR
        err = capsys.readouterr().err
        assert str(path) in err and message in err and "Traceback" not in err
        assert err.count("\n") == 1, err  # one paragraph


@pytest.mark.parametrize(
    ("uri", "ok"),
    [
        ("/home/me/My Projects/lora/data/train.jsonl", True),  # a checkout under a directory with a space
        ("data/run:1/train.jsonl", True),
        ("file:///tmp/a b", True),
        ("../data", True),
        ("s3://bucket/train.jsonl", False),  # another scheme is no local path
        ("C:/data", False),
        ("gs://b/x", False),  # bucket names have 3+ characters
    ],
)
def test_local_paths_may_hold_spaces_and_colons(uri, ok):
    """The local path pattern refused any space or colon, so `make demo` failed in a checkout under
    "My Projects" with "... is not a supported location; use a local path"."""
    spec = {**MINIMAL, "dataset": {**MINIMAL["dataset"], "train": uri}, "output": {"uri": uri.replace("train.jsonl", "out")}}
    if ok:
        TrainConfig.model_validate(spec)
    else:
        with pytest.raises(ValidationError) as e:
            TrainConfig.model_validate(spec)
        assert f"dataset.train: {uri!r} is not a supported location" in validation_problems(e.value)
