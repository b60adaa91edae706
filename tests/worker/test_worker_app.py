"""Unit tests of the worker's Celery wiring: the names a broker's queue and beat's schedule keep."""

from __future__ import annotations

import pytest

from schemas.settings import Settings
from worker import app as worker_app
from worker import tasks

pytestmark = pytest.mark.unit


def test_task_and_queue_names_are_explicit_so_queued_messages_survive_a_move_of_the_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(worker_app, "_settings", None)  # configure() below sets it; put back afterwards
    assert (tasks.train_cycle.name, tasks.maybe_train.name) == ("rtrl.train_cycle", "rtrl.maybe_train")
    assert {"rtrl.train_cycle", "rtrl.maybe_train"} <= set(worker_app.app.tasks)
    assert "worker.tasks" in worker_app.app.conf.include  # what `rtrl worker` imports to register them
    conf = worker_app.configure(Settings()).conf
    assert conf.task_default_queue == worker_app.QUEUE == "rtrl.trainer"
    assert conf.beat_schedule["maybe-train"]["task"] == "rtrl.maybe_train"
    assert conf.beat_schedule["maybe-train"]["options"] == {"queue": "rtrl.trainer"}


def test_beat_schedules_artefact_retention_on_the_worker_unless_a_cronjob_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(worker_app, "_settings", None)
    assert tasks.prune_artefacts.name == "rtrl.prune_artefacts" == worker_app.PRUNE_TASK
    conf = worker_app.configure(Settings()).conf
    assert conf.beat_schedule["prune-artefacts"] == {
        "task": "rtrl.prune_artefacts",
        "schedule": 86400.0,
        "options": {"queue": "rtrl.trainer"},
    }
    monkeypatch.setenv("RTRL_DEPLOYER__RETENTION__INTERVAL_S", "null")  # what the k8s manifests set
    assert "prune-artefacts" not in worker_app.configure(Settings()).conf.beat_schedule
