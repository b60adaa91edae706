"""`services.up` starts a service only once what it requires is healthy (MLflow on the local
PostgreSQL after PostgreSQL and its database), selects those requirements too, and stops what it
started when anything fails. Fake services record what `up` does to them; nothing is started."""

from __future__ import annotations

from pathlib import Path

import pytest

import services
from schemas.settings import MlflowSettings, ServicesSettings, Settings
from services import ServiceError, up
from services.base import Service
from services.mlflow import Mlflow

pytestmark = pytest.mark.unit


class Fake(Service):
    """A service that only records: started, healthy, after_start, stopped."""

    def __init__(
        self,
        settings: Settings,
        name: str,
        events: list[tuple[str, str]],
        requires: tuple[str, ...] = (),
        running: bool = False,
        fails: bool = False,
    ) -> None:
        self.name = name
        super().__init__(settings)
        self.events, self._requires, self._running, self.fails = events, requires, running, fails

    ports: tuple[int, ...] = ()
    address = "fake"

    def command(self) -> list[str]:
        return []

    def check(self) -> str:
        return "ok"

    def requires(self) -> tuple[str, ...]:
        return self._requires

    def pid(self) -> int | None:
        return 1 if self._running else None

    def check_ports(self) -> None:
        pass

    def start(self) -> int:
        self.events.append(("start", self.name))
        self._running = True
        return 1

    def wait_healthy(self, timeout_s: float) -> str:
        if self.fails:
            raise ServiceError(f"{self.name}: exited during start-up")
        self.events.append(("healthy", self.name))
        return "ok"

    def after_start(self) -> None:
        self.events.append(("after_start", self.name))

    def stop(self) -> bool:
        self.events.append(("stop", self.name))
        was, self._running = self._running, False
        return was


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(services=ServicesSettings(run_dir=tmp_path))


def _deployment(monkeypatch: pytest.MonkeyPatch, units: list[Fake]) -> None:
    """`up` sees `units` (in this order) as the services there are."""
    monkeypatch.setattr(
        services, "services", lambda settings, only=None: [u for u in units if only is None or u.name in only]
    )


def test_a_service_starts_once_what_it_requires_is_healthy(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[tuple[str, str]] = []
    units = [
        Fake(settings, "postgres", events),
        Fake(settings, "mlflow", events, requires=("postgres",)),
        Fake(settings, "vllm", events),
    ]
    _deployment(monkeypatch, units)
    statuses = up(settings)
    assert events == [
        ("start", "postgres"),
        ("start", "vllm"),  # all without requirements at once
        ("healthy", "postgres"),
        ("after_start", "postgres"),  # its databases exist now
        ("start", "mlflow"),  # before vllm is healthy: it does not wait for what it does not need
        ("healthy", "mlflow"),
        ("after_start", "mlflow"),
        ("healthy", "vllm"),
        ("after_start", "vllm"),
    ]
    assert [s.name for s in statuses] == ["postgres", "mlflow", "vllm"]


def test_a_required_service_listed_after_its_dependent_is_still_first(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[tuple[str, str]] = []
    _deployment(
        monkeypatch,
        [Fake(settings, "mlflow", events, requires=("postgres",)), Fake(settings, "postgres", events)],
    )
    up(settings)
    assert events == [
        ("start", "postgres"),
        ("healthy", "postgres"),
        ("after_start", "postgres"),
        ("start", "mlflow"),
        ("healthy", "mlflow"),
        ("after_start", "mlflow"),
    ]


def test_only_a_service_selects_what_it_requires_and_leaves_a_running_one_alone(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[tuple[str, str]] = []
    units = [
        Fake(settings, "kafka", events),
        Fake(settings, "postgres", events, running=True),
        Fake(settings, "mlflow", events, requires=("postgres",)),
    ]
    _deployment(monkeypatch, units)
    statuses = up(settings, only=["mlflow"])
    assert [s.name for s in statuses] == ["postgres", "mlflow"]
    assert events == [
        ("healthy", "postgres"),
        ("after_start", "postgres"),  # running: checked, not started
        ("start", "mlflow"),
        ("healthy", "mlflow"),
        ("after_start", "mlflow"),
    ]


def test_a_failed_up_stops_what_it_started_and_not_what_ran_before(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[tuple[str, str]] = []
    units = [
        Fake(settings, "redis", events, running=True),
        Fake(settings, "postgres", events),
        Fake(settings, "mlflow", events, requires=("postgres",), fails=True),
        Fake(settings, "vllm", events),
    ]
    _deployment(monkeypatch, units)
    with pytest.raises(ServiceError, match="mlflow: exited during start-up"):
        up(settings)
    stops = [name for kind, name in events if kind == "stop"]
    assert stops == [
        "mlflow",
        "vllm",
        "postgres",
    ]  # the reverse of their starts; redis ran before and keeps running


def test_services_that_require_each_other_are_refused_before_anything_starts(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[tuple[str, str]] = []
    _deployment(
        monkeypatch,
        [Fake(settings, "a", events, requires=("b",)), Fake(settings, "b", events, requires=("a",))],
    )
    with pytest.raises(ServiceError, match="require each other"):
        up(settings)
    assert [kind for kind, _ in events if kind == "start"] == []


def test_mlflow_requires_the_local_postgres_only_when_its_backend_is_there(tmp_path: Path) -> None:
    services = ServicesSettings(run_dir=tmp_path)
    assert Mlflow(Settings(services=services)).requires() == ("postgres",)  # the default backend
    sqlite = MlflowSettings(backend_store_uri=f"sqlite:///{tmp_path}/mlflow.db")
    assert Mlflow(Settings(services=services, mlflow=sqlite)).requires() == ()
    # A PostgreSQL rtrl does not run (postgres not among the services it manages) is someone else's.
    elsewhere = ServicesSettings(run_dir=tmp_path, enabled=("kafka", "redis", "mlflow", "vllm"))
    assert Mlflow(Settings(services=elsewhere)).requires() == ()


def test_only_mlflow_selects_the_local_postgres(tmp_path: Path) -> None:
    from services import _with_requirements, services

    settings = Settings(services=ServicesSettings(run_dir=tmp_path))
    assert [u.name for u in _with_requirements(settings, services(settings, ["mlflow"]))] == [
        "postgres",
        "mlflow",
    ]
    sqlite = settings.model_copy(update={"mlflow": MlflowSettings(backend_store_uri="sqlite:///x.db")})
    assert [u.name for u in _with_requirements(sqlite, services(sqlite, ["mlflow"]))] == ["mlflow"]
