"""docs/troubleshooting.md documents every status reason the operator can set.

The reasons are read from the operator's source (lora_operator.status, .reconcile, .controller,
and the refusals' `reason` class attributes in .render and .kube): string literals passed as the
reason of `Observation(...)`, `_fail(...)`, `set_condition(...)`, `PostEvent(...)`, the
(reason, message, type) tuples given to `adopt(...)`, and `reason=...` keywords, with
`f"{what.capitalize()}Failed"`-style reasons expanded over the `what` values passed to
`observe_job`. A new reason without a documented meaning fails this test.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from lora_operator import controller, kube, reconcile, render, status

DOC = Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md"
#: Which positional argument is the reason, per callee name.
REASON_ARG = {"Observation": 1, "_fail": 1, "set_condition": 3, "PostEvent": 1}


def _callee(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _literals(node: ast.AST, whats: set[str]) -> set[str]:
    """The reason strings an expression can evaluate to (constants, both arms of `x if c else y`, f-strings over `what`)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.IfExp):
        return _literals(node.body, whats) | _literals(node.orelse, whats)
    if isinstance(node, ast.JoinedStr):
        suffix = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
        return {w.capitalize() + suffix for w in whats}
    return set()


def operator_reasons() -> set[str]:
    trees = [ast.parse(inspect.getsource(m)) for m in (status, reconcile, controller, render, kube)]
    calls = [n for t in trees for n in ast.walk(t) if isinstance(n, ast.Call)]
    whats = {a.value for c in calls if _callee(c) == "observe_job" for a in c.args[1:2] if isinstance(a, ast.Constant)}
    reasons: set[str] = set()
    for call in calls:
        name = _callee(call)
        if name in REASON_ARG and len(call.args) > REASON_ARG[name]:
            reasons |= _literals(call.args[REASON_ARG[name]], whats)
        for kw in call.keywords:
            if kw.arg == "reason":
                reasons |= _literals(kw.value, whats)
        if name == "adopt":
            reasons |= {r for a in call.args if isinstance(a, ast.Tuple) and a.elts for r in _literals(a.elts[0], whats)}
    for node in (n for t in trees for n in ast.walk(t) if isinstance(n, ast.ClassDef)):
        for stmt in node.body:  # a refusal's condition reason: `reason = "InvalidSpec"`
            if isinstance(stmt, ast.Assign) and [getattr(t, "id", None) for t in stmt.targets] == ["reason"]:
                reasons |= _literals(stmt.value, whats)
    return reasons


def test_every_status_reason_is_documented() -> None:
    reasons = operator_reasons()
    assert {"TrainingFailed", "ExportFailed", "InvalidSpec", "ConversionSucceeded", "SecretNotFound"} <= reasons, reasons
    text = DOC.read_text()
    missing = sorted(r for r in reasons if f"`{r}`" not in text)
    assert missing == [], f"docs/troubleshooting.md does not explain: {missing}"
