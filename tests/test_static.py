"""The habits the code keeps, checked on every `make test`: types (mypy over the product packages,
settings in pyproject.toml), lint and formatting (ruff over every Python file, tests, scripts and
examples included; generated stubs excluded)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Each runs a tool in a subprocess (see the tiers in tests/conftest.py).
pytestmark = pytest.mark.integration


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=600)


def test_the_product_packages_type_check() -> None:
    run = _run("mypy")  # files and options: [tool.mypy] in pyproject.toml
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]


def test_every_python_file_passes_the_linter() -> None:
    run = _run("ruff", "check", ".")
    assert run.returncode == 0, run.stdout[-6000:]


def test_every_python_file_is_formatted() -> None:
    run = _run("ruff", "format", "--check", ".")
    assert run.returncode == 0, run.stdout[-6000:]
