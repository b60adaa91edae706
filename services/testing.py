"""Helpers for running the local services in tests and scripts: free ports, run dirs, Settings.

Used by tests/conftest.py (the session-wide `services` fixture) and by anyone who needs a private
deployment on ports that do not collide with the dev instance or another test run:

    with private_services("rtrl-x-", enabled=("kafka",)) as settings:
        services.up(settings); ...  # stopped, and the run dir removed, on exit
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from pydantic import SecretStr

from schemas.settings import (
    CelerySettings,
    GatewaySettings,
    KafkaSettings,
    MlflowSettings,
    ServicesSettings,
    Settings,
    TrainerSettings,
    VllmSettings,
    embedded_databases,
)

from .base import run_dir

HOST = "127.0.0.1"


def free_ports(n: int, host: str = HOST) -> list[int]:
    """`n` distinct ports that are free right now (all held open at once, so no duplicates)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for sock in socks:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]


def make_run_dir(prefix: str) -> Path:
    """A fresh run dir that the `postgres` system user can reach (pytest's basetemp is mode 0700)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(0o755)
    return path


def services_settings(
    run_dir: Path, model_dir: Path, enabled: tuple[str, ...] | None = None, embedded: bool = True
) -> Settings:
    """Settings for services under `run_dir` on free ports, every client section pointing at them.

    `embedded`: the store and MLflow's backend are SQLite files in the run dir, as under `rtrl demo`
    (what the test sessions use); False: the databases of the run dir's PostgreSQL, as under `rtrl run`.
    """
    kafka, controller, sasl, pg, redis, mlflow, vllm, staging = free_ports(8)
    services = ServicesSettings(
        run_dir=run_dir,
        host=HOST,
        kafka_port=kafka,
        kafka_controller_port=controller,
        kafka_sasl_port=sasl,
        postgres_port=pg,
        redis_port=redis,
        mlflow_port=mlflow,
        vllm_port=vllm,
        vllm_staging_port=staging,
        start_timeout_s=600.0,  # a loaded 2-core CI machine starts two vLLM servers slowly
        **({} if enabled is None else {"enabled": enabled}),
    )
    settings = Settings(
        services=services,
        kafka=KafkaSettings(bootstrap_servers=f"{HOST}:{kafka}", partitions=3),
        celery=CelerySettings(
            broker_url=f"redis://{HOST}:{redis}/0", result_backend=f"redis://{HOST}:{redis}/1"
        ),
        mlflow=MlflowSettings(
            tracking_uri=f"http://{HOST}:{mlflow}",
            artifact_root=run_dir / "mlflow" / "artifacts",
            # In the settings themselves, so that settings derived with another run dir still sign in.
            username="rtrl-admin",
            password=SecretStr(secrets.token_urlsafe(24)),
        ),
        vllm=VllmSettings(
            servers=(f"http://{HOST}:{vllm}",),
            staging_server=f"http://{HOST}:{staging}",
            model_dir=model_dir,
        ),
        gateway=GatewaySettings(port=free_ports(1)[0], spool_dir=run_dir / "spool"),
        trainer=TrainerSettings(checkpoint_dir=run_dir / "checkpoints"),
    )
    return embedded_databases(settings) if embedded else settings


def start_reaper(settings: Settings, owner_pid: int) -> subprocess.Popen[bytes]:
    """Start a watchdog that stops `settings`' services once `owner_pid` exits.

    A test session that is killed (SIGKILL, a CI timeout) never reaches its teardown; without this
    its Kafka, PostgreSQL, MLflow and vLLM servers would keep running. The watchdog runs in its own
    session so that a signal to the test's process group does not take it down first.
    """
    path = run_dir(settings) / "settings.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(settings.model_dump_json())
    log = (run_dir(settings) / "reaper.log").open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "services.testing", "reap", str(owner_pid), str(path)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


@contextmanager
def private_services(
    prefix: str, model_dir: Path | None = None, enabled: tuple[str, ...] | None = None, embedded: bool = True
) -> Iterator[Settings]:
    """Settings for a private deployment (fresh run dir, free ports; `model_dir` defaults to one in
    the run dir; `embedded` as for `services_settings`), watched by a reaper; on exit every service
    started under it is stopped and the run dir removed. Starts nothing itself: call
    `services.up` with the settings."""
    from services import down

    run_dir = make_run_dir(prefix)
    settings = services_settings(run_dir, model_dir or run_dir / "models" / "tiny", enabled, embedded)
    reaper = start_reaper(settings, os.getpid())
    try:
        yield settings
    finally:
        down(settings)
        reaper.terminate()
        reaper.wait()
        shutil.rmtree(run_dir, ignore_errors=True)


def _reap(owner_pid: int, settings_path: Path) -> None:
    from services import down

    while True:
        try:
            os.kill(owner_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(1.0)
    if not settings_path.exists():  # the owner's teardown ran and removed the run dir
        return
    settings = Settings.model_validate_json(settings_path.read_text())
    print(f"owner {owner_pid} exited without teardown; stopped: {down(settings)}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "reap":
        sys.exit("usage: python -m services.testing reap OWNER_PID SETTINGS_JSON")
    _reap(int(sys.argv[2]), Path(sys.argv[3]))
