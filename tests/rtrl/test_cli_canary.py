"""``rtrl deploy canary status|stop`` on a SQLite store (no server: a canary's record and its
server's rotation row are all these commands read and change)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from services.launch import rtrl_command
from store import Store

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
CANARY = "http://127.0.0.1:18002"


def rtrl(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")}
    env = clean | {
        "RTRL_STORE__URL": f"sqlite:///{tmp_path / 'rtrl.db'}",
        "RTRL_VLLM__CANARY_SERVER": CANARY,
        "RTRL_GATE__CANARY__ENABLED": "true",
    }
    return subprocess.run(rtrl_command(*args), cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_status_shows_the_running_canary_and_stop_ends_one_nobody_runs(tmp_path: Path) -> None:
    with Store(f"sqlite:///{tmp_path / 'rtrl.db'}") as store:
        store.migrate()
        none = rtrl(tmp_path, "deploy", "canary", "stop")
        assert none.returncode == 1 and "no canary is running" in none.stderr, none.stderr
        record = store.start_canary("rtrl-tiny", 3, 2, CANARY, 0.1, 7)
        store.set_rotation(CANARY, True, "canary: serving v3")

        shown = rtrl(tmp_path, "deploy", "canary", "status")
        assert shown.returncode == 0, shown.stderr
        running = json.loads(shown.stdout.splitlines()[0])
        assert (running["canary"], running["version"], running["champion"], running["state"]) == (
            record.id,
            3,
            2,
            "running",
        )
        assert running["now"]["episodes"] == {"challenger": 0, "champion": 0}
        assert running["now"]["test"] == "continue"

        stopped = rtrl(tmp_path, "deploy", "canary", "stop", "--reason", "users complain", "--wait", "5")
        assert stopped.returncode == 0, stopped.stderr
        ended = json.loads(stopped.stdout.splitlines()[-1])
        assert ended["state"] == "stopped" and "users complain" in ended["reason"]
        assert not store.rotation()[CANARY].in_rotation
        again = rtrl(tmp_path, "deploy", "canary", "status")
        lines = [json.loads(line) for line in again.stdout.splitlines()]
        assert lines[0]["running"] is None and lines[1]["state"] == "stopped"
