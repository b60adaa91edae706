"""``rtrl status``: the loop on one screen, from the real services; a part that cannot be read is
reported, not fatal; problems make the exit code 1."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest
from factories import fresh_topics
from helpers import run_rtrl

from rtrl.status import render
from schemas.settings import Settings

pytestmark = pytest.mark.integration


def test_status_reports_every_part_and_the_problems(
    services: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    import streams
    from deployer import rollout
    from registry import Registry

    tag = uuid.uuid4().hex[:8]
    settings = fresh_topics(services, prefix="status").model_copy(
        update={
            "mlflow": services.mlflow.model_copy(
                update={"model_name": f"status-{tag}", "experiment": f"status-{tag}"}
            ),
        }
    )
    streams.ensure_topics(settings.kafka)  # empty topics of its own: the session's carry other tests' records
    registry = Registry.from_settings(settings)
    rollout.bootstrap(settings, registry, tiny_model_dir)

    # No `rtrl run` yet: everything else is healthy, so that is the one problem.
    proc = run_rtrl(settings, "status", "--json", timeout_s=300)
    report = json.loads(proc.stdout)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert [p for p in report["problems"] if "rtrl run is not running" not in p] == [], report["problems"]
    assert {s["name"] for s in report["services"] if s["healthy"]} >= {
        "kafka",
        "postgres",
        "redis",
        "mlflow",
        "vllm",
    }
    assert report["registry"]["champion"] == 1
    assert report["labeler"] == {
        "pending": 0,
        "produced": 0,
        "stored": 0,
        "dead_lettered": 0,
        "balanced": True,
        "judging": 0,
    }
    assert [(r["role"], r["version"], r["paused"]) for r in report["fleet"]] == [
        ("serving", 1, False),
        ("staging", 1, False),
    ]
    assert report["trainer"]["running"] == [] and report["trainer"]["paused"] is False

    # A daemon whose state says a child is crash-looping, and the text screen.
    state = {
        "pid": os.getpid(),
        "updated_at": time.time(),
        "stopped": False,
        "prepared": True,
        "children": {
            "gateway": {
                "pid": 1,
                "running": True,
                "restarts_recent": 0,
                "crash_looping": False,
                "last_exit_code": None,
                "waiting_for_prepare": False,
                "log": "g.log",
            },
            "labeler": {
                "pid": None,
                "running": False,
                "restarts_recent": 5,
                "crash_looping": True,
                "last_exit_code": 1,
                "waiting_for_prepare": False,
                "log": "l.log",
            },
        },
    }
    run_dir = Path(settings.services.run_dir)
    (run_dir / "supervisor.json").write_text(json.dumps(state))
    try:
        text = run_rtrl(settings, "status", timeout_s=300)
    finally:
        (run_dir / "supervisor.json").unlink()
    assert text.returncode == 1
    print(text.stdout)
    assert "labeler is crash-looping (last exit code 1); see l.log" in text.stdout
    assert "daemon    rtrl run pid" in text.stdout and "labeler DOWN (5 restarts)" in text.stdout
    assert "registry  @champion v1" in text.stdout and "problems  1" in text.stdout


@pytest.mark.unit
def test_a_part_that_cannot_be_read_is_shown_as_such() -> None:
    report = {
        "services": {"error": "boom"},
        "daemon": {"running": False},
        "labeler": {"pending": 3, "produced": 10, "stored": 7, "dead_lettered": 0, "balanced": False},
        "trainer": {
            "paused": {"since": "2026-12-01T00:00:00Z", "reason": "maintenance"},
            "running": [],
            "last": None,
        },
        "registry": {"champion": None, "latest": None},
        "fleet": [],
        "problems": ["x"],
    }
    text = render(report)
    assert "services  cannot read: boom" in text and "daemon    not running" in text
    assert (
        "lag 3" in text
        and "NOT balanced" in text
        and "PAUSED since 2026-12-01T00:00:00Z (maintenance)" in text
    )
    assert "registry  empty" in text and "problems  1\n  - x" in text


@pytest.mark.unit
def test_the_deploy_locks_held_are_shown_and_stale_rows_are_not() -> None:
    down = {"error": "down"}
    report = {
        "services": down,
        "daemon": down,
        "labeler": down,
        "trainer": down,
        "registry": down,
        "fleet": down,
        "problems": [],
        "locks": [
            {
                "name": "rollout",
                "holder": "node-a:41",
                "purpose": "promote v3",
                "since": "2026-12-03T10:00:00+00:00",
                "held": True,
            },
            {
                "name": "staging",
                "holder": "node-b:7",
                "purpose": "gate v3",
                "since": "2026-12-02T09:00:00+00:00",
                "held": False,
            },
        ],
    }
    text = render(report)
    assert "locks     rollout held by node-a:41 (promote v3) since 2026-12-03T10:00:00+00:00\n" in text
    assert "node-b" not in text  # its holder was killed: the lock is free
    assert "locks     none held" in render({**report, "locks": []})


@pytest.mark.unit
def test_the_services_line_says_when_none_is_enabled() -> None:
    base = {
        "services": [],
        "daemon": {"running": False},
        "labeler": {"pending": 0, "produced": 0, "stored": 0, "dead_lettered": 0, "balanced": True},
        "trainer": {"paused": False, "running": [], "last": None},
        "registry": {"champion": None, "latest": None},
        "fleet": [],
        "problems": [],
    }
    assert "services  none enabled" in render(base).splitlines()
    two = [
        {"name": "kafka", "healthy": True, "pid": 1, "detail": ""},
        {"name": "redis", "healthy": False, "pid": None, "detail": "not running"},
    ]
    assert "services  kafka ok · redis not running" in render({**base, "services": two}).splitlines()


@pytest.mark.unit
@pytest.mark.parametrize(
    ("running", "version", "in_rotation", "problem"),
    [
        (False, 1, False, None),  # idle between canaries: out of rotation, whatever it holds
        (False, 1, True, "is in rotation but no canary runs"),
        (True, 2, True, None),  # serving its canary's challenger
        (True, 1, True, "serves 1 but canary #1 runs v2"),
        (True, 1, False, None),  # still loading the challenger, out of rotation
    ],
)
def test_the_canary_server_is_judged_by_the_canary_it_serves_not_by_champion(
    tmp_path: Path, running: bool, version: int, in_rotation: bool, problem: str | None
) -> None:
    from rtrl.status import _canary_problems, _fleet_lines
    from store import Store

    url = "http://127.0.0.1:8009"
    store = Store(f"sqlite:///{tmp_path / 'rtrl.db'}")
    store.migrate()
    if running:
        store.start_canary("policy", 2, 1, url, 0.1)
    row = {"url": url, "role": "canary", "version": version, "paused": False, "in_rotation": in_rotation}
    problems: list[str] = []
    _canary_problems(store, row, problems)
    store.close()
    assert [p for p in problems if problem and problem in p] == problems
    assert len(problems) == (problem is not None)
    (line,) = _fleet_lines([row])
    assert line.startswith(f"fleet     canary   {url}  v{version}")
    assert line.endswith(" (canary #1 of v2)" if running else ", idle")
