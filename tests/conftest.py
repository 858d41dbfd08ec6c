"""Fixtures shared by every test directory."""

import atexit
import os
import shutil
import tempfile

from lora_trainer import host_memory

# Tuned as `run_training` tunes a trainer process, before any test starts JAX's threads, so the
# many in-process train steps of this session reuse freed buffers instead of page-faulting afresh.
host_memory.retain_freed_memory()

# No machine here reaches a model hub: huggingface_hub must answer from its cache only. It reads
# these when first imported, so they are set before any test module imports transformers.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_CACHE"] = tempfile.mkdtemp(prefix="lora-tests-hf-cache-")
atexit.register(shutil.rmtree, os.environ["HF_HUB_CACHE"], True)  # one per session, not left behind

# The GCS emulator fixture (`gcs_bucket`) lives in tests/gcs_emulator.py; registering it
# here makes it one server per session instead of one per importing module.
pytest_plugins = ["gcs_emulator"]
