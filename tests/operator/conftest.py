"""Make tests/k8s_harness.py importable from the operator tests."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
