"""The settings package: every name that `schemas/settings.py` had (before it became one module per
section) still imports from `schemas.settings`, and the package imports nothing of rtrl above it
(`schemas.sampling` imports the settings, never the reverse)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import schemas.settings

pytestmark = pytest.mark.unit

# Every public name defined in schemas/settings.py before the split (git show 946c6d9:schemas/settings.py).
FORMER_NAMES = (
    "AgentSettings",
    "AlarmSettings",
    "CelerySettings",
    "CispoLoss",
    "DEFAULT_RUBRIC",
    "DapoLoss",
    "DeployerSettings",
    "DrGrpoLoss",
    "GateSettings",
    "GateSuite",
    "GatewaySettings",
    "GrpoLoss",
    "GspoLoss",
    "JudgeSettings",
    "KafkaSettings",
    "LOSS_TYPES",
    "LabelerSettings",
    "LimitsSettings",
    "LoraSettings",
    "LossSettings",
    "MAX_KL_DEFAULT",
    "MetricsSettings",
    "MlflowSettings",
    "OfflineSuiteSettings",
    "OpeSettings",
    "PostgresSettings",
    "PpoLoss",
    "ServicesSettings",
    "Settings",
    "SettingsError",
    "StoreSettings",
    "TrainerSettings",
    "VllmSettings",
    "embedded_databases",
    "load_settings",
    "local_postgres_url",
    "to_env",
)

PACKAGE = Path(schemas.settings.__file__).parent


@pytest.mark.parametrize("name", FORMER_NAMES)
def test_every_former_name_imports_from_the_package(name: str) -> None:
    assert name in schemas.settings.__all__
    assert getattr(importlib.import_module("schemas.settings"), name) is not None


def test_all_names_what_the_package_has() -> None:
    assert sorted(schemas.settings.__all__) == sorted(set(schemas.settings.__all__))
    for name in schemas.settings.__all__:
        assert hasattr(schemas.settings, name), name


def _imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
    return modules


def test_the_package_imports_only_errors_from_the_rest_of_rtrl() -> None:
    # schemas.sampling imports Settings; a settings module importing schemas.sampling (even lazily,
    # in a validator) would close the circle the package was split to remove.
    for path in sorted(PACKAGE.glob("*.py")):
        rtrl_imports = {m for m in _imported_modules(path) if m.split(".")[0] == "schemas"}
        outside = {m for m in rtrl_imports if not m.startswith("schemas.settings")} - {"schemas.errors"}
        assert not outside, f"{path.name} imports {sorted(outside)}"


def test_every_section_module_is_short() -> None:
    for path in sorted(PACKAGE.glob("*.py")):
        assert len(path.read_text().splitlines()) < 600, path.name
