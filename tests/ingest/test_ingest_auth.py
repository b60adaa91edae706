"""The gateway's trust boundary without the network: keys from the store, rate limits, request ids
signed for their tenant, episode namespaces, feedback admission, body limits before reading."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from factories import T0, FakeMonotonic, at
from fastapi import FastAPI, Request

from ingest.auth import Caller, EventRate, KeyCache, RateLimiter, RequestIds, namespaced, request_id_secret
from ingest.intake import FeedbackIn, Refused, admit, scoped_event_id
from ingest.limits import BodyLimit
from schemas.rewards import TAB_V1
from schemas.settings import LimitsSettings
from store import Store

pytestmark = pytest.mark.unit


def test_the_key_cache_follows_the_store_and_survives_its_outage(store: Store, tmp_path: Path) -> None:
    record, key = store.create_api_key(role="tenant", tenant="acme", name="app")
    clock = FakeMonotonic()
    cache = KeyCache(store, refresh_s=5, monotonic=clock)
    assert not cache.loaded and cache.lookup(key) is None
    assert cache.refresh()
    assert cache.lookup(key) == Caller(key_id=record.id, role="tenant", tenant="acme", rate_per_s=None)
    assert cache.lookup(key + "x") is None
    store.revoke_api_key(record.id)
    cache.refresh()
    assert cache.lookup(key) is None  # a revoked key is refused after the next reload
    _, other = store.create_api_key(role="tenant", tenant="bolt", name="b")
    cache.refresh()
    clock.now += 60
    unreachable = KeyCache(Store(f"sqlite:///{tmp_path}/never-migrated.db"), refresh_s=5, monotonic=clock)
    assert not unreachable.refresh() and not unreachable.loaded
    cache._store = unreachable._store  # the store goes away: the last snapshot stays in force
    assert not cache.refresh()
    assert cache.lookup(other) is not None and cache.age_s == 60


def test_the_key_cache_knows_the_tenants_with_an_adapter(store: Store) -> None:
    store.create_api_key(role="tenant", tenant="acme", name="app")
    store.set_tenant("bolt", adapter=True)
    cache = KeyCache(store, refresh_s=5, monotonic=FakeMonotonic())
    assert not cache.has_adapter("bolt")  # nothing loaded yet
    assert cache.refresh()
    assert cache.has_adapter("bolt") and not cache.has_adapter("acme")
    store.set_tenant("bolt", adapter=False)
    store.set_tenant("acme", adapter=True)
    cache.refresh()  # switched at the next reload, as keys are
    assert cache.has_adapter("acme") and not cache.has_adapter("bolt")


def test_rate_limit_is_a_token_bucket_per_key() -> None:
    clock = FakeMonotonic()
    limiter = RateLimiter(rate_per_s=2.0, burst=3, monotonic=clock)
    a, b = Caller(1, "tenant", "acme", None), Caller(2, "tenant", "acme", 0.5)
    assert [limiter.take(a) for _ in range(3)] == [None, None, None]
    assert limiter.take(a) == pytest.approx(0.5)  # empty: the next token is due in 1/rate s
    assert limiter.take(b) is None  # another key has its own bucket
    clock.now += 0.5
    assert limiter.take(a) is None
    assert [limiter.take(b) for _ in range(2)] == [None, None]
    assert limiter.take(b) == pytest.approx(1.5)  # its own rate, 0.5/s: 0.25 tokens left, 0.75 to go
    assert RateLimiter(rate_per_s=0, burst=1).take(a) is None  # 0 = unlimited


def test_feedback_events_are_a_token_bucket_per_tenant_spent_by_the_body() -> None:
    clock = FakeMonotonic()
    rate = EventRate(rate_per_s=100.0, burst=1000, monotonic=clock)
    assert rate.take("acme", 1000) is None  # one full body at once
    assert rate.take("acme", 1) == pytest.approx(0.01)
    assert rate.take("bolt", 600) is None  # another tenant has its own bucket
    clock.now += 3.0
    assert rate.take("acme", 300) is None  # 3 s at 100 a second
    assert rate.take("acme", 5000) == pytest.approx(10.0)  # more than a burst waits for a full bucket
    assert EventRate(rate_per_s=0, burst=1).take("acme", 10**6) is None  # 0 = unlimited


def test_request_ids_are_signed_for_their_tenant(tmp_path: Path) -> None:
    secret = request_id_secret(None, tmp_path)
    assert (
        request_id_secret(None, tmp_path) == secret
        and (tmp_path / "gateway.secret").stat().st_mode & 0o077 == 0
    )
    ids = RequestIds(secret)
    rid = ids.new("acme")
    assert ids.belongs_to(rid, "acme") and not ids.belongs_to(rid, "bolt")
    assert not ids.belongs_to(rid.replace(".", ".0"), "acme") and not ids.belongs_to("plain-id", "acme")
    assert not RequestIds(b"another secret, another gateway").belongs_to(rid, "acme")
    assert request_id_secret("configured-secret", tmp_path) == b"configured-secret"


def test_episode_ids_live_in_their_tenants_namespace() -> None:
    assert namespaced("acme", "ep-1") == "acme:ep-1"
    assert len(namespaced("acme", "e" * 195)) == 200
    with pytest.raises(ValueError, match="at most 195 for this tenant"):
        namespaced("acme", "e" * 196)


def test_feedback_is_admitted_only_for_the_tenants_own_requests() -> None:
    ids = RequestIds(b"0123456789abcdef0123")
    mine, theirs = ids.new("acme"), ids.new("bolt")
    limits = LimitsSettings(max_future_skew_s=300, max_event_age_s=3600)

    def run(*items: dict[str, object]) -> object:
        return admit([FeedbackIn.model_validate(i) for i in items], "acme", ids, TAB_V1, limits, T0)

    events = run(
        {"request_id": mine, "kind": "accepted"},
        {
            "request_id": mine,
            "kind": "task_outcome",
            "value": 0.5,
            "episode_id": "ep",
            "event_id": "mine-1",
            "created_at": at(-60).isoformat(),
        },
    )
    assert isinstance(events, list)
    assert [(e.tenant, e.episode_id, e.created_at) for e in events] == [
        ("acme", None, T0),
        ("acme", "acme:ep", at(-60)),
    ]
    # the client's key scoped to its tenant, or made by the gateway
    assert events[1].event_id == scoped_event_id("acme", "mine-1") and len(events[0].event_id) == 32
    assert run({"request_id": theirs, "kind": "accepted"}) == Refused(
        404, [f"feedback[0]: no request {theirs!r} for this API key's tenant"]
    )
    refused = run(
        {"request_id": mine, "kind": "accepted", "tenant": "bolt"}, {"request_id": theirs, "kind": "accepted"}
    )
    assert isinstance(refused, Refused) and refused.status == 403 and len(refused.problems) == 2
    far_future = run({"request_id": mine, "kind": "accepted", "created_at": "9999-12-31T23:59:59-01:00"})
    assert isinstance(far_future, Refused) and far_future.status == 422 and "ahead" in far_future.problems[0]
    unbounded = run({"request_id": mine, "kind": "judge_score", "value": 1e6})
    assert isinstance(unbounded, Refused) and "outside [-1, 1]" in unbounded.problems[0]


def _echo_app(limits: dict[str, int], refused: list[str]) -> FastAPI:
    app = FastAPI()  # the middleware is added the way the gateway adds it (ingest/app.py)
    app.add_middleware(BodyLimit, limits=limits, on_refused=refused.append)

    @app.post("/v1/feedback")
    async def echo(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}

    return app


def test_bodies_over_the_limit_are_refused_unread() -> None:
    refused: list[str] = []
    app = _echo_app({"/v1/feedback": 1024}, refused)

    async def post(body: bytes, chunked: bool = False) -> httpx.Response:
        async def chunks():  # type: ignore[no-untyped-def]
            for i in range(0, len(body), 256):
                yield body[i : i + 256]

        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            return await client.post("/v1/feedback", content=chunks() if chunked else body)

    assert asyncio.run(post(b"x" * 1024)).json() == {"bytes": 1024}
    declared = asyncio.run(post(b"x" * 5000))
    assert (
        declared.status_code == 413
        and "5000 bytes is over the 1024-byte limit" in declared.json()["error"]["message"]
    )
    streamed = asyncio.run(post(b"x" * 5000, chunked=True))  # no Content-Length: counted as it arrives
    assert streamed.status_code == 413
    assert refused == ["/v1/feedback", "/v1/feedback"]
