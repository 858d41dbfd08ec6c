"""gs:// end to end through the GCS emulator: import from a bucket, export back to it, logits to it."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hf_side import TOKENS, hf_logits, make_peft_adapter
from safetensors.numpy import load

from lora_trainer import cli, exit_codes, storage
from lora_trainer.adapters.convert import convert
from lora_trainer.adapters.export import export_checkpoint
from lora_trainer.adapters.peft_format import WEIGHTS_NAME
from lora_trainer.checkpoint import latest_committed_step
from lora_trainer.errors import UserError

pytestmark = pytest.mark.slow


def test_convert_export_and_logits_on_gcs(gcs_bucket, tiny_base, tmp_path):
    base = tiny_base("qwen3")
    local_adapter = make_peft_adapter(base, tmp_path / "peft", targets=["q_proj", "o_proj", "down_proj"], seed=3)
    prefix = f"gs://{gcs_bucket}/adapters-test"
    storage.upload_dir(str(local_adapter), f"{prefix}/peft")

    for _ in range(2):  # converting again replaces the output whole
        convert("hf-peft", "orbax", f"{prefix}/peft", f"{prefix}/orbax", base=str(base))
    assert latest_committed_step(f"{prefix}/orbax") == 0
    export_checkpoint(f"{prefix}/orbax", f"{prefix}/hf-adapter")

    original = load((local_adapter / WEIGHTS_NAME).read_bytes())
    again = load(storage.read_bytes(f"{prefix}/hf-adapter/{WEIGHTS_NAME}"))
    assert sorted(original) == sorted(again)
    assert all(np.array_equal(original[k], again[k]) for k in original)

    code = cli.main(["logits", "--base", str(base), "--adapter", f"{prefix}/orbax", "--tokens", ",".join(map(str, TOKENS)), "--out", f"{prefix}/logits.npy"])
    assert code == exit_codes.OK
    logits = np.load(io.BytesIO(storage.read_bytes(f"{prefix}/logits.npy")))
    assert logits.dtype == np.float32 and logits.shape == (len(TOKENS), 272)
    np.testing.assert_allclose(logits, hf_logits(base, adapter_dir=local_adapter), atol=1e-4, rtol=0)


def test_bad_adapter_on_gcs_publishes_nothing(gcs_bucket, tiny_base, tmp_path):
    base = tiny_base("qwen3")
    local_adapter = make_peft_adapter(base, tmp_path / "peft", targets=["q_proj"], rank=2, alpha=4)
    (local_adapter / "adapter_config.json").write_text((local_adapter / "adapter_config.json").read_text().replace('"r": 2', '"r": 3'))
    prefix = f"gs://{gcs_bucket}/adapters-bad"
    storage.upload_dir(str(local_adapter), f"{prefix}/peft")
    with pytest.raises(UserError, match="rank mismatch"):
        convert("hf-peft", "orbax", f"{prefix}/peft", f"{prefix}/orbax", base=str(base))
    assert not storage.exists(f"{prefix}/orbax")
