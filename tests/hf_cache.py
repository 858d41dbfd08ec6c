"""Publish a local checkpoint into huggingface_hub's cache, so `hf://` URIs resolve offline.

The layout is the hub cache's own (`models--ORG--NAME/refs/main` -> `snapshots/<commit>/`), which
`huggingface_hub` reads when `HF_HUB_OFFLINE=1` (set in tests/conftest.py): the production
download code runs unchanged, only the network is absent.
"""

import hashlib
import os
import shutil
from pathlib import Path


def publish_to_hub_cache(src: Path, repo_id: str) -> str:
    """Copy `src` into the hub cache as the `main` revision of `repo_id`; returns its hf:// URI."""
    cache = Path(os.environ["HF_HUB_CACHE"])
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(src, repo / "snapshots" / commit, dirs_exist_ok=True)
    return f"hf://{repo_id}"
