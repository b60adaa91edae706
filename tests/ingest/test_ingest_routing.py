"""Which server a request goes to (ingest/routing.py): rotation, sessions, servers that are down."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

import pytest

from ingest.routing import Fleet, NoServerInRotation
from schemas.settings import VllmSettings
from serving.aio import new_session
from store import RotationRecord

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
