"""The real local services of an embedded rtrl deployment: Kafka, PostgreSQL, Redis, MLflow, vLLM.

``rtrl services up|status|down`` (rtrl/commands/services.py) and the test fixtures
(tests/conftest.py) call :func:`up`, :func:`status` and :func:`down`. Everything a service needs
lives under ``services.run_dir``: ``<name>/`` data, ``logs/<name>.log``, ``pids/<name>.json``.
Kafka's jars are cached in ``services.cache_dir``; Debian packages come from infra/system-deps.sh
(``make demo`` and ``make test`` run it).

Service names (for ``only``): kafka, postgres, redis, mlflow, vllm (the serving server and, when
``services.vllm_staging_port`` is set, vllm-staging), vllm-staging.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from schemas.settings import Settings

from .base import Service, ServiceError, ServiceStatus, run_dir
from .kafka import Kafka
from .mlflow import Mlflow
from .postgres import Postgres, sqlalchemy_url
from .redis import Redis
from .vllm import servers as vllm_servers

__all__ = ["ServiceError", "ServiceStatus", "down", "run_dir", "services", "sqlalchemy_url", "status", "up"]

log = logging.getLogger(__name__)

NAMES = ("kafka", "postgres", "redis", "mlflow", "vllm", "vllm-staging")


def services(settings: Settings, only: Sequence[str] | None = None) -> list[Service]:
    """The services selected by `only` (default: services.enabled), in start order."""
    wanted = set(settings.services.enabled if only is None else only)
    unknown = wanted - set(NAMES)
    if unknown:
        raise ServiceError(f"unknown service(s) {', '.join(sorted(unknown))}; known: {', '.join(NAMES)}")
    if "vllm" in wanted:
        wanted.add("vllm-staging")
    units: list[Service] = [Kafka(settings), Postgres(settings), Redis(settings), Mlflow(settings)]
    units += vllm_servers(settings)
    return [u for u in units if u.name in wanted]


def up(settings: Settings, only: Sequence[str] | None = None) -> list[ServiceStatus]:
    """Start the selected services that are not running and wait until all are healthy.

    Idempotent: a healthy service is left alone. All missing services start at once, then each is
    waited for (up to services.start_timeout_s); a service that exits or stays unhealthy raises
    ServiceError with the tail of its log. When anything fails, the services this call started are
    stopped again before the error propagates: a failed ``up`` leaves nothing running that it
    started. Returns the final status of the selected services.
    """
    units = services(settings, only)
    to_start = [unit for unit in units if unit.pid() is None]
    for unit in units:
        if unit not in to_start:
            log.info("%s: already running (pid %s)", unit.name, unit.pid())
    # Fail before starting anything rather than half-way through.
    for unit in to_start:
        unit.check_ports()
    started: list[Service] = []
    try:
        for unit in to_start:
            t0 = time.monotonic()
            started.append(unit)  # before start(): a start that fails half-way may leave a process
            pid = unit.start()
            log.info("%s: started pid %s in %.1f s, log %s", unit.name, pid, time.monotonic() - t0, unit.log_path)
        t_start = time.monotonic()
        for unit in units:
            detail = unit.wait_healthy(settings.services.start_timeout_s)
            unit.after_start()
            log.info("%s: healthy at %s (%s) after %.1f s", unit.name, unit.address, detail,
                     time.monotonic() - t_start)
    except BaseException:
        for unit in reversed(started):
            if unit.stop():
                log.info("%s: stopped again (services up failed)", unit.name)
        raise
    return [unit.status() for unit in units]


def status(settings: Settings, only: Sequence[str] | None = None) -> list[ServiceStatus]:
    """Health of the selected services: pid file + a cheap protocol check each, no waiting."""
    return [unit.status() for unit in services(settings, only)]


def down(settings: Settings, only: Sequence[str] | None = None) -> list[str]:
    """Stop the selected services (default: all known ones) and their process groups; returns those stopped."""
    units = services(settings, NAMES if only is None else only)
    stopped = []
    for unit in reversed(units):  # consumers of the others (vLLM, MLflow) first
        if unit.stop():
            log.info("%s: stopped", unit.name)
            stopped.append(unit.name)
    return stopped
