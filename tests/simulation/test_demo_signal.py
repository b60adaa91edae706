"""`rtrl demo` stopped with SIGTERM (a CI timeout, `kill`) stops the processes it started: before,
its gateway, labeler and worker outlived it and held their ports."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from factories import fresh_topics
from helpers import REPO, alive

from schemas.clock import wait_until
from schemas.settings import MetricsSettings, Settings, StoreSettings
from services.launch import child_env, rtrl_command
from services.testing import free_ports

pytestmark = pytest.mark.e2e


def test_sigterm_stops_the_demo_and_every_process_it_started(services: Settings, tmp_path: Path) -> None:
    settings = fresh_topics(services, prefix="sigterm").model_copy(
        update={
            "store": StoreSettings(url=f"sqlite:///{tmp_path / 'rtrl.db'}"),
            "mlflow": services.mlflow.model_copy(
                update={"model_name": f"rtrl-sigterm-{tmp_path.name[-12:]}"}
            ),
            "gateway": services.gateway.model_copy(
                update={"port": free_ports(1)[0], "spool_dir": tmp_path / "spool"}
            ),
            "metrics": MetricsSettings(supervisor_port=free_ports(1)[0]),
        }
    )
    err = tmp_path / "demo.err"
    with err.open("wb") as sink:
        demo = subprocess.Popen(
            rtrl_command("demo", "--cycles", "1"),
            cwd=REPO,
            env=child_env(settings),
            stdout=subprocess.DEVNULL,
            stderr=sink,
            start_new_session=True,
        )
    try:
        started: dict[str, int] = {}

        def children_started() -> bool:
            assert demo.poll() is None, err.read_text()[-4000:]
            started.update(
                {
                    name: int(pid)
                    for name, pid in re.findall(
                        r"started (gateway|labeler|worker) \(pid (\d+)\)", err.read_text()
                    )
                }
            )
            return len(started) == 3

        wait_until(children_started, timeout_s=300, interval_s=0.5, what="the demo started its processes")
        time.sleep(2)  # well inside the demo's loop
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(timeout=120) != 0
        wait_until(
            lambda: not any(alive(pid) for pid in started.values()),
            timeout_s=30,
            what=f"the demo's processes {started} stopped",
        )
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
