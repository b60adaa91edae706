"""The real local services of an embedded rtrl deployment: Kafka, PostgreSQL, Redis, MLflow, vLLM.

``rtrl services up|status|down`` (rtrl/commands/services.py) and the test fixtures
(tests/conftest.py) call :func:`up`, :func:`status` and :func:`down`. Everything a service needs
lives under ``services.run_dir``: ``<name>/`` data, ``logs/<name>.log``, ``pids/<name>.json``.
Kafka's jars are cached in ``services.cache_dir``; Debian packages come from infra/system-deps.sh
(``make demo`` and ``make test`` run it).

Service names (for ``only``): kafka, postgres, redis, mlflow, vllm (the serving server and, when
``services.vllm_staging_port`` is set, vllm-staging, and when ``services.vllm_canary_port`` is set,
vllm-canary), vllm-staging, vllm-canary. MLflow on the local PostgreSQL
(its default backend) requires postgres: it starts once PostgreSQL is healthy and has its database.

The package also holds what runs the loop's processes on these services and what the vLLM service
serves: `services.supervisor` (``rtrl run``: prepares the loop, starts and restarts its
processes), `services.launch` (how a child process is started with its settings), `services.logs`
(logging set-up, log rotation, the filter of connection-retry noise while a service starts),
`services.tinymodel` (the tiny model the vLLM service builds when ``vllm.model_dir`` is empty) and
`services.modelcheck` (``rtrl model check``: a checkpoint the vLLM service, ``rtrl run`` and
``rtrl demo`` refuse). It sits below the simulation (`simulation`, whose demo starts these
services) and the CLI (`rtrl`), above the loop's stages.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from schemas.settings import Settings

from .base import Service, ServiceError, ServiceStatus, run_dir
from .kafka import Kafka
from .mlflow import Mlflow
from .postgres import Postgres
from .redis import Redis
from .vllm import servers as vllm_servers

__all__ = ["ServiceError", "ServiceStatus", "down", "run_dir", "services", "status", "up"]

log = logging.getLogger(__name__)

NAMES = ("kafka", "postgres", "redis", "mlflow", "vllm", "vllm-staging", "vllm-canary")


def services(settings: Settings, only: Sequence[str] | None = None) -> list[Service]:
    """The services selected by `only` (default: services.enabled), in start order."""
    wanted = set(settings.services.enabled if only is None else only)
    unknown = wanted - set(NAMES)
    if unknown:
        raise ServiceError(f"unknown service(s) {', '.join(sorted(unknown))}; known: {', '.join(NAMES)}")
    if "vllm" in wanted:
        wanted.update(("vllm-staging", "vllm-canary"))
    units: list[Service] = [Kafka(settings), Postgres(settings), Redis(settings), Mlflow(settings)]
    units += vllm_servers(settings)
    return [u for u in units if u.name in wanted]


def up(settings: Settings, only: Sequence[str] | None = None) -> list[ServiceStatus]:
    """Start the selected services that are not running and wait until all are healthy.

    Idempotent: a healthy service is left alone. The services a selected one requires
    (`Service.requires`: MLflow on the local PostgreSQL needs it) are selected too. Each missing
    service starts as soon as those it requires are healthy, so most start at once; then each is
    waited for (up to services.start_timeout_s) and its `after_start` run, requirements first. A
    service that exits or stays unhealthy raises ServiceError with the tail of its log. When
    anything fails, the services this call started are stopped again before the error propagates:
    a failed ``up`` leaves nothing running that it started. Returns the final status of the
    selected services.
    """
    units = _with_requirements(settings, services(settings, only))
    to_start = [unit for unit in units if unit.pid() is None]
    for unit in units:
        if unit not in to_start:
            log.info("%s: already running (pid %s)", unit.name, unit.pid())
    # Fail before starting anything rather than half-way through.
    order = _requirements_first(units)
    for unit in to_start:
        unit.check_ports()
    started: list[Service] = []
    healthy: set[str] = set()

    def start_ready() -> None:
        for unit in to_start:
            if unit not in started and set(unit.requires()) <= healthy:
                t0 = time.monotonic()
                started.append(unit)  # before start(): a start that fails half-way may leave a process
                pid = unit.start()
                log.info(
                    "%s: started pid %s in %.1f s, log %s",
                    unit.name,
                    pid,
                    time.monotonic() - t0,
                    unit.log_path,
                )

    try:
        start_ready()
        t_start = time.monotonic()
        for unit in order:  # each was started once what it requires was healthy
            detail = unit.wait_healthy(settings.services.start_timeout_s)
            unit.after_start()
            healthy.add(unit.name)
            log.info(
                "%s: healthy at %s (%s) after %.1f s",
                unit.name,
                unit.address,
                detail,
                time.monotonic() - t_start,
            )
            start_ready()  # those that required it
    except BaseException:
        for unit in reversed(started):
            if unit.stop():
                log.info("%s: stopped again (services up failed)", unit.name)
        raise
    return [unit.status() for unit in units]


def _with_requirements(settings: Settings, units: list[Service]) -> list[Service]:
    """`units` and every service they require, directly or not."""
    while missing := {name for unit in units for name in unit.requires()} - {unit.name for unit in units}:
        more = services(settings, [*(unit.name for unit in units), *missing])
        if len(more) == len(units):
            raise ServiceError(f"{', '.join(sorted(missing))} required but not configured (RTRL_SERVICES__*)")
        units = more
    return units


def _requirements_first(units: list[Service]) -> list[Service]:
    """`units` in their order, except that each comes after the services it requires."""
    ordered: list[Service] = []
    pending = list(units)
    while pending:
        placed = {unit.name for unit in ordered}
        ready = next((unit for unit in pending if set(unit.requires()) <= placed), None)
        if ready is None:
            raise ServiceError(f"services {', '.join(unit.name for unit in pending)} require each other")
        ordered.append(ready)
        pending.remove(ready)
    return ordered


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
