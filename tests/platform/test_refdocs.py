"""docs/reference/ is generated from the code and committed; it must be current and complete."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from lora_operator import refdocs
from lora_operator.cli import _parser as operator_parser
from lora_operator.cli import main as cli_main
from lora_operator.crdgen import adapter_conversion_crd, lora_finetune_crd
from lora_trainer import exit_codes
from lora_trainer.cli import _parser as trainer_parser

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference"


def test_committed_reference_docs_are_current() -> None:
    assert cli_main(["docs", "--out", str(REFERENCE), "--check"]) == 0, "run `lora-operator docs` and commit docs/reference/"


def test_check_detects_a_stale_page(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["docs", "--out", str(tmp_path)]) == 0
    assert cli_main(["docs", "--out", str(tmp_path), "--check"]) == 0
    page = tmp_path / "lorafinetune.md"
    page.write_text(page.read_text().replace("spec.lora.rank", "spec.lora.rnak"))
    assert cli_main(["docs", "--out", str(tmp_path), "--check"]) == 1
    assert "lorafinetune.md" in capsys.readouterr().err


def _leaves(schema: dict[str, Any], path: str) -> list[str]:
    out = []
    for name, sub in schema.get("properties", {}).items():
        p = f"{path}.{name}"
        out.append(p)
        if sub.get("type") == "array":
            out += _leaves(sub.get("items", {}), f"{p}[]")
        out += _leaves(sub, p)
    return out


@pytest.mark.parametrize(("crd", "page"), [(lora_finetune_crd(), "lorafinetune.md"), (adapter_conversion_crd(), "adapterconversion.md")])
def test_crd_page_has_every_field_default_and_rule(crd: dict[str, Any], page: str) -> None:
    text = (REFERENCE / page).read_text()
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    fields = _leaves(schema["spec"], "spec") + _leaves(schema["status"], "status")
    assert len(fields) > 10
    for field in fields:
        assert f"| `{field}` |" in text, f"{page} lacks {field}"
    rows = {line.split(" | ")[0].strip("| `"): line for line in text.splitlines() if line.startswith("| `spec.")}
    assert "`16`" in rows.get("spec.lora.rank", "") or page != "lorafinetune.md"
    for name, sub in schema["spec"]["properties"].items():
        if "default" in sub and not isinstance(sub["default"], dict):
            assert "`" in rows[f"spec.{name}"].split(" | ")[2], f"{page}: default of spec.{name} missing"

    def messages(node: dict[str, Any]) -> list[str]:
        found = [r["message"] for r in node.get("x-kubernetes-validations", [])]
        for sub in node.get("properties", {}).values():
            found += messages(sub)
        return found + (messages(node["items"]) if isinstance(node.get("items"), dict) else [])

    for message in messages(schema["spec"]):
        assert refdocs._cell(message) in text


@pytest.mark.parametrize(("parser", "page"), [(trainer_parser(), "trainer-cli.md"), (operator_parser(), "operator-cli.md")])
def test_cli_page_has_every_subcommand_and_option(parser: argparse.ArgumentParser, page: str) -> None:
    text = (REFERENCE / page).read_text()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert len(subs) >= 3
    for name, sub in subs.items():
        assert f"## `{parser.prog} {name}`" in text
        for action in sub._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}`" in text, f"{page} lacks {name} {flag}"


def test_exit_code_page_matches_the_table_and_the_pod_failure_policy() -> None:
    text = (REFERENCE / "exit-codes.md").read_text()
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "completes" in rows[str(exit_codes.OK)]
    assert "no restart" in rows[str(exit_codes.USER_ERROR)]
    assert "resumes" in rows[str(exit_codes.RETRIABLE)]
    assert "resumes" in rows[f"{exit_codes.FIRST_SIGNAL_EXIT}-{exit_codes.MAX_EXIT}"]
