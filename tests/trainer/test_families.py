"""Each model family is declared once, in its folder `lora_trainer/models/families/<name>/`, and
everything else follows from the folders (docs/dev/adding-a-family.md walks the same steps)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import get_args

import lora_trainer
from lora_trainer import config
from lora_trainer.models import registry
from lora_trainer.tiny_models import tiny_config_dict

ROOT = Path(__file__).resolve().parents[2]
FAMILIES_DIR = Path(lora_trainer.__file__).parent / "models" / "families"
HEAVY = ("jax", "flax", "tunix", "qwix", "torch", "transformers")


def test_the_declarations_are_the_registry_and_the_config_enum() -> None:
    folders = sorted(d.name for d in FAMILIES_DIR.iterdir() if (d / "__init__.py").is_file())
    assert registry.FAMILIES == tuple(folders) == get_args(config.Family)
    for name in registry.FAMILIES:
        spec = registry.get_family(name)
        assert spec.name == name
        for model_type in spec.model_types:
            assert registry.detect_family({"model_type": model_type}) == name
        for arch in spec.architectures:
            assert registry.detect_family({"architectures": [arch]}) == name
        tiny = tiny_config_dict(name)
        assert tiny["model_type"] in spec.model_types and set(tiny["architectures"]) <= set(spec.architectures)


def test_the_docs_name_every_family() -> None:
    for doc in ("docs/architecture.md", "docs/dev/contracts.md"):
        text = (ROOT / doc).read_text()
        assert all(f"{name}" in text for name in registry.FAMILIES), doc


def test_detection_and_the_declarations_import_no_jax() -> None:
    code = (
        "import sys\n"
        "from lora_trainer.models import registry\n"
        "[registry.get_family(n) for n in registry.FAMILIES]\n"
        "registry.detect_family({'model_type': 'llama'})\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_adding_a_family_is_one_folder(tmp_path: Path) -> None:
    """A copy of the package with one folder added (a Mistral-like family, Qwen2's tables under
    Mistral's names): the registry, `config.Family`, the CRD enum, detection and the tiny models
    pick it up with no other edit."""
    package = tmp_path / "lora_trainer"
    shutil.copytree(Path(lora_trainer.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
    new = package / "models" / "families" / "mistral"
    shutil.copytree(package / "models" / "families" / "qwen2", new)
    decl = new / "__init__.py"
    text = decl.read_text().replace('"qwen2"', '"mistral"').replace("Qwen2ForCausalLM", "MistralForCausalLM")
    decl.write_text(text)

    code = (
        "import json, sys\n"
        "from pydantic import TypeAdapter\n"
        "from lora_trainer import config\n"
        "from lora_trainer.models import registry\n"
        "from lora_trainer.tiny_models import tiny_config_dict\n"
        "from lora_operator import crdgen\n"
        "spec = registry.get_family('mistral')\n"
        "crd = json.dumps(crdgen.lora_finetune_crd())\n"
        "print(json.dumps({\n"
        "  'families': registry.FAMILIES,\n"
        "  'config': TypeAdapter(config.Family).validate_python('mistral'),\n"
        "  'detected': [registry.detect_family({'model_type': 'mistral'}), registry.detect_family({'architectures': ['MistralForCausalLM']}), registry.detect_family({'model_type': 'qwen2'})],\n"
        "  'tiny': tiny_config_dict('mistral')['model_type'],\n"
        "  'crd': '\"mistral\"' in crd,\n"
        "  'build': spec.build.__closure__[0].cell_contents, 'file': sys.modules[registry.__name__].__file__,\n"
        "  'heavy': sorted(m for m in sys.modules if m.split('.')[0] in %r),\n"
        "}))\n" % (HEAVY,)
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "operator")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["file"].startswith(str(tmp_path))
    assert "mistral" in got["families"] and set(registry.FAMILIES) < set(got["families"])
    assert got["config"] == got["tiny"] == "mistral" and got["detected"] == ["mistral", "mistral", "qwen2"]
    assert got["build"] == "lora_trainer.models.families.mistral.model"  # its own model code, loaded at the first build
    assert got["crd"] and got["heavy"] == []
