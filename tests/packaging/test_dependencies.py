"""pyproject.toml declares what the code imports: every third-party module a first-party package
imports (at module level or lazily inside a function) belongs to a distribution in
``[project].dependencies``, and every one the tests import to a dependency or the ``test`` extra.

Import names are mapped to distributions by `importlib.metadata.packages_distributions` (``yaml``
-> PyYAML, ``kafka`` -> kafka-python), so this runs in the installed environment (the lock).
Imports under ``if TYPE_CHECKING:`` are not made at run time and are not counted.
"""

from __future__ import annotations

import ast
import importlib.metadata
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(files: Iterable[Path]) -> dict[str, set[Path]]:
    """Top-level module name -> the files that import it (absolute imports, outside TYPE_CHECKING)."""
    found: dict[str, set[Path]] = {}
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        type_only = {
            id(node)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for statement in block.body
            for node in ast.walk(statement)
        }
        for node in ast.walk(tree):
            if id(node) in type_only:
                continue
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.partition(".")[0], set()).add(path)
    return found


def third_party(found: dict[str, set[Path]], local: Iterable[str]) -> dict[str, set[Path]]:
    """`found` without the standard library, ``__future__`` and the `local` modules."""
    skip = set(sys.stdlib_module_names) | {"__future__"} | set(local)
    return {name: files for name, files in found.items() if name not in skip}


def undeclared(found: dict[str, set[Path]], declared: set[str]) -> dict[str, str]:
    """Module -> what is wrong, for each module whose distribution is not in `declared`."""
    distributions = importlib.metadata.packages_distributions()
    problems: dict[str, str] = {}
    for module, files in sorted(found.items()):
        names = {canonicalize_name(d) for d in distributions.get(module, [])}
        where = ", ".join(
            sorted(str(f.relative_to(ROOT)) if f.is_relative_to(ROOT) else str(f) for f in files)[:3]
        )
        if not names:
            problems[module] = f"no installed distribution provides it (imported by {where})"
        elif not names & declared:
            problems[module] = f"provided by {sorted(names)}, none of them declared (imported by {where})"
    return problems


def names(requirements: Iterable[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def python_files(root: Path, packages: Iterable[str]) -> list[Path]:
    return sorted(f for package in packages for f in (root / package).rglob("*.py"))


def test_the_check_finds_an_undeclared_import_and_skips_what_is_not_one(tmp_path: Path) -> None:
    package = tmp_path / "mine"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from __future__ import annotations\n"
        "import json, os.path\n"
        "from typing import TYPE_CHECKING\n"
        "import pytest\n"
        "from . import sibling\n"
        "from mine import other\n"
        "if TYPE_CHECKING:\n"
        "    import only_for_types\n"
        "def lazy():\n"
        "    from not_a_real_distribution.sub import thing\n"
    )
    found = third_party(imported_modules(python_files(tmp_path, ["mine"])), local=["mine"])
    assert set(found) == {"pytest", "not_a_real_distribution"}
    problems = undeclared(found, declared={"pytest"})
    assert (
        list(problems) == ["not_a_real_distribution"]
        and "no installed distribution" in problems["not_a_real_distribution"]
    )
    assert list(undeclared(found, declared={"pluggy"})) == ["not_a_real_distribution", "pytest"]


def test_every_module_the_packages_import_is_a_declared_dependency(
    pyproject: dict[str, Any], first_party: list[str]
) -> None:
    declared = names(pyproject["project"]["dependencies"])
    found = third_party(imported_modules(python_files(ROOT, first_party)), local=first_party)
    for needed in (
        "peft",
        "numpy",
        "aiohttp",
        "orjson",
        "redis",
    ):  # the (pip install . broke without them)
        assert needed in found, f"no package imports {needed} any more: is it still a dependency?"
    problems = undeclared(found, declared)
    assert not problems, (
        "add to [project].dependencies in pyproject.toml (versions as in requirements/lock.txt):\n"
        + ("\n".join(f"  {module}: {why}" for module, why in problems.items()))
    )
    assert "fastapi" not in declared, "fastapi is imported by tests only: it belongs in the test extra"


def test_what_the_tests_import_is_a_dependency_or_in_the_test_extra(
    pyproject: dict[str, Any], first_party: list[str]
) -> None:
    project = pyproject["project"]
    declared = names(project["dependencies"]) | names(project["optional-dependencies"]["test"])
    tests = ROOT / "tests"
    local = {
        *first_party,
        *(f.stem for f in tests.rglob("*.py")),
        *(d.name for d in ROOT.iterdir() if d.is_dir()),
    }
    found = third_party(imported_modules(sorted(tests.rglob("*.py"))), local=local)
    problems = undeclared(found, declared)
    assert not problems, (
        "add to the test extra in pyproject.toml (versions as in requirements/lock.txt):\n"
        + ("\n".join(f"  {module}: {why}" for module, why in problems.items()))
    )
