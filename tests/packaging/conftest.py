"""What the packaging tests read from pyproject.toml: the first-party packages the wheel ships and
the distributions the project declares. Read, never hard-coded, so a package added to
``[tool.setuptools.packages.find]`` is checked without touching these tests."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="session")
def first_party(pyproject: dict[str, Any]) -> list[str]:
    """The top-level packages of the wheel: the ``include`` patterns of setuptools' package
    discovery (``"ingest*"``: the package ``ingest`` and everything under it)."""
    patterns = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    names = sorted({pattern.rstrip("*").rstrip(".") for pattern in patterns})
    assert names and all(name.isidentifier() for name in names), f"unexpected include patterns: {patterns}"
    return names
