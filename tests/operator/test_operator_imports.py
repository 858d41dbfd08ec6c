"""Import layers: the operator image has no JAX, and the pure layers do not import kopf."""

import json
import subprocess
import sys

PROBE = """
import json, sys
import {module}
print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'torch', 'kopf', 'kubernetes', 'lora_trainer'))))
"""

TRAINER_MODULES_ALLOWED = {"lora_trainer", "lora_trainer.config", "lora_trainer.errors", "lora_trainer.exit_codes", "lora_trainer.storage", "lora_trainer.storage_faults"}


def _loaded(module: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", PROBE.format(module=module)], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


def test_operator_needs_no_jax_and_only_light_trainer_modules():
    loaded = _loaded("lora_operator.runner")
    assert not {m for m in loaded if m.split(".")[0] in ("jax", "flax", "torch")}
    assert {m for m in loaded if m.startswith("lora_trainer")} <= TRAINER_MODULES_ALLOWED


def test_pure_layers_do_not_import_kopf_or_the_kubernetes_client():
    for module in ("lora_operator.render", "lora_operator.status", "lora_operator.crdgen", "lora_operator.tpu",
                   "lora_operator.plan", "lora_operator.reconcile", "lora_operator.policy", "lora_operator.images"):
        assert not {m for m in _loaded(module) if m.split(".")[0] in ("kopf", "kubernetes")}, module
