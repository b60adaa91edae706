"""`rtrl run`'s supervisor: a killed process is restarted, a crash-looping one is given up on,
and stop() leaves nothing running. Uses the real gateway process (it starts without a broker:
events would go to its spool), so no other service is needed."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from rtrl import supervisor as sup
from rtrl.services.testing import free_ports
from schemas.settings import GatewaySettings, KafkaSettings, ServicesSettings, Settings, VllmSettings, to_env

pytestmark = pytest.mark.integration


def _wait_ready(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} not healthy after {timeout_s}s")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_killed_process_is_restarted_and_stop_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port, closed = free_ports(2)
    settings = Settings(
        services=ServicesSettings(run_dir=tmp_path / "run"),
        gateway=GatewaySettings(port=port, spool_dir=tmp_path / "spool"),
        kafka=KafkaSettings(bootstrap_servers=f"127.0.0.1:{closed}"),
        vllm=VllmSettings(servers=(f"http://127.0.0.1:{closed}",), staging_server=None),
    )
    for key, value in to_env(settings).items():
        monkeypatch.setenv(key, value)
    supervisor = sup.Supervisor(settings, names=("gateway",))
    url = f"http://127.0.0.1:{port}"
    try:
        supervisor.start()
        _wait_ready(url)
        child = supervisor.children["gateway"]
        assert child.proc is not None
        first = child.proc.pid
        os.kill(first, signal.SIGKILL)
        child.proc.wait(timeout=10)
        assert supervisor.check() == ["gateway"]
        assert child.proc.pid != first
        _wait_ready(url)
    finally:
        supervisor.stop()
    assert not _alive(child.proc.pid)
    assert (tmp_path / "run" / "logs" / "gateway.log").stat().st_size > 0


def test_crash_looping_process_is_given_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `rtrl labeler` against a store URL it cannot open exits at once, every time.
    monkeypatch.setitem(sup.PROCESSES, "labeler", ["labeler"])
    monkeypatch.setattr(sup, "MAX_RESTARTS", 2)
    settings = Settings(services=ServicesSettings(run_dir=tmp_path / "run"))
    monkeypatch.setenv("RTRL_STORE__URL", "nosuchdialect:///x")
    supervisor = sup.Supervisor(settings, names=("labeler",))
    try:
        supervisor.start()
        deadline = time.monotonic() + 120
        while not supervisor.failed() and time.monotonic() < deadline:
            supervisor.check()
            time.sleep(0.2)
        assert supervisor.failed() == ["labeler"]
        assert len(supervisor.children["labeler"].restarts) == 2
    finally:
        supervisor.stop()
