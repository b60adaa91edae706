"""Starting rtrl's own processes as children, each with its settings handed to it explicitly.

`child_env` is the environment of every child rtrl starts (the supervisor's gateway, labeler,
worker and beat; `gateway_process` for tests and benchmarks): the parent's environment without
any ``RTRL_*`` variable, plus `schemas.settings.to_env` of the settings the child must run with.
The parent's own environment is never changed to do it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from schemas.clock import wait_until
from schemas.settings import Settings, to_env

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


def child_env(settings: Settings) -> dict[str, str]:
    """The environment in which ``load_settings()`` of a child process returns `settings`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")}
    env.update(to_env(settings), PYTHONUNBUFFERED="1")
    return env


def rtrl_command(*args: str) -> list[str]:
    """The command line of an ``rtrl`` subcommand, run by this interpreter."""
    return [sys.executable, "-m", "rtrl.cli", *args]


@contextmanager
def gateway_process(settings: Settings, log_path: Path) -> Iterator[str]:
    """Start ``rtrl gateway`` for `settings`, yield its base URL, stop it (SIGTERM) on exit.

    SIGTERM lets its publisher flush or spool what it holds.
    """
    url = f"http://{settings.gateway.host}:{settings.gateway.port}"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            rtrl_command("gateway"), env=child_env(settings), stdout=log, stderr=subprocess.STDOUT
        )
    try:

        def healthy() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"rtrl gateway exited with {proc.returncode}; see {log_path}")
            try:
                return httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, timeout_s=START_TIMEOUT_S, what=f"rtrl gateway not healthy (see {log_path})")
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
