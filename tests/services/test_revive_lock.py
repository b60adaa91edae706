"""`services.revive.restart_lock`: two reconcilers' `Reviver`s that find the same local vLLM server
dead take turns restarting it, on SQLite and on the session's real PostgreSQL. Each caller opens
its own store (its own connection, or its own flock), as two reconciler processes would. The
server is a stale pid file in a run dir of the test's own (its process gone), and the restart
itself (`Reviver._restart`, which would start vLLM: tests/services/test_revive.py) is a recorded
pause; everything before it, the lock included, is the reviver's own."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest
from helpers import STORE_BACKENDS, migrated_store_url

from schemas.settings import ServicesSettings, Settings, StoreSettings
from services.revive import Reviver, restart_lock, restart_lock_name
from services.vllm import Vllm
from store import Store

SERVER = "http://127.0.0.1:8000"


@pytest.fixture(params=STORE_BACKENDS)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return migrated_store_url(request, tmp_path)


@pytest.mark.unit
def test_the_name_is_this_host_and_the_port_and_fits_a_file_name() -> None:
    name = restart_lock_name(SERVER)
    assert name.startswith("vllm-restart-8000-") and "/" not in name and len(name) <= 64
    assert restart_lock_name("http://127.0.0.1:8000/") == name == restart_lock_name("127.0.0.1:8000")
    assert restart_lock_name("http://127.0.0.1:8001") != name


def test_two_reconcilers_racing_on_one_dead_server_restart_it_once(url: str) -> None:
    """Both reach the lock at the same moment: one restarts (holding it for the restart, its holder
    recorded), the other skips at once; afterwards the lock is free, and another server's restart
    never waited on this one."""
    start = threading.Barrier(2)
    results: dict[str, bool] = {}
    took_s: dict[str, float] = {}

    def reconciler(name: str) -> None:
        start.wait(10)
        began = time.monotonic()
        with restart_lock(url, SERVER, f"restart vllm ({name})") as mine:
            results[name] = mine
            if mine:  # the restart: long enough for the other to meet the lock
                with restart_lock(url, "http://127.0.0.1:8001", "restart vllm-staging") as other:
                    assert other  # a different server is not blocked
                with Store(url) as store:
                    [holder] = store.lock_holders()
                    assert holder.name == restart_lock_name(SERVER) and holder.held
                    assert holder.purpose == f"restart vllm ({name})"
                time.sleep(0.5)
        took_s[name] = time.monotonic() - began

    threads = [threading.Thread(target=reconciler, args=(n,)) for n in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(results.values()) == [False, True], results
    skipped = next(n for n, mine in results.items() if not mine)
    assert took_s[skipped] < 0.4  # no wait: a held restart lock is skipped this tick
    with restart_lock(url, SERVER, "the next tick") as mine:
        assert mine
    with Store(url) as store:
        assert store.lock_holders() == []


def test_many_ticks_never_restart_one_server_twice_at_once(url: str) -> None:
    """Two callers ticking as fast as they can for a second: the restarts they held never overlap,
    and both got some (the lock is released after each)."""
    held: list[tuple[float, float, str]] = []
    deadline = time.monotonic() + 1.0

    def reconciler(name: str) -> None:
        while time.monotonic() < deadline:
            with restart_lock(url, SERVER, name) as mine:
                if mine:
                    began = time.monotonic()
                    time.sleep(0.01)
                    held.append((began, time.monotonic(), name))
            time.sleep(0.005)

    threads = [threading.Thread(target=reconciler, args=(n,)) for n in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    held.sort()
    assert {name for _, _, name in held} == {"a", "b"}
    for (_, end, _), (begin, _, _) in zip(held, held[1:], strict=False):
        assert end <= begin


class PausedRestart(Reviver):
    """A reviver whose restart of a server (the step that would start vLLM) is a pause, recorded."""

    def __init__(self, settings: Settings, restarts: list[tuple[float, float, str]], name: str) -> None:
        super().__init__(settings)
        self.restarts, self.name = restarts, name

    def _restart(self, unit: Vllm, reason: str) -> str | None:
        began = time.monotonic()
        time.sleep(0.5)
        self.restarts.append((began, time.monotonic(), self.name))
        return None


def dead_server(tmp_path: Path, url: str) -> Settings:
    """Settings whose run dir started one vLLM server that has since died: its pid file names a
    process that is gone (the reviver's "its process exited")."""
    settings = Settings(
        services=ServicesSettings(run_dir=tmp_path / "run", vllm_port=18999),
        store=StoreSettings(url=url),
    )
    unit = Vllm(settings)
    unit.pid_path.parent.mkdir(parents=True, exist_ok=True)
    # Above the kernel's largest pid (2**22): no process has it, so its start time never matches.
    unit.pid_path.write_text(json.dumps({"pid": 2**22 + 1, "start_ticks": 1, "cmd": ["vllm"]}))
    assert [u.name for u in Reviver(settings).managed()] == ["vllm"] and unit.status().pid is None
    return settings


def test_two_revivers_racing_on_one_dead_server_restart_it_once(
    url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two reconcilers' revivers on one run dir tick at the same moment and both find the server
    dead: one restarts it, the other skips it this tick (logged at info), counting no attempt."""
    settings = dead_server(tmp_path, url)
    restarts: list[tuple[float, float, str]] = []
    revivers = [PausedRestart(settings, restarts, n) for n in ("a", "b")]
    start = threading.Barrier(2)
    done: dict[str, dict[str, str | None]] = {}

    def tick(reviver: PausedRestart) -> None:
        start.wait(10)
        done[reviver.name] = reviver()

    caplog.set_level(logging.INFO, logger="services.revive")
    threads = [threading.Thread(target=tick, args=(r,)) for r in revivers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(restarts) == 1, restarts
    winner = restarts[0][2]
    loser = next(r for r in revivers if r.name != winner)
    assert done[winner] == {"http://127.0.0.1:18999": None} and done[loser.name] == {}
    assert "another reconciler is restarting it" in caplog.text
    assert loser._attempts["vllm"].count == 0  # skipped, not a failed attempt: no back-off
    assert loser() == {"http://127.0.0.1:18999": None}  # the next tick, the lock free: its turn
    assert len(restarts) == 2


@pytest.mark.unit
def test_an_unreachable_store_does_not_keep_a_dead_server_down() -> None:
    """No store, no lock: the restart goes ahead (logged) rather than waiting for the database."""
    with restart_lock("postgresql+psycopg://rtrl@127.0.0.1:1/rtrl", SERVER, "restart vllm") as mine:
        assert mine
