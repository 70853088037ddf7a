"""Style is a gate like the others: ruff lint rules and formatting (pyproject [tool.ruff]) hold."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
RUFF = [sys.executable, "-m", "ruff"]


def test_ruff_lint_finds_nothing():
    result = subprocess.run(
        [*RUFF, "check", "--output-format", "concise", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_would_change_nothing():
    result = subprocess.run([*RUFF, "format", "--check", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
