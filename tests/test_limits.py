"""The size limits of docs/architecture.md (Size limits): no module over 600 lines and no function
over 80 lines, in every package and in bench/ (tests are exempt). An exception needs its reason in
docs/architecture.md and its name in `EXCEPTIONS`."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
EXCEPTIONS: frozenset[str] = frozenset()  # "path" or "path:function", each explained in docs/architecture.md


def _sources() -> list[Path]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in config["tool"]["setuptools"]["packages"]["find"]["include"]]
    roots = [REPO / p for p in packages] + [REPO / "bench"]
    return sorted(
        path
        for root in roots
        for path in root.rglob("*.py")
        if "migrations" not in path.relative_to(REPO).parts
    )


def test_there_is_code_to_check() -> None:
    assert len(_sources()) > 100


def test_no_module_over_the_limit() -> None:
    over = {}
    for path in _sources():
        name = str(path.relative_to(REPO))
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES and name not in EXCEPTIONS:
            over[name] = lines
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them by role): {over}"


def test_no_function_over_the_limit() -> None:
    over = {}
    for path in _sources():
        name = str(path.relative_to(REPO))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES and f"{name}:{node.name}" not in EXCEPTIONS:
                    over[f"{name}:{node.lineno} {node.name}"] = lines
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps): {over}"
