"""The monitoring files against the metric families rtrl really exports.

infra/grafana/rtrl-dashboard.json, infra/prometheus/rtrl.rules.yml (when present),
infra/prometheus/prometheus.yml and docs/metrics.md name metrics by string; nothing else would
notice a panel or an alert that queries a name no process exports (it just draws nothing, or never
fires). The exported families are read from prometheus_client itself: the default registry after
importing the modules that define them, plus a fresh gateway registry.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase

from schemas.settings import GatewaySettings, MetricsSettings

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "infra" / "grafana" / "rtrl-dashboard.json"
RULES = ROOT / "infra" / "prometheus" / "rtrl.rules.yml"
SCRAPE = ROOT / "infra" / "prometheus" / "prometheus.yml"
DOC = ROOT / "docs" / "metrics.md"

# A metric name of rtrl's; not part of a recording-rule name such as job:rtrl_x:rate5m.
NAME = re.compile(r"(?<![A-Za-z0-9_:])rtrl_[A-Za-z0-9_]+(?![A-Za-z0-9_:])")
SELECTOR = re.compile(r"(?<![A-Za-z0-9_:])(rtrl_[A-Za-z0-9_]+)\s*\{([^}]*)\}")
MATCHER_LABEL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
LEGEND_LABEL = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
# Labels a series has besides its family's own: the scrape's, and the histogram bucket bound.
SCRAPE_LABELS = frozenset({"job", "instance"})
SERIES_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
}
SERIES_LABELS = {"histogram": frozenset({"le"})}
JOBS = {
    "rtrl-gateway": GatewaySettings.model_fields["port"].default,
    "rtrl-supervisor": MetricsSettings.model_fields["supervisor_port"].default,
    "rtrl-labeler": MetricsSettings.model_fields["labeler_port"].default,
    "rtrl-worker": MetricsSettings.model_fields["worker_port"].default,
    "rtrl-beat": MetricsSettings.model_fields["beat_port"].default,
    "rtrl-reconciler": MetricsSettings.model_fields["reconciler_port"].default,
}


@dataclass(frozen=True)
class Family:
    name: str
    type: str
    labels: frozenset[str]

    @property
    def series(self) -> frozenset[str]:
        """The names Prometheus stores for this family (what a query can select)."""
        return frozenset(self.name + suffix for suffix in SERIES_SUFFIXES[self.type])

    @property
    def queried_as(self) -> str:
        """The name docs/metrics.md gives the family: counters with _total, the rest as defined."""
        return self.name + "_total" if self.type == "counter" else self.name


@cache
def exported() -> dict[str, Family]:
    """Every rtrl_* family any rtrl process exports, by family name."""
    import deployer.metrics
    import feedback.metrics
    import services.supervisor
    import trainer.metrics
    from ingest.metrics import GatewayMetrics

    gateway = GatewayMetrics()
    # Label names are not in a collected family until a child exists, so read them off the metric
    # objects (prometheus_client keeps them in `_labelnames`).
    labels: dict[str, frozenset[str]] = {}
    for namespace in (
        vars(feedback.metrics),
        vars(trainer.metrics),
        vars(deployer.metrics),
        vars(services.supervisor),
        vars(gateway),
    ):
        for metric in namespace.values():
            if isinstance(metric, MetricWrapperBase):
                labels[metric._name] = frozenset(metric._labelnames)
    families: dict[str, Family] = {}
    for registry in (REGISTRY, gateway.registry):
        for family in registry.collect():
            if family.name.startswith("rtrl_"):
                assert family.type in SERIES_SUFFIXES, (
                    f"{family.name}: no rule here for {family.type} families"
                )
                families[family.name] = Family(family.name, family.type, labels[family.name])
    assert len(families) > 40, (
        f"only {len(families)} rtrl families found: did an import fail to register them?"
    )
    return families


@cache
def series_names() -> dict[str, Family]:
    return {series: family for family in exported().values() for series in family.series}


def panels(items: list[dict[str, Any]], rows: bool = False) -> Iterator[dict[str, Any]]:
    """Every panel of the dashboard, those inside collapsed rows included; the rows too if `rows`."""
    for panel in items:
        if panel.get("type") != "row":
            yield panel
            continue
        if rows:
            yield panel
        yield from panels(panel.get("panels", []), rows)


@cache
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


@cache
def rules() -> list[dict[str, Any]]:
    """The rules of the alert rules file, each with its group's name under "group"."""
    document = yaml.safe_load(RULES.read_text()) or {}
    return [
        {**rule, "group": group.get("name")}
        for group in document.get("groups") or []
        for rule in group.get("rules") or []
    ]


