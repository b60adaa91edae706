"""A gateway's counts of a live canary's requests (ingest/canary_traffic.py) and their flush
(ingest/app.py `CanaryFlush`) to a SQLite store: per (version, arm), latency buckets as the deployer
reads them, nothing counted without a live canary, cumulative flushes that never count twice, a
store outage that only delays them, and a request counted once its last byte is sent. No vLLM: the
counting of real requests through ``rtrl gateway`` is tests/deployer/test_canary_guards_live.py."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from starlette.background import BackgroundTask
from starlette.responses import Response

from ingest.app import CanaryFlush
from ingest.canary_traffic import CanaryCounts, Tally, bucket
from ingest.completions import count_when_sent
from ingest.metrics import GatewayMetrics
from ingest.routing import Fleet
from schemas.settings import VllmSettings
from schemas.settings.canary import LATENCY_BUCKETS_S
from serving.aio import new_session
from store import ArmTraffic, RotationRecord, Store, StoreError

pytestmark = pytest.mark.unit

CANARY = "http://canary:1"


def tally(version: int | None, arm: str = "fleet", error: bool = False, latency_s: float = 0.0) -> Tally:
    return Tally(started=time.perf_counter() - latency_s, version=version, arm=arm, error=error)


def test_latency_buckets_include_their_upper_bound_and_end_in_inf() -> None:
    assert [bucket(x) for x in (0.0, 0.05, 0.0501, 1.0, 59.9, 60.0, 61.0)] == [0, 0, 1, 4, 9, 9, 10]
    assert len(LATENCY_BUCKETS_S) == 10


def test_requests_are_counted_per_version_and_arm_and_not_without_a_live_canary() -> None:
    seen: list[tuple[str, bool]] = []
    counts = CanaryCounts("gw-1", on_count=lambda arm, error, latency: seen.append((arm, error)))
    counts.record(tally(None))  # no canary live when it was routed
    assert counts.totals() == {}
    counts.record(tally(5, "canary", latency_s=0.3))
    counts.record(tally(5, "canary", error=True, latency_s=70))
    counts.record(tally(5, "fleet", latency_s=0.01))
    totals = counts.totals()
    assert totals[(5, "canary")] == ArmTraffic(2, 1, (0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1))
    assert totals[(5, "fleet")] == ArmTraffic(1, 0, (1,) + (0,) * 10)
    assert seen == [("canary", False), ("canary", True), ("fleet", False)]
    assert CanaryCounts().instance != CanaryCounts().instance  # new per process start


class Down:
    """A store that cannot be written."""

    def record_canary_traffic(self, instance: str, counts: Any) -> None:
        raise StoreError("the store is down")


def test_flushes_are_cumulative_and_a_store_outage_only_delays_them(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'rtrl.db'}")
    store.migrate()
    metrics = GatewayMetrics()
    counts = CanaryCounts("gw-1")
    flush = CanaryFlush(counts, metrics)

    async def scenario() -> None:
        counts.record(tally(5, "canary"))
        counts.record(tally(5, "fleet"))
        await flush.flush(store)
        await flush.flush(store)  # nothing changed: nothing written, nothing counted twice
        assert store.canary_traffic(5)["canary"].requests == 1
        counts.record(tally(5, "canary", error=True))
        await flush.flush(Down())  # type: ignore[arg-type]
        assert flush.failing and store.canary_traffic(5)["canary"].requests == 1
        counts.record(tally(5, "canary"))
        await flush.flush(store)  # the next flush carries what the failed one could not
        assert not flush.failing

    asyncio.run(scenario())
    assert store.canary_traffic(5) == {
        "canary": ArmTraffic(3, 1, (3,) + (0,) * 10),
        "fleet": ArmTraffic(1, 0, (1,) + (0,) * 10),
    }
    sample = metrics.registry.get_sample_value
    assert sample("rtrl_gateway_canary_traffic_flush_total", {"outcome": "ok"}) == 2
    assert sample("rtrl_gateway_canary_traffic_flush_total", {"outcome": "failed"}) == 1
    store.close()


def test_a_tick_flushes_at_most_every_flush_interval(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'rtrl.db'}")
    store.migrate()
    counts = CanaryCounts("gw-1")
    flush = CanaryFlush(counts, GatewayMetrics())

    async def scenario() -> None:
        counts.record(tally(5, "canary"))
        flush.tick(store)
        first = flush.task
        assert first is not None
        await first
        counts.record(tally(5, "canary"))
        flush.tick(store)  # too soon: no new flush
        assert flush.task is first

    asyncio.run(scenario())
    assert store.canary_traffic(5)["canary"].requests == 1
    store.close()


def test_a_request_is_counted_once_sent_before_its_capture_runs() -> None:
    order: list[str] = []

    class Gw:
        canary_traffic = CanaryCounts("gw-1", on_count=lambda arm, error, latency: order.append("counted"))

    response = Response(b"{}", background=BackgroundTask(lambda: order.append("captured")))
    count_when_sent(Gw(), response, tally(5, "canary"))  # type: ignore[arg-type]
    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)
        order.append(message["type"])

    async def receive() -> Any:
        return {"type": "http.disconnect"}

    asyncio.run(response({"type": "http", "method": "POST"}, receive, send))
    assert order == ["http.response.start", "http.response.body", "counted", "captured"]


def test_the_fleet_names_the_live_canarys_version() -> None:
    async def make() -> Fleet:
        async with new_session() as session:
            return Fleet(
                VllmSettings(servers=("http://a:1",), canary_server=CANARY), session, canary_share=0.5
            )

    fleet = asyncio.run(make())
    assert fleet.canary_version is None
    row = RotationRecord(CANARY, True, "canary: serving v7", datetime.now(UTC), 7, 3)
    fleet.update({CANARY: row}, time.monotonic())
    assert fleet.canary_version == 7
    fleet.update({CANARY: row}, time.monotonic() - 60)  # a view too old: no canary
    assert fleet.canary_version is None
