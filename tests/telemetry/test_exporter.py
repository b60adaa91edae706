"""The per-process metrics endpoint (telemetry/exporter.py): /metrics, /healthz, /readyz, the token,
and a port that cannot be bound."""

from __future__ import annotations

import socket

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter
from pydantic import SecretStr

from schemas.settings import MetricsSettings, Settings
from telemetry import Exporter, Readiness, start_exporter

pytestmark = pytest.mark.unit


def test_metrics_health_and_readiness() -> None:
    registry = CollectorRegistry()
    Counter("rtrl_test_things_total", "Things.", registry=registry).inc(3)
    readiness = Readiness()
    exporter = Exporter("labeler", "127.0.0.1", 0, registry=registry, readiness=readiness).start()
    base = f"http://127.0.0.1:{exporter.port}"
    try:
        assert "rtrl_test_things_total 3.0" in httpx.get(f"{base}/metrics").text
        assert httpx.get(f"{base}/healthz").json()["process"] == "labeler"
        assert httpx.get(f"{base}/readyz").status_code == 200  # nothing reported: nothing failing
        readiness.set("store", False, "database is locked")
        readiness.set("kafka", True)
        answer = httpx.get(f"{base}/readyz")
        assert answer.status_code == 503
        assert answer.json()["checks"]["store"]["detail"] == "database is locked"
        readiness.set("store", True)
        assert httpx.get(f"{base}/readyz").status_code == 200
        assert httpx.get(f"{base}/nope").status_code == 404
    finally:
        exporter.stop()


def test_token_guards_metrics_only() -> None:
    exporter = Exporter("worker", "127.0.0.1", 0, registry=CollectorRegistry(), token="s3cret").start()
    base = f"http://127.0.0.1:{exporter.port}"
    try:
        assert httpx.get(f"{base}/metrics").status_code == 401
        assert httpx.get(f"{base}/metrics", headers={"authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(f"{base}/metrics", headers={"authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(f"{base}/healthz").status_code == 200
    finally:
        exporter.stop()


def test_a_busy_port_costs_the_endpoint_not_the_process(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = Settings(metrics=MetricsSettings(labeler_port=port, token=SecretStr("t")))
        assert start_exporter(settings, "labeler") is None
    assert "set RTRL_METRICS__LABELER_PORT to a free port" in caplog.text
    assert start_exporter(Settings(metrics=MetricsSettings(beat_port=0)), "beat") is None  # 0: disabled
