"""The import-layer contract (docs/architecture.md, "Layers"), checked on the source and at import time.

Static part (ast, no imports): every `import`/`from ... import` between the two packages' modules,
including the lazy ones inside functions, must go from a layer to the same or a lower one in LAYERS,
the module graph must have no cycle, and no FORBIDDEN edge exists. Runtime part (a subprocess per
probe): the operator image never installs JAX or torch, so importing any operator module loads
nothing heavy, and the pure layers load neither kopf nor the kubernetes client.

Also here: no function in either package is longer than MAX_FUNCTION_LINES.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"lora_operator": ROOT / "operator" / "lora_operator", "lora_trainer": ROOT / "trainer_image" / "lora_trainer"}

#: Top to bottom. A module may import modules of its own layer or a lower one, never a higher one.
#: An entry names a module or a package (then every module under it). `local` and the CLIs reach the
#: trainer's upper layers, lazily (inside a function), because run-local and `lora-operator docs` run it.
LAYERS: list[tuple[str, set[str]]] = [
    ("operator entry", {"lora_operator.cli"}),
    ("operator wiring", {"lora_operator.runner", "lora_operator.local"}),
    ("operator control", {"lora_operator.handlers", "lora_operator.controller", "lora_operator.reconcile",
                          "lora_operator.leader", "lora_operator.metrics", "lora_operator.kube"}),
    ("operator views", {"lora_operator.plan", "lora_operator.render", "lora_operator.crdgen", "lora_operator.refdocs"}),
    ("operator parts", {"lora_operator.status", "lora_operator.run_progress", "lora_operator.failure", "lora_operator.policy",
                        "lora_operator.generated"}),
    ("operator model", {"lora_operator.api", "lora_operator.settings", "lora_operator.overlay", "lora_operator.scheduling",
                        "lora_operator.tpu", "lora_operator.images", "lora_operator.labels", "lora_operator"}),
    ("trainer entry", {"lora_trainer.cli"}),
    ("trainer run", {"lora_trainer.train", "lora_trainer.async_saves", "lora_trainer.backend_start"}),
    ("trainer adapters", {"lora_trainer.adapters"}),
    ("trainer lora", {"lora_trainer.lora", "lora_trainer.tunix_trainer", "lora_trainer.lora_provider", "lora_trainer.loss"}),
    ("trainer parts", {"lora_trainer.models", "lora_trainer.data", "lora_trainer.checkpoint", "lora_trainer.checkpoint_metadata",
                       "lora_trainer.progress", "lora_trainer.stop", "lora_trainer.schedule", "lora_trainer.distributed",
                       "lora_trainer.compile_cache", "lora_trainer.step_record", "lora_trainer.metrics", "lora_trainer.host_memory",
                       "lora_trainer.tiny_models", "lora_trainer.accumulating_dot", "lora_trainer.cross_entropy", "lora_trainer.fused_head",
                       "lora_trainer.quantized_product", "lora_trainer.fused_delta", "lora_trainer.token_cache"}),
    ("trainer config", {"lora_trainer.config", "lora_trainer.storage", "lora_trainer.storage_faults", "lora_trainer.progress_record",
                        "lora_trainer.trainer_logging"}),
    ("leaves", {"lora_trainer.errors", "lora_trainer.exit_codes", "lora_trainer.rules", "lora_trainer.background", "lora_trainer"}),
]
#: Operator modules that may import the trainer above its config layer (lazily: see LAYERS).
TRAINER_BRIDGES = {"lora_operator.cli", "lora_operator.local"}
#: Edges the layer order alone does not exclude (same layer), written as (importer prefix, imported prefix).
FORBIDDEN = [
    ("lora_operator.status", "lora_operator.render"),  # status is written from api types, not from the renderer
    ("lora_trainer.models.spec", "lora_trainer.models.families"),  # families build on the spec, not the reverse
    ("lora_trainer.models.registry", "lora_trainer.models.families"),  # detection needs no JAX
]
#: Known exceptions, each to be removed by the change that breaks it (issue 24).
KNOWN: set[tuple[str, str]] = set()

#: Known cycles between modules (edges to drop from the cycle check), each with its reason.
KNOWN_CYCLE_EDGES: set[tuple[str, str]] = set()

HEAVY = ("jax", "jaxlib", "flax", "torch", "transformers", "qwix", "tunix", "orbax", "numpy", "peft")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, root in PACKAGES.items():
        for f in sorted(root.rglob("*.py")):
            out[".".join((pkg, *f.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")] = f
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The package modules `name` imports, anywhere in its source."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: len(name.split(".")) - node.level + is_pkg]
                base = ".".join(parts + ([node.module] if node.module else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(module: str) -> int:
    best = None
    for i, (_, entries) in enumerate(LAYERS):
        for e in entries:
            if (module == e or module.startswith(e + ".")) and (best is None or len(e) > best[1]):
                best = (i, len(e))
    assert best is not None, f"{module} is in no layer of tests/test_layers.py LAYERS: add it"
    return best[0]


def test_every_module_has_a_layer():
    for m in MODULES:
        _layer(m)


def test_imports_go_down_the_layers():
    bad = []
    for m, deps in GRAPH.items():
        for d in deps:
            if m in TRAINER_BRIDGES and d.startswith("lora_trainer."):
                continue
            if _layer(d) < _layer(m) and (m, d) not in KNOWN:
                bad.append(f"{m} ({LAYERS[_layer(m)][0]}) imports {d} ({LAYERS[_layer(d)][0]})")
    assert not bad, "\n".join(sorted(bad))


def test_no_forbidden_edge():
    bad = [(m, d) for m, deps in GRAPH.items() for d in deps for a, b in FORBIDDEN
           if (m == a or m.startswith(a + ".")) and (d == b or d.startswith(b + ".")) and (m, d) not in KNOWN]
    assert not bad


def test_known_exceptions_still_exist():
    """When a known exception is fixed, this fails: remove it from KNOWN."""
    assert [e for e in KNOWN if e[1] not in GRAPH.get(e[0], ())] == []


def test_no_import_cycle():
    """Between modules; a package's __init__ is a re-export facade and is left out."""
    graph = {m: {d for d in deps if MODULES[d].name != "__init__.py" and (m, d) not in KNOWN_CYCLE_EDGES} for m, deps in GRAPH.items() if MODULES[m].name != "__init__.py"}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d] if d in stack else [m, d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def _loaded(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_operator_modules_import_nothing_heavy():
    modules = sorted(m for m in MODULES if m.startswith("lora_operator"))
    assert "lora_operator.handlers" in modules and "lora_operator.render" in modules
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(json.dumps(sorted({{n.split('.')[0] for n in sys.modules}} & set({HEAVY!r}))))\n"
    )
    assert _loaded(code) == []


def test_trainer_config_is_light():
    code = ("import json, sys, lora_trainer.config, lora_trainer.storage, lora_trainer.exit_codes, lora_trainer.progress_record\n"
            f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})))")
    assert _loaded(code) == []


