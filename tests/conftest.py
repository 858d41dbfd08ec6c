"""Fixtures shared by every test directory."""

import os
import tempfile

# No machine here reaches a model hub: huggingface_hub must answer from its cache only. It reads
# these when first imported, so they are set before any test module imports transformers.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_CACHE"] = tempfile.mkdtemp(prefix="lora-tests-hf-cache-")

# The GCS emulator fixture (`gcs_bucket`) lives in tests/gcs_emulator.py; registering it
# here makes it one server per session instead of one per importing module.
pytest_plugins = ["gcs_emulator"]