def recorded() -> set[str]:
    """rtrl_* names that the rules file records (a query may select them too)."""
    return {rule["record"] for rule in rules() if "record" in rule} if RULES.exists() else set()


def unknown_names(text: str, known: set[str]) -> list[str]:
    """rtrl_* names in `text` outside `known`, each with the closest exported name as a hint."""
    problems = []
    for name in sorted(set(NAME.findall(text)) - known):
        hint = difflib.get_close_matches(name, sorted(series_names()), n=1)
        problems.append(f"{name} (did you mean {hint[0]}?)" if hint else name)
    return problems


def unknown_labels(expr: str, legend: str = "") -> list[str]:
    """Labels `expr` (and its legend) uses that none of its rtrl families carries."""
    families = [series_names()[n] for n in NAME.findall(expr) if n in series_names()]
    if not families:
        return []  # only Prometheus's own series (up) or recorded ones: nothing to check against
    problems = []
    for name, matchers in SELECTOR.findall(expr):
        family = series_names().get(name)
        if family is None:
            continue  # reported as an unknown name
        own = family.labels | SCRAPE_LABELS
        if name.endswith("_bucket"):
            own |= SERIES_LABELS.get(family.type, frozenset())
        problems += [
            f"{name}{{{label}=...}}" for label in MATCHER_LABEL.findall(matchers) if label not in own
        ]
    # Grouping and legend labels may come from any family in the expression, or be made by
    # label_replace / label_join (their new label is a string literal there).
    anywhere = set(SCRAPE_LABELS).union(
        *(f.labels | SERIES_LABELS.get(f.type, frozenset()) for f in families)
    )
    anywhere |= set(re.findall(r'"([A-Za-z_][A-Za-z0-9_]*)"', expr))
    for group in GROUPING.findall(expr):
        problems += [
            f"({label})" for label in (s.strip() for s in group.split(",")) if label and label not in anywhere
        ]
    problems += [
        f"{{{{{label}}}}} in the legend" for label in LEGEND_LABEL.findall(legend) if label not in anywhere
    ]
    return problems


# ---- the dashboard ----------------------------------------------------------------------------


