"""Which server a request goes to (ingest/routing.py): rotation, sessions, servers that are down."""

from __future__ import annotations

import httpx
import pytest

from ingest.routing import Fleet, NoServerInRotation
from schemas.settings import VllmSettings

pytestmark = pytest.mark.unit

URLS = ("http://a:1", "http://b:1", "http://c:1")


def fleet() -> Fleet:
    return Fleet(VllmSettings(servers=URLS, staging_server=None), httpx.AsyncClient())


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
        Fleet(VllmSettings(servers=URLS, staging_server="http://a:1"), httpx.AsyncClient())
