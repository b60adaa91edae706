"""`rtrl run`'s supervisor: a killed process is restarted, a crash-looping one is retried with
jittered backoff up to a cap without touching its siblings, stop() leaves nothing running, and
each child gets the supervisor's settings.
Uses the real gateway and labeler processes (the gateway starts without a broker: events would go
to its spool), so no other service is needed."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from pathlib import Path

import httpx
import pytest
from factories import FakeMonotonic
from helpers import alive
from prometheus_client import REGISTRY

from schemas.clock import wait_until
from schemas.settings import (
    GatewaySettings,
    KafkaSettings,
    ServicesSettings,
    Settings,
    StoreSettings,
    VllmSettings,
)
from services import supervisor as sup
from services.testing import free_ports

pytestmark = pytest.mark.integration


def _wait_ready(url: str, timeout_s: float = 120.0) -> None:
    def healthy() -> bool:
        try:
            return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(healthy, timeout_s=timeout_s, interval_s=0.5, what=f"{url} healthy")


def _gateway_without_services(tmp_path: Path) -> tuple[Settings, int, int]:
    """Settings for a gateway on a free port whose Kafka and vLLM addresses answer nothing (its
    events go to the spool), the port, and the closed port."""
    port, closed = free_ports(2)
    settings = Settings(
        services=ServicesSettings(run_dir=tmp_path / "run"),
        gateway=GatewaySettings(port=port, spool_dir=tmp_path / "spool"),
        kafka=KafkaSettings(bootstrap_servers=f"127.0.0.1:{closed}"),
        vllm=VllmSettings(servers=(f"http://127.0.0.1:{closed}",), staging_server=None),
        store=StoreSettings(url=f"sqlite:///{tmp_path}/rtrl.db"),
    )
    return settings, port, closed


def test_killed_process_is_restarted_and_stop_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings, port, closed = _gateway_without_services(tmp_path)
    # What the supervisor hands the child wins over anything in the supervisor's own environment.
    monkeypatch.setenv("RTRL_GATEWAY__PORT", str(closed))
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
        state = json.loads(supervisor.state_path.read_text())  # what `rtrl status` reads
        assert state["pid"] == os.getpid() and not state["stopped"]
        assert state["children"]["gateway"] | {"log": None} == {
            "pid": child.proc.pid,
            "running": True,
            "restarts_recent": 1,
            "crash_looping": False,
            "last_exit_code": -9,
            "waiting_for_prepare": False,
            "log": None,
        }
    finally:
        supervisor.stop()
    assert json.loads(supervisor.state_path.read_text())["stopped"] is True
    assert not alive(child.proc.pid)
    assert (tmp_path / "run" / "logs" / "gateway.log").stat().st_size > 0


def test_a_crash_looping_process_is_retried_at_the_cap_and_never_stops_its_siblings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `rtrl labeler` against a store URL it cannot open exits at once, every time; the reconciler
    # meets the same store (and no MLflow) and only logs it each tick: it keeps running.
    monkeypatch.setattr(sup, "MAX_RESTARTS", 3)
    settings = Settings(
        services=ServicesSettings(run_dir=tmp_path / "run"), store=StoreSettings(url="nosuchdialect:///x")
    )
    clock = FakeMonotonic()
    supervisor = sup.Supervisor(settings, names=("labeler", "reconciler"), monotonic=clock, draw=lambda: 0.5)
    child, sibling = supervisor.children["labeler"], supervisor.children["reconciler"]
    restarted_at: list[float] = []

    def exited() -> bool:
        return child.proc is not None and child.proc.poll() is not None

    try:
        supervisor.start()
        assert sibling.proc is not None
        sibling_pid = sibling.proc.pid
        while len(restarted_at) < 5:
            wait_until(exited, timeout_s=120, what="labeler exiting")
            if supervisor.check():
                restarted_at.append(clock())
            else:
                clock.now = child.restart_at or clock.now  # not due yet: move time to when it is
        # at once, then after 1 s and 2 s (doubling); then crash-looping, retried at the 60 s cap
        assert restarted_at == [0.0, 1.0, 3.0, 63.0, 123.0]
        assert supervisor.crash_looping() == ["labeler"]
        assert REGISTRY.get_sample_value("rtrl_supervisor_child_crash_looping", {"child": "labeler"}) == 1
        assert REGISTRY.get_sample_value("rtrl_supervisor_child_crash_looping", {"child": "reconciler"}) == 0
        assert sibling.running and sibling.proc.pid == sibling_pid and sibling.restarts == []  # untouched
        log = child.log_path.read_text()
        assert log.count("rtrl: unsupported store URL 'nosuchdialect:///x'; set RTRL_STORE__URL") >= 5
        assert "Traceback" not in log  # an operator error is one line, not a traceback
    finally:
        supervisor.stop()


def test_a_crash_looping_process_that_stays_up_has_recovered(tmp_path: Path) -> None:
    """Once a crash-looping process has run longer than the retry interval since its last restart,
    it is no longer reported as crash-looping (nor its gauge set)."""
    settings = Settings(services=ServicesSettings(run_dir=tmp_path / "run"))
    clock = FakeMonotonic()
    supervisor = sup.Supervisor(settings, names=("beat",), monotonic=clock, draw=lambda: 0.5)
    child = supervisor.children["beat"]
    child.argv = ["sleep", "600"]  # a process that stays up
    try:
        supervisor.start()
        child.crash_looping, child.restarts = True, [0.0]
        clock.now = sup.BACKOFF_MAX_S - 1
        supervisor.check()
        assert supervisor.crash_looping() == ["beat"]  # not up long enough yet
        clock.now = sup.BACKOFF_MAX_S + 1
        supervisor.check()
        assert supervisor.crash_looping() == []
        assert REGISTRY.get_sample_value("rtrl_supervisor_child_crash_looping", {"child": "beat"}) == 0
    finally:
        supervisor.stop()


def test_the_gateway_serves_while_the_dependencies_are_down_and_the_rest_start_once_prepared(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`rtrl run`'s start with its dependencies down: `prepare` fails (the store unreachable) and is
    retried with backoff; meanwhile the gateway is up and answers, and the labeler waits. Once
    `prepare` succeeds, the next check starts the labeler."""
    settings, port, closed = _gateway_without_services(tmp_path)
    release = threading.Event()
    attempts: list[int] = []

    def prepare() -> None:
        attempts.append(1)
        if not release.is_set():
            raise ConnectionError("the store at 127.0.0.1:15432 refused the connection")

    supervisor = sup.Supervisor(
        settings, names=("gateway", "labeler"), draw=lambda: 0.5, prerequisite=prepare
    )
    gateway, labeler = supervisor.children["gateway"], supervisor.children["labeler"]
    caplog.set_level(logging.INFO, logger="services.supervisor")
    try:
        supervisor.start()
        _wait_ready(f"http://127.0.0.1:{port}")  # serving while nothing is prepared
        assert supervisor.check() == [] and labeler.proc is None and not supervisor.prepared.is_set()
        wait_until(lambda: len(attempts) >= 2, timeout_s=30, what="prepare retried")
        assert (
            "waiting for the loop's dependencies: the store at 127.0.0.1:15432 refused the connection"
            in caplog.text
        )
        release.set()
        wait_until(supervisor.prepared.is_set, timeout_s=30, what="prepare succeeding")
        supervisor.check()
        assert labeler.proc is not None and gateway.restarts == []
    finally:
        supervisor.stop()


@pytest.mark.unit
def test_restart_delay_doubles_up_to_the_cap_with_jitter() -> None:
    assert [sup.restart_delay(n, lambda: 0.5) for n in range(9)] == [
        0.0,
        1.0,
        2.0,
        4.0,
        8.0,
        16.0,
        32.0,
        60.0,
        60.0,
    ]
    assert sup.restart_delay(3, lambda: 0.0) == 3.0 and sup.restart_delay(
        3, lambda: 0.999999
    ) == pytest.approx(5.0)
    assert sup.restart_delay(0, lambda: 0.9) == 0.0  # the first restart is immediate
