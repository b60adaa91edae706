"""`rtrl services up/status/down` through the real CLI: idempotent up, and down leaves nothing behind.

Runs its own mini deployment (Redis, and MLflow, whose server runs uvicorn as a child process, so
stopping the process group is what is tested) in its own run dir and ports, not the session's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.base import port_in_use
from services.testing import free_ports, make_run_dir

pytestmark = pytest.mark.integration

RTRL = [sys.executable, "-m", "rtrl.cli"]


@pytest.fixture()
def mini_env() -> Iterator[dict[str, str]]:
    run_dir = make_run_dir("rtrl-lifecycle-")
    redis_port, mlflow_port = free_ports(2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")}
    env.update(
        {
            "RTRL_SERVICES__RUN_DIR": str(run_dir),
            "RTRL_SERVICES__REDIS_PORT": str(redis_port),
            "RTRL_SERVICES__MLFLOW_PORT": str(mlflow_port),
            "RTRL_MLFLOW__BACKEND_STORE_URI": f"sqlite:///{run_dir}/mlflow/mlflow.db",
            "RTRL_MLFLOW__ARTIFACT_ROOT": str(run_dir / "mlflow" / "artifacts"),
            "RTRL_SERVICES__ENABLED": '["redis", "mlflow"]',
        }
    )
    yield env
    subprocess.run([*RTRL, "services", "down"], env=env, capture_output=True, timeout=120)
    shutil.rmtree(run_dir, ignore_errors=True)


def _rtrl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*RTRL, *args], env=env, capture_output=True, text=True, timeout=600)


def _processes_under(run_dir: Path) -> list[int]:
    """Pids whose working directory is inside run_dir (every service process runs in its data dir)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cwd = Path(os.readlink(proc / "cwd"))
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            continue
        if cwd == run_dir or run_dir in cwd.parents:
            pids.append(int(proc.name))
    return pids


def test_up_is_idempotent_and_down_leaves_no_process(mini_env: dict[str, str]) -> None:
    run_dir = Path(mini_env["RTRL_SERVICES__RUN_DIR"])
    ports = [int(mini_env["RTRL_SERVICES__REDIS_PORT"]), int(mini_env["RTRL_SERVICES__MLFLOW_PORT"])]

    first = _rtrl(mini_env, "services", "up")
    assert first.returncode == 0, first.stderr
    status = _rtrl(mini_env, "services", "status", "--json")
    assert status.returncode == 0, status.stdout + status.stderr
    rows = {row["name"]: row for row in json.loads(status.stdout)}
    assert set(rows) == {"redis", "mlflow"} and all(row["healthy"] for row in rows.values())
    # MLflow's server runs uvicorn as a child: more processes than services.
    assert len(_processes_under(run_dir)) > 2

    again = _rtrl(mini_env, "services", "up")
    assert again.returncode == 0, again.stderr
    assert "already running" in again.stderr
    again_rows = {
        row["name"]: row for row in json.loads(_rtrl(mini_env, "services", "status", "--json").stdout)
    }
    assert {n: r["pid"] for n, r in again_rows.items()} == {n: r["pid"] for n, r in rows.items()}

    down = _rtrl(mini_env, "services", "down")
    assert down.returncode == 0, down.stderr
    assert _processes_under(run_dir) == []
    assert not any(port_in_use("127.0.0.1", p) for p in ports)
    assert list((run_dir / "pids").iterdir()) == []
    after = _rtrl(mini_env, "services", "status", "--json")
    assert after.returncode == 1
    assert not any(row["healthy"] for row in json.loads(after.stdout))


def test_up_refuses_a_port_taken_by_another_process(mini_env: dict[str, str]) -> None:
    import socket

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", int(mini_env["RTRL_SERVICES__REDIS_PORT"])))
        squatter.listen()
        result = _rtrl(mini_env, "services", "up", "--only", "redis")
    assert result.returncode == 1
    assert "in use by a process this run dir" in result.stderr
    assert _processes_under(Path(mini_env["RTRL_SERVICES__RUN_DIR"])) == []


def test_a_failed_up_stops_what_it_started(mini_env: dict[str, str]) -> None:
    # Redis starts fine; MLflow cannot open its backend store and exits during start-up.
    env = mini_env | {
        "RTRL_MLFLOW__BACKEND_STORE_URI": "nosuchdb://nowhere",
        "RTRL_SERVICES__START_TIMEOUT_S": "90",
    }
    result = _rtrl(env, "services", "up")
    assert result.returncode == 1
    # One line from rtrl (followed by the tail of MLflow's own log, which may hold MLflow's traceback).
    assert "rtrl: mlflow: " in result.stderr and "rtrl/cli.py" not in result.stderr
    run_dir = Path(mini_env["RTRL_SERVICES__RUN_DIR"])
    assert _processes_under(run_dir) == []  # redis, started by this call, was stopped again
    assert "redis: stopped again (services up failed)" in result.stderr