def test_operator_runner_loads_only_the_light_trainer_modules():
    code = "import json, sys, lora_operator.runner\nprint(json.dumps(sorted(m for m in sys.modules if m.startswith('lora_trainer'))))"
    allowed = {m for m in MODULES if m.startswith("lora_trainer") and _layer(m) >= _layer("lora_trainer.config")}
    assert set(_loaded(code)) <= allowed


@pytest.mark.parametrize("module", ["lora_operator.render", "lora_operator.status", "lora_operator.crdgen", "lora_operator.tpu",
                                    "lora_operator.plan", "lora_operator.reconcile", "lora_operator.policy", "lora_operator.images"])
def test_pure_layers_do_not_import_kopf_or_the_kubernetes_client(module):
    code = f"import json, sys, {module}\nprint(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('kopf', 'kubernetes'))))"
    assert _loaded(code) == []


MAX_FUNCTION_LINES = 60
#: Functions still over the limit, with their length today; the splits of issue 24 empty this list.
LONG_FUNCTIONS: dict[str, int] = {}


def _function_lengths() -> dict[str, int]:
    out = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        stack: list[tuple[ast.AST, str]] = [(tree, name)]
        while stack:
            node, prefix = stack.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    qual = f"{prefix}.{child.name}"
                    if not isinstance(child, ast.ClassDef):
                        out[qual] = child.end_lineno - child.lineno + 1
                    stack.append((child, qual))
                else:
                    stack.append((child, prefix))
    return out


def test_no_function_is_over_60_lines():
    lengths = _function_lengths()
    over = {f: n for f, n in lengths.items() if n > MAX_FUNCTION_LINES and f not in LONG_FUNCTIONS}
    assert not over, f"split these into named steps: {over}"
    stale = [f for f in LONG_FUNCTIONS if lengths.get(f, 0) <= MAX_FUNCTION_LINES]
    assert not stale, f"now short enough: remove from LONG_FUNCTIONS: {stale}"
