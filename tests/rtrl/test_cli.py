"""The ``rtrl`` command line: a mistake the operator can fix is one line and exit 1; ``--debug``
shows the traceback; ``--help`` answers without importing the heavy stack."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.launch import rtrl_command
from services.testing import free_ports

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def rtrl(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")}
    return subprocess.run(
        rtrl_command(*args), cwd=REPO, env=clean | env, capture_output=True, text=True, timeout=120
    )


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rtrl: "), result.stderr
    return lines[0]


def test_a_bad_setting_is_one_line_and_debug_shows_the_traceback() -> None:
    line = one_line_error(rtrl("config", "show", RTRL_TRAINER__LOSS__TYPE="reinforce"))
    assert "RTRL_TRAINER__LOSS__TYPE" in line and "'cispo', 'ppo', 'grpo'" in line
    debug = rtrl("--debug", "config", "show", RTRL_TRAINER__LOSS__TYPE="reinforce")
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "SettingsError" in debug.stderr


def test_an_unknown_task_fails_before_anything_starts(tmp_path: Path) -> None:
    line = one_line_error(rtrl("demo", "--task", "nope", RTRL_SERVICES__RUN_DIR=str(tmp_path)))
    assert line == "rtrl: unknown task 'nope'; known tasks: exclaim, lookup"
    assert not (tmp_path / "pids").exists()  # no service was started


def test_the_tools_scenario_needs_a_task_with_tools(tmp_path: Path) -> None:
    line = one_line_error(
        rtrl("demo", "--scenario", "tools", "--task", "exclaim", RTRL_SERVICES__RUN_DIR=str(tmp_path))
    )
    assert line == "rtrl: --scenario tools needs a task with tools (--task lookup), not 'exclaim'"
    assert not (tmp_path / "pids").exists() and not (tmp_path / "models").exists()  # nothing started or built


def test_services_that_do_not_answer_are_one_line(tmp_path: Path) -> None:
    (closed,) = free_ports(1)
    mlflow = one_line_error(
        rtrl(
            "deploy",
            "status",
            RTRL_MLFLOW__TRACKING_URI=f"http://127.0.0.1:{closed}",
            MLFLOW_HTTP_REQUEST_MAX_RETRIES="0",
            RTRL_SERVICES__RUN_DIR=str(tmp_path),
        )
    )
    assert (
        f"MLflow at http://127.0.0.1:{closed} does not answer" in mlflow
        and "RTRL_MLFLOW__TRACKING_URI" in mlflow
    )
    unreachable_db = f"postgresql+psycopg://rtrl@127.0.0.1:{closed}/rtrl"
    for command in (("train", "status"), ("labeler", "migrate")):
        store = one_line_error(rtrl(*command, RTRL_STORE__URL=unreachable_db))
        assert "is unreachable or locked" in store and "RTRL_STORE__URL" in store
    db = f"sqlite:///{tmp_path}/rtrl.db"
    assert rtrl("labeler", "migrate", RTRL_STORE__URL=db).returncode == 0
    kafka = one_line_error(
        rtrl(
            "labeler",
            "reconcile",
            RTRL_STORE__URL=db,
            RTRL_KAFKA__BOOTSTRAP_SERVERS=f"127.0.0.1:{closed}",
            RTRL_KAFKA__BOOTSTRAP_TIMEOUT_MS="1000",
        )
    )
    assert f"cannot reach Kafka at 127.0.0.1:{closed}" in kafka and "RTRL_KAFKA__BOOTSTRAP_SERVERS" in kafka


def test_rtrl_run_refuses_a_malformed_store_url_at_once(tmp_path: Path) -> None:
    """A store that is down is waited for (the supervisor retries `prepare`); a URL that can never
    work is a mistake to fix now."""
    line = one_line_error(
        rtrl("run", RTRL_STORE__URL="nosuchdialect:///x", RTRL_SERVICES__RUN_DIR=str(tmp_path))
    )
    assert "unsupported store URL 'nosuchdialect:///x'" in line and not (tmp_path / "logs").exists()


def test_rtrl_run_without_the_local_postgres_says_how_to_start_it(tmp_path: Path) -> None:
    """The default store is the local PostgreSQL: when this run dir never started it, nothing will,
    so `rtrl run` says what to do at once instead of waiting."""
    (closed,) = free_ports(1)
    line = one_line_error(
        rtrl("run", RTRL_SERVICES__POSTGRES_PORT=str(closed), RTRL_SERVICES__RUN_DIR=str(tmp_path))
    )
    assert line == (
        f"rtrl: store postgresql+psycopg://rtrl@127.0.0.1:{closed}/rtrl unreachable: start it with "
        "`rtrl services up` or set RTRL_STORE__URL"
    )
    assert not (tmp_path / "logs").exists()
    # The operator commands share the default, and say so in one line too.
    store = one_line_error(rtrl("train", "status", RTRL_SERVICES__POSTGRES_PORT=str(closed)))
    assert (
        f"postgresql+psycopg://rtrl@127.0.0.1:{closed}/rtrl is unreachable" in store
        and "RTRL_STORE__URL" in store
    )


def test_rtrl_run_refuses_a_judged_reward_spec_without_its_judge_at_once(tmp_path: Path) -> None:
    line = one_line_error(
        rtrl("run", RTRL_LABELER__REWARD_SPEC="judged-v1", RTRL_SERVICES__RUN_DIR=str(tmp_path))
    )
    assert "judged-v1@1 has a judge term" in line and "RTRL_LABELER__JUDGE__URL" in line
    assert not (tmp_path / "logs").exists()
    line = one_line_error(rtrl("run", RTRL_LABELER__REWARD_SPEC="nope", RTRL_SERVICES__RUN_DIR=str(tmp_path)))
    assert "unknown reward spec 'nope'" in line


def test_a_store_that_was_never_migrated_is_one_line(tmp_path: Path) -> None:
    line = one_line_error(rtrl("train", "status", RTRL_STORE__URL=f"sqlite:///{tmp_path}/none.db"))
    assert "run `rtrl labeler migrate`" in line and not (tmp_path / "none.db").exists()


def test_rotation_by_hand(tmp_path: Path) -> None:
    import json

    env = {
        "RTRL_STORE__URL": f"sqlite:///{tmp_path}/rtrl.db",
        "RTRL_VLLM__SERVERS": '["http://127.0.0.1:1", "http://127.0.0.1:2"]',
    }
    assert "run `rtrl labeler migrate`" in one_line_error(rtrl("deploy", "rotation", **env))
    assert rtrl("labeler", "migrate", **env).returncode == 0
    out = rtrl("deploy", "rotation", "http://127.0.0.1:2", "--out", "--reason", "maintenance", **env)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(r["url"], r["role"], r["in_rotation"], r["reason"]) for r in rows] == [
        ("http://127.0.0.1:1", "serving", True, None),
        ("http://127.0.0.1:2", "serving", False, "maintenance"),
    ]  # no canary server configured: no canary line
    assert [(r["announced_version"], r["announced_epoch"]) for r in rows] == [(None, None), (None, 0)]
    unknown = rtrl("deploy", "rotation", "http://elsewhere:1", "--in", **env)
    assert unknown.returncode == 2 and "is not a serving server" in unknown.stderr
    back = rtrl("deploy", "rotation", "http://127.0.0.1:2", "--in", **env)
    assert all(json.loads(line)["in_rotation"] for line in back.stdout.splitlines())


def test_help_does_not_import_the_heavy_stack() -> None:
    code = (
        "import sys; from rtrl.cli import app; "
        "print(sorted(m for m in ('torch', 'vllm', 'mlflow', 'kafka', 'deepspeed', 'sqlalchemy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_quarantined_episodes_are_listed_and_released(tmp_path: Path) -> None:
    import json

    from factories import Feeder, feedback, interaction

    from store import Store

    env = {"RTRL_STORE__URL": f"sqlite:///{tmp_path}/rtrl.db"}
    with Store(env["RTRL_STORE__URL"]) as store:
        store.migrate()
        feeder = Feeder(store)
        for name in ("e1", "e2"):
            feeder.send(interaction(name), feedback(f"r-{name}-0", "edit_persisted"))
        cycle = store.acquire_cycle("w", 60, 1)
        assert cycle is not None
        store.mark_used(cycle, ["e1", "e2"])
        store.finish_cycle(cycle, "failed", error="IndexError: index out of range", max_episode_failures=1)
    listed = rtrl("dlq", "episodes", **env)
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(r["episode_id"], r["failed_cycles"]) for r in rows] == [("e1", 1), ("e2", 1)]
    assert rows[0]["reason"] == f"cycle {cycle} failed: IndexError: index out of range"
    released = rtrl("dlq", "episodes", "--release", "e2", **env)
    assert released.returncode == 0 and released.stdout == "e2: released; trainable again\n"
    line = one_line_error(
        rtrl("dlq", "episodes", "--release", "e1", "--release", "e2", "--release", "nope", **env)
    )
    assert line == "rtrl: not quarantined: 'e2', 'nope' (see `rtrl dlq episodes` for the ids)"
    assert rtrl("dlq", "episodes", **env).stdout == ""  # e1 was released before the error


def test_a_tenant_adapter_is_switched_on_within_the_servers_capacity(tmp_path: Path) -> None:
    import json

    env = {
        "RTRL_STORE__URL": f"sqlite:///{tmp_path}/rtrl.db",
        "RTRL_TRAINER__ADAPTER": "lora",
        "RTRL_VLLM__MAX_LORAS": "2",
    }
    on = rtrl("tenants", "set", "acme", "--adapter", **env)
    assert on.returncode == 0, on.stderr
    assert json.loads(on.stdout) == {
        "tenant": "acme",
        "trains": True,
        "train_redacted": False,
        "adapter": True,
    }
    assert (
        rtrl("tenants", "set", "acme", "--adapter", **env).returncode == 0
    )  # again: still one adapter tenant
    line = one_line_error(rtrl("tenants", "set", "bolt", "--adapter", **env))
    assert "vllm.max_loras >= 3, but it is 2" in line
    full = one_line_error(
        rtrl("tenants", "set", "bolt", "--adapter", **env | {"RTRL_TRAINER__ADAPTER": "full"})
    )
    assert "trainer.adapter=lora" in full
    assert rtrl("tenants", "set", "acme", "--no-adapter", **env).returncode == 0
    assert rtrl("tenants", "set", "bolt", "--adapter", **env).returncode == 0
    listed = [json.loads(x) for x in rtrl("tenants", "list", **env).stdout.splitlines()]
    assert [(t["tenant"], t["adapter"]) for t in listed] == [("acme", False), ("bolt", True)]


def test_a_tenant_rollback_needs_a_tenant_with_an_adapter(tmp_path: Path) -> None:
    env = {"RTRL_STORE__URL": f"sqlite:///{tmp_path}/rtrl.db", "RTRL_TRAINER__ADAPTER": "lora"}
    assert rtrl("labeler", "migrate", **env).returncode == 0
    refused = rtrl("deploy", "rollback", "--tenant", "acme", **env)
    assert refused.returncode == 2 and "has no adapter of its own" in refused.stderr, refused.stderr
