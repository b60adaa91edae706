"""Which server a request goes to (ingest/routing.py): rotation, sessions, servers that are down."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from ingest.routing import Fleet, NoServerInRotation
from schemas.settings import VllmSettings
from serving.aio import new_session
from store import RotationRecord, Store

pytestmark = pytest.mark.unit

URLS = ("http://a:1", "http://b:1", "http://c:1")


def fleet(staging: str | None = None) -> Fleet:
    """A fleet over URLS whose connection pool is closed: these tests never call a server."""

    async def make() -> Fleet:
        async with new_session() as session:
            return Fleet(VllmSettings(servers=URLS, staging_server=staging), session)

    return asyncio.run(make())


def test_round_robin_over_the_servers_in_rotation() -> None:
    f = fleet()
    assert [f.order()[0].url for _ in range(3)] == list(URLS)
    f.set_out(frozenset({"http://b:1"}))
    firsts = {f.order()[0].url for _ in range(4)}
    assert firsts == {"http://a:1", "http://c:1"}
    assert all("http://b:1" not in [s.url for s in f.order()] for _ in range(4))  # never, not even last


def test_every_server_out_of_rotation_is_refused_at_once() -> None:
    f = fleet()
    f.set_out(frozenset(URLS))
    with pytest.raises(NoServerInRotation, match="out of rotation"):
        f.order()


def test_a_session_stays_on_its_server_and_moves_only_when_it_leaves() -> None:
    f = fleet()
    homes = {f"s{i}": f.order(f"s{i}")[0].url for i in range(60)}
    assert set(homes.values()) == set(URLS)  # sessions spread over the fleet
    assert all(f.order(s)[0].url == url for s, url in homes.items())  # and stay
    f.set_out(frozenset({"http://a:1"}))
    moved = {s: f.order(s)[0].url for s in homes}
    assert all(moved[s] == url for s, url in homes.items() if url != "http://a:1")  # the others do not move
    assert all(moved[s] != "http://a:1" for s in homes)


def test_a_server_that_refused_connections_is_tried_last() -> None:
    f = fleet()
    f.mark_down(f.servers[0])
    assert [f.order()[-1].url for _ in range(3)] == ["http://a:1"] * 3


def test_the_staging_server_never_serves_users() -> None:
    from ingest.errors import IngestError

    with pytest.raises(IngestError, match="must not serve users"):
        fleet(staging="http://a:1")


def _row(url: str, version: int | None, epoch: int, in_rotation: bool = True) -> RotationRecord:
    return RotationRecord(url, in_rotation, "test", datetime.now(UTC), version, epoch)


def test_an_announced_version_attributes_a_generation_only_while_its_epoch_and_view_hold() -> None:
    f = fleet()
    a = f.servers[0]
    f.update({"http://a:1": _row("http://a:1", 3, 7)}, time.monotonic())
    sent = a.announced
    assert sent is not None and sent.version == 3
    assert f.attributed(a, sent) == 3  # same epoch, fresh view: v3, no request to the server
    assert f.servers[1].announced is None  # no row: versions are read from that server

    f.update({"http://a:1": _row("http://a:1", None, 8, in_rotation=False)}, time.monotonic())
    assert a.announced is None and f.attributed(a, sent) is None  # a change was announced meanwhile
    assert f.out == {"http://a:1"}
    f.update({"http://a:1": _row("http://a:1", 3, 9)}, time.monotonic())
    assert f.attributed(a, sent) is None  # v3 again, but a later epoch: it may have changed between

    f.update({"http://a:1": _row("http://a:1", 3, 9)}, time.monotonic() - f.trust_s)
    assert f.attributed(a, a.announced) is None  # a view as old as the deployer's wait proves nothing
    assert f.attributed(a, None) is None  # sent without an announcement


def test_an_announcement_the_server_contradicts_is_not_trusted_again_until_the_next_one() -> None:
    f = fleet()
    a = f.servers[0]
    f.update({"http://a:1": _row("http://a:1", 3, 7)}, time.monotonic())
    a.distrusted_epoch = 7  # what Fleet.verify sets when the server's label disagrees
    f.update({"http://a:1": _row("http://a:1", 3, 7)}, time.monotonic())
    assert a.announced is None
    f.update({"http://a:1": _row("http://a:1", 4, 8)}, time.monotonic())
    assert a.announced is not None and a.announced.version == 4


# ---- the live canary ------------------------------------------------------------------------------

CANARY = "http://canary:1"


def canary_fleet(share: float = 0.2) -> Fleet:
    async def make() -> Fleet:
        async with new_session() as session:
            return Fleet(VllmSettings(servers=URLS, canary_server=CANARY), session, canary_share=share)

    return asyncio.run(make())


def test_without_a_live_canary_no_request_reaches_the_canary_server() -> None:
    f = canary_fleet()
    keys = [f"user\0t\0u{i}" for i in range(200)]
    assert all(CANARY not in [s.url for s in f.order(None, k)] for k in keys)  # no row: not live
    f.update({CANARY: _row(CANARY, None, 1)}, time.monotonic())  # in rotation, no version yet
    assert not f.canary_live and all(f.order(None, k)[0].url != CANARY for k in keys)
    f.update({CANARY: _row(CANARY, 2, 2, in_rotation=False)}, time.monotonic())
    assert not f.canary_live and all(f.order(None, k)[0].url != CANARY for k in keys)
    assert CANARY not in f.out  # the canary's row never takes a fleet server out


def test_the_canary_gets_its_share_of_keys_sticky_and_resalted_per_version() -> None:
    f = canary_fleet(share=0.2)
    f.update({CANARY: _row(CANARY, 2, 1)}, time.monotonic())
    assert f.canary_live
    keys = [f"user\0t\0u{i}" for i in range(10_000)]
    arm = {k: f.order(None, k)[0].url == CANARY for k in keys}
    assert 0.18 < sum(arm.values()) / len(keys) < 0.22
    assert all((f.order(None, k)[0].url == CANARY) == arm[k] for k in keys[:500])  # sticky
    assert all(f.order(None, None)[0].url != CANARY for _ in range(50))  # no key: never the canary
    assert all(CANARY not in [s.url for s in f.order(None, k)] for k in keys[:500] if not arm[k])
    f.update({CANARY: _row(CANARY, 3, 2)}, time.monotonic())  # the next canary: other users
    again = {k: f.order(None, k)[0].url == CANARY for k in keys}
    both = sum(arm[k] and again[k] for k in keys) / len(keys)
    assert 0.02 < both < 0.06  # independent draws: about 0.2 x 0.2


def test_a_canary_that_refused_connections_sends_its_users_to_the_fleet() -> None:
    f = canary_fleet(share=0.5)
    f.update({CANARY: _row(CANARY, 2, 1)}, time.monotonic())
    key = next(k for k in (f"episode\0t:e{i}" for i in range(100)) if f.order(None, k)[0].url == CANARY)
    assert [s.url for s in f.order(None, key)][1:] != []  # the fleet follows: retried there on refusal
    assert f.canary is not None
    f.mark_down(f.canary)
    assert CANARY not in [s.url for s in f.order(None, key)]


def test_two_tenants_users_of_one_name_are_two_users() -> None:
    from ingest.completions import sticky_key

    assert sticky_key("a", {"user": "bob"}, "a:e1") != sticky_key("b", {"user": "bob"}, "b:e1")
    assert sticky_key("a", {"user": "bob"}, "a:e1") == sticky_key("a", {"user": "bob"}, "a:e2")
    assert sticky_key("a", {}, "a:e1") == "episode\0a:e1"
    assert sticky_key("a", {"user": ""}, "a:e1") == "episode\0a:e1"


def test_a_user_keeps_their_arm_across_announcements_of_the_same_version_and_any_session() -> None:
    f = canary_fleet(share=0.3)
    f.update({CANARY: _row(CANARY, 2, 1)}, time.monotonic())
    keys = [f"user\0t\0u{i}" for i in range(300)]
    arm = {k: f.order(None, k)[0].url == CANARY for k in keys}
    assert 0 < sum(arm.values()) < len(keys)
    f.update({CANARY: _row(CANARY, 2, 5)}, time.monotonic())  # re-announced: a later epoch, same version
    assert all((f.order(f"s{i}", k)[0].url == CANARY) == arm[k] for i, k in enumerate(keys))
    # The salt is the version alone: the same arms on every gateway, whatever its turn or session.
    from ingest.routing import in_canary

    assert all(in_canary(k, 2, 0.3) == arm[k] for k in keys)


def test_a_canary_whose_view_is_stale_or_contradicted_gets_no_users() -> None:
    f = canary_fleet(share=0.5)
    keys = [f"episode\0t:e{i}" for i in range(200)]
    f.update(
        {CANARY: _row(CANARY, 2, 1)}, time.monotonic() - f.canary_stale_s
    )  # the store unread for too long
    assert not f.canary_live and all(f.order(None, k)[0].url != CANARY for k in keys)
    f.update({CANARY: _row(CANARY, 2, 1)}, time.monotonic())
    assert f.canary_live
    assert f.canary is not None
    f.canary.distrusted_epoch = 1  # what Fleet.verify sets when the canary's label disagrees
    f.update({CANARY: _row(CANARY, 2, 1)}, time.monotonic())
    assert not f.canary_live and all(f.order(None, k)[0].url != CANARY for k in keys)
    f.update({CANARY: _row(CANARY, 2, 2)}, time.monotonic())  # announced again: trusted again
    assert f.canary_live


def test_a_canary_request_refused_by_the_canary_is_tried_on_the_fleet_and_others_never_reach_it() -> None:
    """`_call` over real connections to ports nobody listens on: the order tried is in the error."""
    from types import SimpleNamespace
    from typing import cast

    from ingest.completions import _call
    from ingest.gateway import Gateway
    from ingest.metrics import GatewayMetrics
    from ingest.routing import UpstreamUnavailable, in_canary
    from services.testing import free_ports

    a, b, c = (f"http://127.0.0.1:{port}" for port in free_ports(3))
    body = {"model": "m", "prompt": "hi", "max_tokens": 1}

    async def tried(gw: Gateway, sticky: str) -> list[str]:
        with pytest.raises(UpstreamUnavailable) as refused:
            await _call(gw, "/v1/completions", body, sticky=sticky)
        return [part.split(" ", 1)[0] for part in str(refused.value).split(": ", 1)[1].split("; ")]

    async def run() -> None:
        async with new_session() as session:
            f = Fleet(VllmSettings(servers=(a, b), canary_server=c), session, canary_share=0.5)
            gw = cast(Gateway, SimpleNamespace(fleet=f, metrics=GatewayMetrics()))
            f.update({c: _row(c, 2, 1)}, time.monotonic())
            keys = [f"user\0t\0u{i}" for i in range(40)]
            marked = next(k for k in keys if in_canary(k, 2, 0.5))
            unmarked = [k for k in keys if not in_canary(k, 2, 0.5)]
            first = await tried(gw, marked)
            assert first[0] == c and sorted(first[1:]) == sorted([a, b])  # the canary, then the fleet
            assert gw.metrics.registry.get_sample_value("rtrl_gateway_canary_requests_total") == 1
            assert c not in await tried(gw, marked)  # refused recently: straight to the fleet
            for key in unmarked[:5]:
                assert c not in await tried(gw, key)
            assert gw.metrics.registry.get_sample_value("rtrl_gateway_canary_requests_total") == 1

    asyncio.run(run())


def test_a_gateway_starts_with_its_canary_server_down_and_keeps_the_canarys_users_off_it(
    tmp_path: Path, store: Store
) -> None:
    """The gateway in-process (SQLite store, no broker) with its fleet and canary server on ports
    nobody listens on: it starts with no canary running, /readyz reports the canary apart from the
    fleet, and a canary announced on a dead server loses the gateway's trust at the first check
    (its label cannot be read), so its users are not sent there."""
    from starlette.testclient import TestClient

    from ingest.app import create_app
    from ingest.gateway import Gateway
    from ingest.routing import in_canary
    from schemas.clock import wait_until
    from schemas.settings import GateSettings, GatewaySettings, ServicesSettings, Settings, StoreSettings
    from schemas.settings.canary import CanarySettings
    from services.testing import free_ports

    fleet_url, canary_url = (f"http://127.0.0.1:{port}" for port in free_ports(2))
    settings = Settings(
        store=StoreSettings(url=f"sqlite:///{tmp_path}/rtrl.db"),
        gateway=GatewaySettings(spool_dir=tmp_path / "spool", auth="open"),
        services=ServicesSettings(run_dir=tmp_path / "run"),
        vllm=VllmSettings(servers=(fleet_url,), canary_server=canary_url, sampling_defaults={}),
        gate=GateSettings(canary=CanarySettings(share=0.5)),
    )
    with TestClient(create_app(settings, connect=lambda: None)) as client:
        gw: Gateway = client.app.state.gateway  # type: ignore[attr-defined]
        ready = client.get("/readyz")
        assert ready.status_code == 503  # the fleet is down; the canary never makes a gateway ready
        assert ready.json()["vllm"] == {fleet_url: False}
        assert ready.json()["canary"] == {"url": canary_url, "live": False, "healthy": False}

        store.set_serving_version(canary_url, 2, "test: the deployer announces the canary")
        store.set_rotation(canary_url, True, "test: the canary goes live")
        registry = gw.metrics.registry

        def distrusted() -> bool:
            mismatches = registry.get_sample_value(
                "rtrl_gateway_version_mismatch_total", {"server": canary_url}
            )
            return (mismatches or 0) >= 1

        wait_until(distrusted, timeout_s=10, what="the gateway's check of the dead canary's label")
        assert not gw.fleet.canary_live
        assert registry.get_sample_value("rtrl_gateway_canary_live") == 0
        user = next(u for u in (f"u{i}" for i in range(40)) if in_canary(f"user\0open\0{u}", 2, 0.5))
        body = {"model": settings.vllm.served_model_name, "prompt": "hi", "max_tokens": 1, "user": user}
        answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 502 and canary_url not in answer.json()["error"]["message"]
