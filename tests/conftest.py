"""Shared fixtures: one set of real local services per test session, on free loopback ports, and a
SQLite store with a hand-moved clock per test.

`services` starts Kafka, PostgreSQL, Redis, MLflow and two vLLM servers (serving + staging) on the
tiny model with :func:`services.up`, in a temporary run dir, and yields a `Settings` that
points every section at them; `kafka_service`, `postgres_service`, `redis_service`,
`mlflow_service` and `vllm_service` start only their one service on the same Settings. All stop
when the session ends. Nothing starts unless a test asks for one of them, so `pytest -m unit`
needs no services.

Integration and end-to-end tests must run, never skip: a skipped one is reported as a failure
(a missing service is an environment to fix, not a test to leave out).

Tests mirror the packages (tests/<package>/), in tiers by marker: ``unit``, ``integration``,
``e2e``. Test data comes from tests/factories.py, Kafka and CLI helpers from tests/helpers.py.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path

import pluggy
import pytest
from factories import FakeClock

from schemas.settings import KafkaSettings, Settings, local_postgres_url
from services.testing import private_services
from store import Store

MUST_NOT_SKIP = ("integration", "e2e")


@pytest.fixture(scope="session")
def services_config() -> Iterator[Settings]:
    """Settings for this session's services (free ports, fresh run dir); starts nothing itself.

    Every service that a fixture below starts is stopped when the session ends, and by a watchdog
    process if the session is killed before its teardown.
    """
    with private_services("rtrl-services-") as settings:
        # A killed labeler's partitions move after the group's session timeout: the broker's least
        # (6 s) rather than Kafka's 45 s, so tests that kill labelers wait 6 s for it, not 45.
        labeler = settings.labeler.model_copy(update={"session_timeout_ms": 6_000})
        # The session's servers serve the tiny model of the `exclaim` task: its retention suite is one
        # every gate here can conclude on from the first cycle (the default, ope and traffic, waits for
        # held-out traffic; tests/deployer/test_gate_traffic.py covers it).
        # The sampled retention suite (gate.retention.sampled_k, 32 samples of each held-out question a
        # model) is off here: it would multiply every gate run's generations by 33 on 2 cores; the
        # seeded gate runs of tests/deployer/test_deployer_rollout.py switch it on.
        retention = settings.gate.retention.model_copy(update={"sampled_k": 0})
        gate = settings.gate.model_copy(update={"suites": ("ope", "retention"), "retention": retention})
        yield settings.model_copy(update={"labeler": labeler, "gate": gate})


def _up(settings: Settings, *only: str) -> Settings:
    from services import up

    up(settings, only)  # idempotent: what an earlier fixture started is left alone
    return settings


@pytest.fixture(scope="session")
def services(services_config: Settings) -> Settings:
    """All local services (Kafka, PostgreSQL, Redis, MLflow, vLLM serving + staging), up for the session,
    and the session's store migrated (the deployer announces served versions in it, as under `rtrl run`)."""
    settings = _base_version(_up(services_config, *services_config.services.enabled))
    store = Store(settings.store.url)
    store.migrate()
    store.close()
    return settings


@pytest.fixture(scope="session")
def tiny_model_dir(services_config: Settings) -> Path:
    """The tiny model (task "exclaim", seed 0) the session's vLLM servers serve; built once."""
    from services.vllm import ensure_model

    return ensure_model(services_config)


# One fixture per service, for tests that need only that one (cheaper than `services` on a small
# machine): each yields the session's Settings with that service up.


@pytest.fixture(scope="session")
def kafka_service(services_config: Settings) -> Settings:
    return _up(services_config, "kafka")


@pytest.fixture(scope="session")
def postgres_service(services_config: Settings) -> Settings:
    return _up(services_config, "postgres")


@pytest.fixture(scope="session")
def redis_service(services_config: Settings) -> Settings:
    return _up(services_config, "redis")


@pytest.fixture(scope="session")
def mlflow_service(services_config: Settings) -> Settings:
    return _up(services_config, "mlflow")


@pytest.fixture(scope="session")
def vllm_service(services_config: Settings, tiny_model_dir: Path) -> Settings:
    """The serving and the staging vLLM server on the tiny model, reporting weight version 1 (the
    base model is v1 in every test's registry; tests that swap weights put v1 back)."""
    return _base_version(_up(services_config, "vllm"))


