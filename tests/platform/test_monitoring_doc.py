"""docs/monitoring.md: its metric table is what the operator exports, and its PrometheusRule only
uses those metrics (an alert on a misspelt metric would never fire)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from lora_operator.metrics import OperatorMetrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "monitoring.md"
RUN = {
    "metadata": {"namespace": "ml", "name": "r", "creationTimestamp": "2026-12-01T08:00:00Z"},
    "status": {"phase": "Pending", "step": 1, "totalSteps": 2, "tokensPerSecond": "1", "mfu": "0.5", "restarts": 0, "preemptions": 0},
}


def _registry() -> OperatorMetrics:
    """The operator's metrics with one run in the table and one failure counted."""
    metrics = OperatorMetrics()
    metrics.observe(RUN)
    metrics.reconcile_errors.labels("reconcile", "exception").inc()
    return metrics


def _exported() -> set[str]:
    """Every sample name the operator exports."""
    return {s.name for f in _registry().registry.collect() for s in f.samples}


def test_the_metric_table_lists_every_metric_the_operator_exports() -> None:
    documented = dict(re.findall(r"^\| `(lora_operator_\w+)` \| (\w+) \|", DOC.read_text(), re.MULTILINE))
    families = {f.name + ("_total" if f.type == "counter" else ""): f.type for f in _registry().registry.collect()
                if f.name.startswith("lora_operator_")}
    assert documented == families


def test_the_alerts_use_only_exported_metrics() -> None:
    text = DOC.read_text()
    rule = yaml.safe_load(re.search(r"```yaml\n(apiVersion: monitoring.coreos.com/v1\nkind: PrometheusRule.*?)```", text, re.S)[1])
    rules = [r for group in rule["spec"]["groups"] for r in group["rules"]]
    assert len(rules) >= 8 and all(r["alert"] and r["expr"] and r["annotations"]["summary"] for r in rules)
    exported = _exported()
    for r in rules:
        used = set(re.findall(r"\blora_operator_\w+", r["expr"]))
        assert used and used <= exported, (r["alert"], used - exported)
