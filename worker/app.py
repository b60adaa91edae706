"""The worker's Celery app: broker and result backend from ``settings.celery``, and the beat schedule.

Started by ``rtrl worker`` (one solo-pool worker: one cycle at a time, in one long-lived process
that keeps the DeepSpeed process group between cycles) and ``rtrl beat``. Both call `configure`
with the `Settings` they built once at start-up, before the app connects anywhere; clients that
only send tasks (``rtrl train now``, the demo) call it too.

Queue ``rtrl.trainer`` carries the three tasks defined in worker/tasks.py:
``rtrl.train_cycle`` (one cycle + gate + deploy), ``rtrl.maybe_train`` (beat's check) and
``rtrl.prune_artefacts`` (artefact retention, every ``deployer.retention.interval_s``; between
cycles, as the worker runs one task at a time). The
queue's and the tasks' names are explicit, not derived from the module: messages waiting in Redis
and beat's schedule file name them, so they outlive a move of the code.
"""

from __future__ import annotations

from collections.abc import Callable

from celery import Celery

from schemas.settings import Settings, load_settings

QUEUE = "rtrl.trainer"
BEAT_TASK = "rtrl.maybe_train"
CYCLE_TASK = "rtrl.train_cycle"
PRUNE_TASK = "rtrl.prune_artefacts"

app = Celery("rtrl", include=["worker.tasks"])
_settings: Settings | None = None


def on_worker_ready(callback: Callable[[], None]) -> None:
    """Call `callback` once the worker consumes its queue (Celery's ``worker_ready`` signal)."""
    from celery.signals import worker_ready

    worker_ready.connect(lambda **_: callback(), weak=False)


def configure(settings: Settings) -> Celery:
    """Point the app at the settings' broker/backend and install the beat schedule; returns the app."""
    global _settings
    _settings = settings
    schedule = {
        "maybe-train": {
            "task": BEAT_TASK,
            "schedule": settings.trainer.interval_s,
            "options": {"queue": QUEUE},
        },
    }
    if settings.deployer.retention.interval_s is not None:  # null: a CronJob runs `rtrl deploy prune`
        schedule["prune-artefacts"] = {
            "task": PRUNE_TASK,
            "schedule": settings.deployer.retention.interval_s,
            "options": {"queue": QUEUE},
        }
    app.conf.update(
        broker_url=settings.celery.broker_url,
        result_backend=settings.celery.result_backend,
        task_default_queue=QUEUE,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_extended=True,
        result_expires=7 * 24 * 3600,
        task_track_started=True,
        # A cycle runs minutes to hours: take one message at a time, acknowledge it after the cycle
        # (acks_late on the task), and let the broker redeliver if the worker dies mid-cycle.
        worker_prefetch_multiplier=1,
        worker_concurrency=1,
        # Redis redelivers unacknowledged messages after this; it must exceed the longest cycle. A
        # worker that dies mid-cycle is noticed sooner by its lease (trainer/lease.py).
        broker_transport_options={"visibility_timeout": int(settings.trainer.max_cycle_s)},
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        timezone="UTC",
        beat_schedule=schedule,
    )
    return app


def current_settings() -> Settings:
    """The settings the process was configured with (read once from the environment otherwise)."""
    if _settings is None:
        configure(load_settings())
    assert _settings is not None
    return _settings
