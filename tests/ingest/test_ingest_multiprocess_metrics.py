"""The gateway's metrics across worker processes (ingest/metrics.py, multiprocess mode): every
family merges over real processes the way docs/runbooks/gateway.md reads it."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from ingest.metrics import MULTIPROC_ENV, GatewayMetrics

pytestmark = pytest.mark.unit


def worker(n: int, in_flight: int, connected: int) -> None:
    """One gateway worker's metrics: `n` requests answered, `in_flight` now, Kafka `connected`."""
    metrics = GatewayMetrics()
    assert metrics.multiprocess
    for _ in range(n):
        metrics.requests.labels("completions", "200").inc()
    metrics.upstream_latency.labels("completions").observe(0.02)
    metrics.bind(metrics.tenant_in_flight, lambda: in_flight)
    metrics.kafka_connected.set(connected)
    metrics.refresh()


def run_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *jobs: tuple[int, int, int]) -> list[int]:
    monkeypatch.setenv(MULTIPROC_ENV, str(tmp_path))  # the spawned workers read it at import
    spawn = multiprocessing.get_context("spawn")
    pids = []
    for job in jobs:
        process = spawn.Process(target=worker, args=job)
        process.start()
        process.join(60)
        assert process.exitcode == 0
        assert process.pid is not None
        pids.append(process.pid)
    return pids


def merged(tmp_path: Path) -> CollectorRegistry:
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    return registry


def test_counters_and_histograms_sum_and_gauges_merge_by_their_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pids = run_workers(tmp_path, monkeypatch, (3, 2, 1), (4, 5, 0))
    value = merged(tmp_path).get_sample_value
    assert value("rtrl_gateway_requests_total", {"endpoint": "completions", "status": "200"}) == 7
    assert value("rtrl_gateway_upstream_latency_seconds_count", {"endpoint": "completions"}) == 2
    assert value("rtrl_gateway_tenant_requests_in_flight") == 7  # livesum
    assert value("rtrl_gateway_kafka_connected") == 0  # livemin: one worker has no producer
    # A worker that exits: its counts stay (they happened), its live gauges go.
    mark_process_dead(pids[1], str(tmp_path))
    value = merged(tmp_path).get_sample_value
    assert value("rtrl_gateway_requests_total", {"endpoint": "completions", "status": "200"}) == 7
    assert value("rtrl_gateway_tenant_requests_in_flight") == 2
    assert value("rtrl_gateway_kafka_connected") == 1


def test_every_gauge_says_how_to_merge_across_workers() -> None:
    gauges = [m for m in vars(GatewayMetrics()).values() if isinstance(m, Gauge)]
    assert len(gauges) == 13
    for gauge in gauges:
        # "all" (the default) would give one series per pid, and dead workers' values forever.
        assert gauge._multiprocess_mode.startswith("live"), gauge._name