def test_every_panel_has_a_title_a_description_and_a_query() -> None:
    board = dashboard()
    assert board["schemaVersion"] >= 39
    assert board["uid"] and board["title"]
    found = list(panels(board["panels"]))
    assert len(found) >= 30
    ids = [p["id"] for p in panels(board["panels"], rows=True)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in found:
        where = f"panel {panel.get('id')} ({panel.get('title')!r})"
        assert panel.get("title", "").strip(), f"{where}: no title"
        assert panel.get("description", "").strip(), f"{where}: no description"
        assert panel.get("targets"), f"{where}: no query"
        for target in panel["targets"]:
            assert target.get("expr", "").strip(), f"{where}: target {target.get('refId')} has no expression"
            assert target["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, where
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, where


def test_the_data_source_is_chosen_on_import() -> None:
    board = dashboard()
    assert [(i["name"], i["type"], i["pluginId"]) for i in board["__inputs"]] == [
        ("DS_PROMETHEUS", "datasource", "prometheus")
    ]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"


def test_the_dashboard_queries_only_series_rtrl_exports() -> None:
    known = set(series_names()) | recorded()
    problems = []
    for panel in panels(dashboard()["panels"]):
        for target in panel["targets"]:
            for problem in unknown_names(target["expr"], known):
                problems.append(f"{panel['title']!r} [{target['refId']}]: {problem}")
    for variable in dashboard()["templating"]["list"]:
        for problem in unknown_names(json.dumps(variable.get("query", "")), known):
            problems.append(f"variable {variable['name']}: {problem}")
    assert not problems, (
        "the dashboard queries series no rtrl process exports (a counter is queried "
        "as <name>_total, a histogram as <name>_bucket/_count/_sum):\n" + "\n".join(problems)
    )


def test_the_dashboard_uses_only_labels_its_series_have() -> None:
    problems = []
    for panel in panels(dashboard()["panels"]):
        for target in panel["targets"]:
            legend = target.get("legendFormat", "")
            problems += [
                f"{panel['title']!r} [{target['refId']}]: {p}" for p in unknown_labels(target["expr"], legend)
            ]
    assert not problems, "labels that no family in the expression carries:\n" + "\n".join(problems)


def test_the_dashboard_answers_the_loop_questions() -> None:
    """A row per question the dashboard is for, each with panels under it."""
    titles = [p["title"].split(":")[0] for p in dashboard()["panels"] if p["type"] == "row"]
    assert titles == ["Traffic", "Feedback", "Training", "Gate", "Serving", "Improvement", "Processes"]


# ---- the alert rules ----------------------------------------------------------------------------


def test_the_alert_rules_use_only_metrics_rtrl_exports() -> None:
    assert rules(), f"{RULES.relative_to(ROOT)} has no rules"
    strict = set(series_names()) | recorded()
    # Annotations are prose: they may name a family as defined (without _total) too.
    loose = strict | set(exported())
    problems = []
    for rule in rules():
        what = f"group {rule['group']!r}, {'alert ' + rule['alert'] if 'alert' in rule else 'record ' + rule['record']}"
        expr = str(rule.get("expr", ""))
        assert expr.strip(), f"{what}: no expr"
        problems += [f"{what}: expr uses {p}" for p in unknown_names(expr, strict)]
        problems += [f"{what}: expr uses label {p}" for p in unknown_labels(expr)]
        for field in ("labels", "annotations"):
            problems += [
                f"{what}: {field} name {p}" for p in unknown_names(json.dumps(rule.get(field) or {}), loose)
            ]
    assert not problems, (
        f"{RULES.relative_to(ROOT)} refers to metrics rtrl does not export (see docs/metrics.md for the "
        "exported names; a counter is queried as <name>_total, a histogram as <name>_bucket/_count/_sum):\n"
        + "\n".join(problems)
    )


# ---- the scrape config and the reference ------------------------------------------------------


def test_prometheus_scrapes_every_process_on_its_default_port() -> None:
    config = yaml.safe_load(SCRAPE.read_text())
    assert config["global"]["scrape_interval"] == "15s"
    assert config["rule_files"] == ["rtrl.rules.yml"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == set(JOBS)
    for name, port in JOBS.items():
        targets = [t for static in jobs[name]["static_configs"] for t in static["targets"]]
        assert targets == [f"127.0.0.1:{port}"], f"{name}: {targets}"
    gateway_auth = jobs["rtrl-gateway"]["authorization"]
    assert gateway_auth["type"] == "Bearer" and gateway_auth["credentials_file"]


def test_docs_name_every_exported_family() -> None:
    text = DOC.read_text()
    missing = [
        f.queried_as
        for f in exported().values()
        if not re.search(rf"(?<![A-Za-z0-9_]){re.escape(f.queried_as)}(?![A-Za-z0-9_])", text)
    ]
    assert not missing, f"{DOC.relative_to(ROOT)} does not list: {', '.join(sorted(missing))}"
    stale = unknown_names(text, set(series_names()) | set(exported()))
    assert not stale, f"{DOC.relative_to(ROOT)} names metrics rtrl does not export: {', '.join(stale)}"
