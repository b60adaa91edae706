"""Several gateway processes on one port (ingest/prefork.py): the supervisor on real child processes,
the real gateway with two workers (no vLLM, no Kafka: neither is needed to serve /healthz and
/metrics), and the ``workers`` setting."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from helpers import alive
from pydantic import ValidationError

from ingest import prefork
from schemas.clock import wait_until
from schemas.settings import Settings
from schemas.settings.gateway import GatewaySettings
from services.launch import gateway_process
from services.testing import free_ports

pytestmark = pytest.mark.unit


# -- workers the tests run (module level: spawned processes import them by name) --


def sleeper(index: int, parent: int) -> None:
    """A worker that serves nothing, dies with its parent, and exits 0 on SIGTERM."""
    prefork.die_with_parent(parent)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    while True:
        time.sleep(1)


def crasher(index: int, parent: int) -> None:
    """A worker that cannot start (a bad configuration)."""
    sys.exit(3)


def crashes_once(marker: str, index: int, parent: int) -> None:
    """Dies on its first start (leaving `marker`), then sleeps like `sleeper`."""
    path = Path(marker) / f"worker-{index}"
    if not path.exists():
        path.touch()
        os._exit(1)
    sleeper(index, parent)


# -- the supervisor --


@pytest.fixture
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefork, "BACKOFF_S", (0.05,))


def test_a_worker_that_keeps_failing_to_start_stops_the_gateway_with_status_1(quick_backoff: None) -> None:
    exited: list[int] = []
    supervisor = prefork.Supervisor(crasher, lambda i: (i,), 2, stop_timeout_s=10, on_exit=exited.append)
    assert supervisor.run() == 1
    slot = next(s for s in supervisor.slots if s.failed_starts == prefork.MAX_FAILED_STARTS)
    assert len(slot.history) == prefork.MAX_FAILED_STARTS  # started, died, restarted, ..., given up
    assert all(not alive(pid) for s in supervisor.slots for pid in s.history)
    assert set(slot.history) <= set(exited)  # every dead worker's metrics are marked dead


def test_a_dead_worker_is_restarted_and_stop_drains_every_worker(quick_backoff: None, tmp_path: Path) -> None:
    exited: list[int] = []
    supervisor = prefork.Supervisor(
        crashes_once, lambda i: (str(tmp_path), i), 2, stop_timeout_s=10, on_exit=exited.append
    )
    status: list[int] = []
    runner = threading.Thread(target=lambda: status.append(supervisor.run()))
    runner.start()
    wait_until(
        lambda: all(len(s.history) == 2 and s.process is not None for s in supervisor.slots),
        timeout_s=30,
        what="both workers restarted once",
    )
    live = [s.process.pid for s in supervisor.slots if s.process is not None]
    supervisor.stop()
    runner.join(30)
    assert status == [0]
    assert all(not alive(pid) for pid in live if pid is not None)
    assert sorted(exited) == sorted(pid for s in supervisor.slots for pid in s.history)


SUPERVISED = """
import sys, time
from ingest import prefork
from test_ingest_prefork import sleeper
supervisor = prefork.Supervisor(sleeper, lambda i: (i,), 2, stop_timeout_s=10)
for slot in supervisor.slots:
    supervisor.start(slot)
print(" ".join(str(s.process.pid) for s in supervisor.slots), flush=True)
time.sleep(600)
"""


def test_workers_die_when_the_supervisor_is_killed() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISED], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(pid) for pid in pids)
        proc.kill()  # SIGKILL: no chance to stop its workers itself
        proc.wait()
        wait_until(lambda: not any(alive(pid) for pid in pids), timeout_s=10, what="orphaned workers gone")
    finally:
        proc.kill()
        proc.wait()


# -- the real gateway, two workers --


def gateway_settings(tmp_path: Path, workers: int) -> Settings:
    """A gateway in open mode whose vLLM server and Kafka broker are closed ports."""
    vllm_port, kafka_port, port = free_ports(3)
    base = Settings()
    return base.model_copy(
        update={
            "gateway": base.gateway.model_copy(
                update={
                    "port": port,
                    "workers": workers,
                    "auth": "open",
                    "spool_dir": tmp_path / "spool",
                    "shutdown_grace_s": 2.0,
                }
            ),
            "vllm": base.vllm.model_copy(
                update={"servers": (f"http://127.0.0.1:{vllm_port}",), "sampling_defaults": {}}
            ),
            "kafka": base.kafka.model_copy(update={"bootstrap_servers": f"127.0.0.1:{kafka_port}"}),
            "store": base.store.model_copy(update={"url": f"sqlite:///{tmp_path / 'store.db'}"}),
            "services": base.services.model_copy(update={"run_dir": tmp_path / "run"}),
        }
    )


def sample(page: str, name: str) -> float:
    """The value of the sample `name` (with its labels, as written) on a metrics page."""
    for line in page.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not on the page:\n{page}")


def test_two_workers_serve_one_port_and_metrics_sum_over_them(tmp_path: Path) -> None:
    settings = gateway_settings(tmp_path, workers=2)
    with gateway_process(settings, tmp_path / "gateway.log") as url:
        # New connections each: the kernel hands them to whichever worker is waiting in accept.
        for _ in range(40):
            assert httpx.get(f"{url}/v1/models").status_code == 200
        wait_until(
            lambda: {p.name for p in (tmp_path / "spool").iterdir()} == {"worker-0", "worker-1"},
            timeout_s=30,
            what="a spool per worker",
        )
        page = httpx.get(f"{url}/metrics").text
        ok = 'rtrl_gateway_requests_total{endpoint="models",status="200"}'
        assert sample(page, ok) == 40  # whichever worker served each, and whichever answers this
        # Gauges merge by their mode: one pool per worker, summed; the spool bound likewise.
        assert sample(page, "rtrl_gateway_upstream_connections") == 2 * settings.gateway.upstream_connections
        assert sample(page, "rtrl_gateway_spool_max_bytes") == 2 * settings.gateway.spool_max_bytes
        assert sample(page, "rtrl_gateway_kafka_connected") == 0  # no broker
        workers = _workers_in(tmp_path / "gateway.log")
        assert len(workers) == 2 and all(alive(pid) for pid in workers)
    assert not any(alive(pid) for pid in workers)  # SIGTERM to the supervisor drained and ended both


def _workers_in(log: Path) -> list[int]:
    """The pids of the workers the supervisor says it started (its log)."""
    found = re.findall(r"gateway worker \d+ started \(pid (\d+)\)", log.read_text())
    return [int(pid) for pid in found]


# -- the setting --


def test_workers_is_bounded_and_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert GatewaySettings().workers == 1
    for bad in (0, 65):
        with pytest.raises(ValidationError, match="workers"):
            GatewaySettings(workers=bad)
    monkeypatch.setenv("RTRL_GATEWAY__WORKERS", "4")
    assert Settings().gateway.workers == 4


def test_each_worker_gets_its_own_spool(tmp_path: Path) -> None:
    one = Settings().model_copy(update={"gateway": GatewaySettings(spool_dir=tmp_path)})
    assert prefork.worker_settings(one, 0).gateway.spool_dir == tmp_path
    two = Settings().model_copy(update={"gateway": GatewaySettings(spool_dir=tmp_path, workers=2)})
    assert prefork.worker_settings(two, 1).gateway.spool_dir == tmp_path / "worker-1"
    assert prefork.worker_settings(two, 1).gateway.workers == 2
