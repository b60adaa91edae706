"""`services.revive.Reviver` on the session's real vLLM servers: a hung server is restarted
once its health check has failed long enough, and nothing else is touched."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from schemas.clock import wait_until
from schemas.settings import ServicesSettings, Settings
from services import services as units
from services import up
from services.revive import Reviver
from serving import VllmClient

pytestmark = pytest.mark.integration


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_hung_server_is_restarted_after_its_grace_and_a_healthy_one_is_left_alone(
    vllm_service: Settings,
) -> None:
    """The staging server's processes are SIGSTOPped (alive, answering nothing). The first check
    only notes it; once `vllm_unhealthy_restart_s` has passed it is stopped and started again, and
    serves; the serving server, healthy throughout, keeps its process. A second failure right after
    waits for the back-off."""
    settings = vllm_service.model_copy(
        update={
            "services": ServicesSettings(
                **{**vllm_service.services.model_dump(), "vllm_unhealthy_restart_s": 60.0}
            ),
        }
    )
    serving_unit, staging_unit = units(settings, ("vllm",))
    assert staging_unit.name == "vllm-staging"
    serving_pid, hung_pid = serving_unit.pid(), staging_unit.pid()
    assert serving_pid is not None and hung_pid is not None
    clock = Clock()
    revive = Reviver(settings, clock=clock)
    assert revive() == {}  # all healthy
    os.killpg(hung_pid, signal.SIGSTOP)
    try:
        assert revive() == {}  # unhealthy for 0 s: noted, not restarted
        clock.now += 59
        assert revive() == {}
        clock.now += 2
        assert revive() == {staging_unit.address: None}
        assert staging_unit.pid() not in (None, hung_pid) and serving_unit.pid() == serving_pid
        with VllmClient(staging_unit.address, model=settings.vllm.served_model_name) as server:
            assert server.health() and server.weight_version() is None  # base weights, no label yet
            server.update_weight_version(1)  # as the reconciler would (the base model is v1 in tests)

        os.killpg(staging_unit.pid(), signal.SIGKILL)  # dies again at once: the back-off holds it
        # SIGKILL is delivered asynchronously: wait until the process has exited (and is reaped).
        wait_until(lambda: staging_unit.pid() is None, timeout_s=60, what="the killed staging server gone")
        clock.now += 1
        assert revive() == {} and staging_unit.pid() is None
        clock.now += 30
        assert revive() == {staging_unit.address: None}
        with VllmClient(staging_unit.address, model=settings.vllm.served_model_name) as server:
            server.update_weight_version(1)
    finally:
        try:
            os.killpg(hung_pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        up(vllm_service, only=("vllm",))  # whatever happened above, both servers run again
    for unit in (serving_unit, staging_unit):
        with VllmClient(unit.address, model=settings.vllm.served_model_name) as server:
            if server.weight_version() is None:
                server.update_weight_version(1)


def test_nothing_is_restarted_when_turned_off_or_not_started_here(
    vllm_service: Settings, tmp_path: Path
) -> None:
    """`services.restart_vllm = false`, or a run dir that did not start the servers (no pid files):
    the reviver touches nothing."""
    off = vllm_service.model_copy(
        update={
            "services": ServicesSettings(**{**vllm_service.services.model_dump(), "restart_vllm": False}),
        }
    )
    assert Reviver(off)() == {}
    elsewhere = vllm_service.model_copy(
        update={
            "services": ServicesSettings(
                **{**vllm_service.services.model_dump(), "run_dir": tmp_path / "run"}
            ),
        }
    )
    assert Reviver(elsewhere).managed() == [] and Reviver(elsewhere)() == {}
