"""The Prometheus alerting rules (infra/prometheus/rtrl.rules.yml): promtool accepts them, their unit
tests (infra/prometheus/tests/) pass, every alert is tested firing and quiet, and every alert has
its runbook in docs/runbooks/alerts/, listed in that folder's README.

promtool comes from Debian's prometheus package (`make test-deps`); without it these tests fail.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "infra" / "prometheus" / "rtrl.rules.yml"
RULE_TESTS = sorted((REPO / "infra" / "prometheus" / "tests").glob("*.yml"))
RUNBOOKS = REPO / "docs" / "runbooks" / "alerts"


def _alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def _promtool(*args: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not on PATH: run `make test-deps` (it installs Debian's prometheus package)")
    done = subprocess.run([promtool, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (
        f"promtool {' '.join(args)} exited {done.returncode}:\n{done.stdout}{done.stderr}"
    )


def test_promtool_checks_the_rules() -> None:
    _promtool("check", "rules", str(RULES.relative_to(REPO)))


def test_promtool_unit_tests_pass() -> None:
    assert RULE_TESTS, "no promtool unit tests in infra/prometheus/tests/"
    _promtool("test", "rules", *(str(path.relative_to(REPO)) for path in RULE_TESTS))


def test_every_alert_has_severity_for_and_annotations() -> None:
    alerts = _alerts()
    assert len({rule["alert"] for rule in alerts}) == len(alerts), "two alerts share a name"
    for rule in alerts:
        name = rule["alert"]
        assert "for" in rule, f"{name} has no for:"
        assert rule.get("labels", {}).get("severity") in ("page", "ticket"), (
            f"{name}: severity must be page or ticket"
        )
        assert {"summary", "description", "runbook_url"} <= set(rule.get("annotations", {})), name


def test_every_alert_has_a_runbook_in_the_index() -> None:
    index = (RUNBOOKS / "README.md").read_text()
    for rule in _alerts():
        name = rule["alert"]
        assert rule["annotations"]["runbook_url"] == f"docs/runbooks/alerts/{name}.md"
        assert (RUNBOOKS / f"{name}.md").is_file(), f"no runbook docs/runbooks/alerts/{name}.md"
        row = re.search(rf"^\| \[{name}\]\({name}\.md\) \| (\w+) \|", index, re.MULTILINE)
        assert row is not None, f"{name} is not listed in docs/runbooks/alerts/README.md"
        assert row.group(1) == rule["labels"]["severity"], (
            f"{name}: severity in the index differs from the rule"
        )


def test_every_alert_is_tested_firing_and_quiet() -> None:
    names = {rule["alert"] for rule in _alerts()}
    fires: set[str] = set()
    quiet: set[str] = set()
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                name = check["alertname"]
                assert name in names, f"{path.name}: {case.get('name')!r} tests {name}, which is no alert"
                (fires if check.get("exp_alerts") else quiet).add(name)
    assert not names - fires, f"alerts never tested firing: {sorted(names - fires)}"
    assert not names - quiet, f"alerts never tested quiet (exp_alerts: []): {sorted(names - quiet)}"
