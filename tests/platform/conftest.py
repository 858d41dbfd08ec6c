"""Make tests/ (k8s_harness, shared helpers) and this folder importable from the platform tests."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
