"""The layout's rules hold: every import of the package (a deferred one too) keeps the import-linter contracts
written once in pyproject.toml, which docs/explanation/layout.md shows; and the contracts do catch a breach."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[2]
CHECK = (
    "from importlinter.cli import lint_imports; "
    "raise SystemExit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))"
)


def contracts() -> list[dict[str, Any]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    found: list[dict[str, Any]] = config["tool"]["importlinter"]["contracts"]
    return found


def test_every_import_keeps_the_contracts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    assert lint_imports(config_filename="pyproject.toml", no_cache=True, no_logo=True) == 0, (
        "an import breaks a rule of pyproject.toml's [tool.importlinter]: run `lint-imports` to see which"
    )


def test_the_layers_name_every_part_and_the_package_has_no_other() -> None:
    [layers] = [contract for contract in contracts() if contract["type"] == "layers"]
    assert layers["exhaustive"] is True  # a new part must be given its place
    named = {part.strip() for layer in layers["layers"] for part in str(layer).replace(":", "|").split("|")}
    package = ROOT / "hail_guard"
    modules = {path.stem for path in package.glob("*.py")} - {"__init__"}
    packages = {path.parent.name for path in package.glob("*/__init__.py")}
    assert named == modules | packages


def test_a_part_importing_one_above_it_breaks_the_contracts(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "hail_guard", tmp_path / "hail_guard", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    kept = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, capture_output=True, text=True, check=False)
    with (tmp_path / "hail_guard" / "same_send.py").open("a") as module:
        module.write("\n\ndef _settings() -> object:\n    from hail_guard import config\n\n    return config\n")
    broken = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, capture_output=True, text=True, check=False)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "hail_guard.same_send -> hail_guard.config" in broken.stdout
