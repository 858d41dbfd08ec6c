"""Import layers: the operator image never installs JAX or torch, so its modules must not import them.

`local.py` (run-local) is the one operator module that runs the trainer in-process; it imports the
trainer lazily, inside `run_local`, so importing it stays light too.
"""

import json
import pkgutil
import subprocess
import sys

import lora_operator

HEAVY = ("jax", "jaxlib", "flax", "torch", "transformers", "qwix", "tunix", "orbax", "numpy", "peft")


def test_operator_modules_import_nothing_heavy():
    modules = [f"lora_operator.{m.name}" for m in pkgutil.iter_modules(lora_operator.__path__)]
    assert "lora_operator.handlers" in modules and "lora_operator.render" in modules
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(json.dumps(sorted({{n.split('.')[0] for n in sys.modules}} & set({HEAVY!r}))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == []


def test_trainer_config_is_light():
    code = "import sys, lora_trainer.config, lora_trainer.storage, lora_trainer.exit_codes; print(sorted(m for m in sys.modules if m.split('.')[0] in %r))" % (HEAVY,)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
