"""``rtrl deploy canary status|stop``, and the canary's server in ``rtrl deploy rotation``, on a
SQLite store (no server: a canary's record and its server's rotation row are all these commands
read and change)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

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
        assert running["now"]["requests"]["canary"] == {"requests": 0, "errors": 0, "p95_s": None}

        stopped = rtrl(tmp_path, "deploy", "canary", "stop", "--reason", "users complain", "--wait", "5")
        assert stopped.returncode == 0, stopped.stderr
        ended = json.loads(stopped.stdout.splitlines()[-1])
        assert ended["state"] == "stopped" and "users complain" in ended["reason"]
        assert not store.rotation()[CANARY].in_rotation
        again = rtrl(tmp_path, "deploy", "canary", "status")
        lines = [json.loads(line) for line in again.stdout.splitlines()]
        assert lines[0]["running"] is None and lines[1]["state"] == "stopped"


def test_rotation_lists_the_canary_server_and_the_canary_running_on_it(tmp_path: Path) -> None:
    def rotation() -> list[dict[str, Any]]:
        result = rtrl(tmp_path, "deploy", "rotation")
        assert result.returncode == 0, result.stderr
        return [json.loads(line) for line in result.stdout.splitlines()]

    with Store(f"sqlite:///{tmp_path / 'rtrl.db'}") as store:
        store.migrate()
        fleet, canary = rotation()
        assert (fleet["url"], fleet["role"], fleet["in_rotation"]) == (
            "http://127.0.0.1:18000",
            "serving",
            True,
        )
        # No row: no canary ever put its server in, so the gateways send it nobody.
        assert (canary["url"], canary["role"], canary["in_rotation"], canary["running_canary"]) == (
            CANARY,
            "canary",
            False,
            None,
        )

        record = store.start_canary("rtrl-tiny", 3, 2, CANARY, 0.1, 7)
        store.set_rotation(CANARY, True, "canary: serving v3")
        store.set_serving_version(CANARY, 3, "canary: label verified")
        _, canary = rotation()
        assert (canary["in_rotation"], canary["reason"], canary["announced_version"]) == (
            True,
            "canary: label verified",
            "v3",
        )
        assert canary["running_canary"] == {
            "canary": record.id,
            "version": 3,
            "champion": 2,
            "share": 0.1,
            "started_at": record.started_at.isoformat(),
            "stop_requested_by": None,
        }

        store.end_canary(record.id, "failed", "lost live", None)
        store.set_rotation(CANARY, False, f"canary #{record.id} of v3 ended")
        _, canary = rotation()
        assert (canary["in_rotation"], canary["running_canary"]) == (False, None)

        # A canary still running on the server of an earlier setting is listed too.
        moved = store.start_canary("rtrl-tiny", 4, 2, "http://127.0.0.1:18003", 0.1, 8)
        _, canary, earlier = rotation()
        assert (canary["url"], canary["running_canary"]) == (CANARY, None)
        assert (earlier["url"], earlier["role"], earlier["running_canary"]["canary"]) == (
            "http://127.0.0.1:18003",
            "canary",
            moved.id,
        )


def test_rotation_by_hand_on_the_canary_server_is_refused_in_one_line(tmp_path: Path) -> None:
    with Store(f"sqlite:///{tmp_path / 'rtrl.db'}") as store:
        store.migrate()
        store.start_canary("rtrl-tiny", 3, 2, CANARY, 0.1, 7)
        store.set_rotation(CANARY, True, "canary: serving v3")
        for way in ("--out", "--in"):
            refused = rtrl(tmp_path, "deploy", "rotation", CANARY + "/", way, "--reason", "maintenance")
            assert refused.returncode == 1 and refused.stdout == "", refused.stdout
            (line,) = refused.stderr.strip().splitlines()
            assert line == (
                f"rtrl: {CANARY}/ is the live canary's server, which the canary's runner takes in and out of "
                "rotation; `rtrl deploy canary stop` ends a running canary and takes it out"
            )
        row = store.rotation()[CANARY]
        assert (row.in_rotation, row.reason) == (True, "canary: serving v3")  # untouched
        running = store.running_canary()
        assert running is not None and running.stop_requested_at is None
