"""Run ``rtrl gateway`` as a child process for a given `Settings` (tests, benchmarks, scripts).

`gateway_process` passes the settings to the child through ``RTRL_<SECTION>`` environment
variables (each section as JSON, which pydantic-settings reads back), waits for ``/healthz`` and
stops the child with SIGTERM on exit, so its publisher flushes or spools what it holds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from ingest import IngestError
from schemas.settings import Settings, to_env

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


@contextmanager
def gateway_process(settings: Settings, log_path: Path) -> Iterator[str]:
    """Start ``rtrl gateway`` for `settings`, yield its base URL, stop it (SIGTERM) on exit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")}
    env.update(to_env(settings), PYTHONUNBUFFERED="1")
    url = f"http://{settings.gateway.host}:{settings.gateway.port}"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rtrl.cli", "gateway"], env=env, stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise IngestError(f"rtrl gateway exited with {proc.returncode}; see {log_path}")
            try:
                if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise IngestError(f"rtrl gateway not healthy after {START_TIMEOUT_S}s; see {log_path}")
            time.sleep(0.2)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
