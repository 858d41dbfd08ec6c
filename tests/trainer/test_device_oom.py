"""Accelerator out-of-memory: XLA's RESOURCE_EXHAUSTED becomes exit code 3 with a fix-it paragraph.

The end-to-end test provokes a real one: a `lora-trainer train` process on the CPU backend
under an address-space limit, with a batch whose attention buffers cannot fit, so XLA
itself fails the allocation (as it does for HBM on a TPU) and the CLI maps it.
"""

from __future__ import annotations

import resource
import subprocess

import jax
import pytest
from trainer_fixtures import LORA_TRAINER, REPO, train_config, trainer_env, write_config

from lora_trainer import checkpoint, cli, exit_codes
from lora_trainer.errors import device_oom_message

#: Address space a trainer gets: several times what the tiny run needs (~3 GiB), far below the failing buffer.
ADDRESS_SPACE = 16 * 2**30
#: Rows per step (the most training.globalBatchSize allows) that make one of the step's buffers ~21 GiB on the tiny model.
HUGE_BATCH = 65536


def _oom(message: str) -> jax.errors.JaxRuntimeError:
    return jax.errors.JaxRuntimeError(message)


@pytest.mark.parametrize(
    ("message", "size"),
    [
        ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1234 bytes.", "of 1234 bytes"),
        ("RESOURCE_EXHAUSTED: Out of memory allocating 8589934592 bytes.", "of 8.00 GiB"),
        ("RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 1.23G. That was not possible.", "of 1.23G"),
        ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm.", "("),
    ],
)
def test_xla_oom_names_the_size_and_the_config_fields(message, size):
    text = device_oom_message(_oom(message), "train")
    assert text is not None and text.startswith("out of accelerator memory")
    assert f"allocation {size}" in text
    for field in ("training.globalBatchSize", "training.gradientAccumulation", "dataset.maxSeqLen", "lora.quantization", "training.mesh.fsdp"):
        assert field in text
    assert "\n" not in text


@pytest.mark.parametrize(
    "exc",
    [
        _oom("INTERNAL: something else broke"),
        _oom("RESOURCE_EXHAUSTED: grpc: received message larger than max"),
        RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 8 bytes."),
    ],
)
def test_other_errors_are_not_oom(exc):
    assert device_oom_message(exc, "train") is None


def test_cli_maps_oom_and_lets_other_xla_errors_through(monkeypatch, capsys):
    def raise_(exc: BaseException) -> None:
        raise exc

    monkeypatch.setattr(cli, "_dispatch", lambda _args: raise_(_oom("RESOURCE_EXHAUSTED: Out of memory allocating 64 bytes.")))
    assert cli.main(["export", "--checkpoint", "x", "--out", "y"]) == exit_codes.USER_ERROR
    err = capsys.readouterr().err
    assert err.startswith("lora-trainer export: error: out of accelerator memory") and err.count("\n") == 1

    monkeypatch.setattr(cli, "_dispatch", lambda _args: raise_(_oom("INTERNAL: a bug")))
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        cli.main(["export", "--checkpoint", "x", "--out", "y"])


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


@pytest.mark.slow
def test_real_xla_oom_exits_with_user_error_and_no_checkpoint(tmp_path):
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "cfg.json", train_config(tmp_path, str(out), steps=2, globalBatchSize=HUGE_BATCH))
    proc = subprocess.run(
        [LORA_TRAINER, "train", "--config", cfg],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=trainer_env(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1"),
        preexec_fn=_limit_address_space,
    )
    assert proc.returncode == exit_codes.USER_ERROR, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("lora-trainer train: error: out of accelerator memory: XLA could not make an allocation of ")
    assert "RESOURCE_EXHAUSTED" in last and "training.globalBatchSize" in last
    assert "Traceback" not in proc.stderr
    assert checkpoint.committed_steps(checkpoint.checkpoint_root(str(out))) == []
