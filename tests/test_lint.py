"""The code is formatted and lint-clean by the rules in pyproject.toml ([tool.ruff]);
`ruff format . && ruff check --fix .` fixes most of what this finds."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def ruff(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("ruff")
    if exe is None:
        pytest.fail("ruff is not installed: pip install -e '.[test]' installs it")
    return subprocess.run([exe, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_code_is_formatted():
    out = ruff("format", "--check", ".")
    assert out.returncode == 0, f"run `ruff format .`:\n{out.stdout}{out.stderr}"


def test_the_code_passes_the_linter():
    out = ruff("check", ".")
    assert out.returncode == 0, f"run `ruff check .` (and fix what it names):\n{out.stdout}{out.stderr}"