def _base_version(settings: Settings) -> Settings:
    """Give a vLLM server that has no weight version v1, as `rtrl run`'s bootstrap would."""
    from serving import VllmClient

    for url in (*settings.vllm.servers, settings.vllm.staging_server):
        if url is not None:
            with VllmClient(url, model=settings.vllm.served_model_name) as server:
                if server.weight_version() is None:
                    server.update_weight_version(1)
    return settings


@pytest.fixture(scope="session")
def kafka_settings(kafka_service: Settings) -> KafkaSettings:
    return kafka_service.kafka


@pytest.fixture(scope="session")
def postgres_url(postgres_service: Settings) -> str:
    """SQLAlchemy URL of the session's PostgreSQL database."""
    return local_postgres_url(postgres_service)


@pytest.fixture
def clock() -> FakeClock:
    """A wall clock that moves only when the test says (``clock.advance(seconds)``)."""
    return FakeClock()


@pytest.fixture
def store(tmp_path: Path, clock: FakeClock) -> Iterator[Store]:
    """A migrated SQLite store in tmp_path whose lease and orphan times follow `clock`."""
    opened = Store(f"sqlite:///{tmp_path}/rtrl.db", clock=clock)
    opened.migrate()
    yield opened
    opened.close()


@pytest.fixture
def postgres_database(postgres_service: Settings) -> Iterator[str]:
    """The SQLAlchemy URL of a throw-away database on the session's PostgreSQL server."""
    from services.postgres import Postgres

    server, name = Postgres(postgres_service), f"rtrl_test_{uuid.uuid4().hex[:10]}"
    server.create_database(name)
    yield local_postgres_url(postgres_service, name)
    server.drop_database(name)


_STARTED = pytest.StashKey[float]()  # when the test's setup began; logs written since are its own
LOG_TAIL_LINES = 60


def _log_tails(item: pytest.Item, since: float) -> list[tuple[Path, str]]:
    """The last lines of each ``*.log`` written since `since` in the logs dir of every Settings the
    test was given and in its tmp_path."""
    from services.base import tail

    funcargs = getattr(item, "funcargs", {})
    dirs = {Path(v.services.run_dir) / "logs" for v in funcargs.values() if isinstance(v, Settings)}
    if isinstance(funcargs.get("tmp_path"), Path):
        dirs.add(funcargs["tmp_path"])
    tails = []
    for path in sorted(p for d in dirs if d.is_dir() for p in d.rglob("*.log")):
        try:
            if path.stat().st_mtime >= since:
                tails.append((path, tail(path, LOG_TAIL_LINES)))
        except OSError:
            continue
    return tails


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pluggy.Result[pytest.TestReport], None]:
    """Report a skipped integration or e2e test as failed: every service-backed test must execute.
    A failed one carries the end of every log its services and processes wrote while it ran (the
    run dir is removed with the session, so this is all that is left of them in CI's output)."""
    outcome = yield
    report = outcome.get_result()
    tier = next((m for m in MUST_NOT_SKIP if item.get_closest_marker(m)), None)
    if call.when == "setup":
        item.stash[_STARTED] = call.start
    if (
        tier
        and report.skipped
        and not hasattr(report, "wasxfail")
        and os.environ.get("RTRL_ALLOW_SKIP") != "1"
    ):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"{tier} test skipped ({reason}); service-backed tests must run, not skip"
    if tier and report.failed:
        for path, text in _log_tails(item, since=item.stash.get(_STARTED, call.start)):
            report.sections.append((f"{path} (last {LOG_TAIL_LINES} lines)", text))


TIERS = {"unit": 0, "integration": 1, "e2e": 2}


def _tier(item: pytest.Item) -> str | None:
    """The test's tier: its closest tier marker (a test's own mark overrides its module's)."""
    return next((m.name for m in item.iter_markers() if m.name in TIERS), None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test carries a tier marker (a test without one is a collection error, so ``-m unit``
    never silently leaves one out), and the tiers run in order, unit → integration → e2e: cheap
    failures first, and the end-to-end tests (which swap the shared vLLM servers' weights) after
    the tests that expect the base model."""
    untiered = [item.nodeid for item in items if _tier(item) is None]
    if untiered:
        raise pytest.UsageError(
            f"{len(untiered)} tests carry no tier marker "
            f"(add pytestmark = pytest.mark.unit, integration or e2e): {untiered[:5]}"
        )
    items.sort(key=lambda item: TIERS[_tier(item) or "unit"])  # stable: keeps file order within a tier
