"""The local Redis server is real: a Celery task goes through it as broker and result backend."""

from __future__ import annotations

import time
import uuid

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from schemas.settings import Settings

pytestmark = pytest.mark.integration


def test_redis_ping_and_round_trip(redis_service: Settings) -> None:
    client = redis.Redis.from_url(redis_service.celery.broker_url)
    try:
        key = f"test:{uuid.uuid4().hex}"
        client.set(key, b"v", ex=60)
        assert client.get(key) == b"v"
    finally:
        client.close()


def test_celery_task_round_trip_through_redis(redis_service: Settings) -> None:
    app = Celery(
        "rtrl-services-test",
        broker=redis_service.celery.broker_url,
        backend=redis_service.celery.result_backend,
    )
    # A queue of its own, so that a trainer worker of another test never takes this task.
    queue = f"test-{uuid.uuid4().hex[:8]}"
    app.conf.update(
        task_default_queue=queue, broker_connection_retry_on_startup=True, worker_hijack_root_logger=False
    )

    @app.task(name="tests.multiply")
    def multiply(a: int, b: int) -> dict[str, int]:
        return {"product": a * b}

    # A real worker (threads in this process) consuming from Redis; ping checking needs
    # celery.ping registered, the round trip below checks the same thing.
    with start_worker(
        app, pool="solo", concurrency=1, perform_ping_check=False, queues=[queue], shutdown_timeout=30
    ):
        result = multiply.delay(6, 7)
        assert result.get(timeout=60) == {"product": 42}
        assert result.state == "SUCCESS"

    # The result really went through the Redis result backend.
    backend = redis.Redis.from_url(redis_service.celery.result_backend)
    try:
        assert backend.exists(f"celery-task-meta-{result.id}") == 1
    finally:
        backend.close()


def test_a_queued_job_survives_a_redis_restart(redis_service: Settings) -> None:
    """Append-only persistence: what the broker held before a restart is there after it."""
    from services import down, up

    client = redis.Redis.from_url(redis_service.celery.broker_url)
    queue = f"test-restart-{uuid.uuid4().hex[:8]}"
    try:
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        client.lpush(queue, b"a cycle job")
        time.sleep(1.5)  # appendfsync everysec
        assert down(redis_service, only=("redis",)) == ["redis"]
        up(redis_service, only=("redis",))
        assert client.lrange(queue, 0, -1) == [b"a cycle job"]
    finally:
        client.delete(queue)
        client.close()
