"""The per-tenant cap on completion requests and streams in flight (ingest/slots.py), alone and in
the gateway application in-process: a SQLite store, no broker, and vLLM servers that refuse the
connection or never answer (a listening socket nobody accepts on), so no generation is made."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from ingest.app import create_app
from ingest.gateway import Gateway
from ingest.slots import TenantSlots
from schemas.clock import wait_until
from schemas.settings import (
    GatewaySettings,
    ServicesSettings,
    Settings,
    SettingsError,
    StoreSettings,
    VllmSettings,
    load_settings,
)
from services.testing import free_ports
from store import Store

pytestmark = pytest.mark.unit


def test_a_tenant_gets_cap_slots_and_each_comes_back_once() -> None:
    slots = TenantSlots(2)
    a1, a2 = slots.take("acme"), slots.take("acme")
    assert a1 is not None and a2 is not None
    assert slots.take("acme") is None  # at its cap
    b = slots.take("bolt")  # another tenant is not affected
    assert b is not None
    assert (slots.held("acme"), slots.held("bolt"), slots.in_flight, slots.tenants_at_cap) == (2, 1, 3, 1)
    a1.release()
    a1.release()  # a second release of the same slot gives nothing back
    assert slots.held("acme") == 1
    a3 = slots.take("acme")
    assert a3 is not None and slots.take("acme") is None
    for slot in (a2, a3, b):
        slot.release()
    assert (slots.in_flight, slots.tenants_at_cap) == (0, 0)
    assert slots._held == {}  # no entry left behind per tenant seen


def test_no_cap_counts_without_refusing() -> None:
    slots = TenantSlots(0)
    taken = [slots.take("acme") for _ in range(1000)]
    assert all(slot is not None for slot in taken) and slots.held("acme") == 1000
    assert slots.tenants_at_cap == 0
    with pytest.raises(ValueError, match=">= 0"):
        TenantSlots(-1)


def gateway_settings(tmp_path: Path, servers: tuple[str, ...], **gateway: Any) -> Settings:
    return Settings(
        store=StoreSettings(url=f"sqlite:///{tmp_path}/rtrl.db"),
        gateway=GatewaySettings(spool_dir=tmp_path / "spool", **gateway),
        services=ServicesSettings(run_dir=tmp_path / "run"),
        vllm=VllmSettings(servers=servers, sampling_defaults={}, request_timeout_s=30),
    )


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[TestClient]]:
    clients: list[TestClient] = []
    yield clients
    for client in clients:
        client.__exit__(None, None, None)


def start(settings: Settings, clients: list[TestClient]) -> tuple[TestClient, Gateway]:
    client = TestClient(create_app(settings, connect=lambda: None), raise_server_exceptions=True)
    client.__enter__()  # the lifespan: keys loaded, the Gateway built
    clients.append(client)
    gw: Gateway = client.app.state.gateway  # type: ignore[attr-defined]
    return client, gw


def shed(client: TestClient, admin: str, reason: str) -> float:
    text = client.get("/metrics", headers={"authorization": f"Bearer {admin}"}).text
    line = f'rtrl_gateway_shed_total{{reason="{reason}"}} '
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(line))


def test_past_its_cap_a_tenant_gets_429_and_every_ending_gives_its_slot_back(
    tmp_path: Path, store: Store, started: list[TestClient]
) -> None:
    (closed,) = free_ports(1)  # nothing listens: every generation is a 502, vLLM never reached
    _, acme = store.create_api_key(role="tenant", tenant="acme", name="t")
    _, bolt = store.create_api_key(role="tenant", tenant="bolt", name="t")
    _, admin = store.create_api_key(role="admin", tenant=None, name="t")
    settings = gateway_settings(
        tmp_path, (f"http://127.0.0.1:{closed}",), max_concurrent_per_tenant=2, rate_limit_per_s=0
    )
    client, gw = start(settings, clients=started)
    body = {"model": settings.vllm.served_model_name, "prompt": "hi", "max_tokens": 2}

    held = [gw.slots.take("acme"), gw.slots.take("acme")]  # two of acme's requests in flight
    refused = client.post("/v1/completions", json=body, headers={"authorization": f"Bearer {acme}"})
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "1"
    assert "max_concurrent_per_tenant" in refused.json()["error"]["message"]
    assert shed(client, admin, "tenant_cap") == 1
    chat = {
        "model": settings.vllm.served_model_name,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    }
    other = client.post("/v1/chat/completions", json=chat, headers={"authorization": f"Bearer {bolt}"})
    assert other.status_code == 502  # bolt is not held back by acme (its call reached for vLLM)
    assert gw.slots.held("bolt") == 0  # and its slot came back with the error

    for slot in held:
        assert slot is not None
        slot.release()
    answers = [
        client.post("/v1/completions", json=body, headers={"authorization": f"Bearer {acme}"}).status_code,
        client.post(
            "/v1/completions", content=b"{not json", headers={"authorization": f"Bearer {acme}"}
        ).status_code,
        client.post(
            "/v1/completions", json=body | {"stream": True}, headers={"authorization": f"Bearer {acme}"}
        ).status_code,
    ]
    assert answers == [502, 400, 502]
    assert (gw.slots.in_flight, gw.slots.tenants_at_cap) == (0, 0)


def test_no_connection_to_vllm_in_time_is_a_503_not_a_wait(
    tmp_path: Path, store: Store, started: list[TestClient]
) -> None:
    """Eight requests hold the pool's eight connections to a server that never answers; the ninth
    waits `upstream_acquire_timeout_s` for one, then gets 503 with the reason."""
    black_hole = socket.create_server(("127.0.0.1", 0), backlog=64)  # connects, never accepted or answered
    url = f"http://127.0.0.1:{black_hole.getsockname()[1]}"
    store.set_serving_version(url, 1, "test: announced, so no version read is made")
    _, admin = store.create_api_key(role="admin", tenant=None, name="t")
    settings = gateway_settings(
        tmp_path,
        (url,),
        auth="open",
        max_concurrent_per_tenant=0,  # one tenant may fill the pool: what this test needs
        upstream_connections=8,
        upstream_acquire_timeout_s=0.3,
    )
    client, gw = start(settings, clients=started)
    wait_until(lambda: gw.fleet.servers[0].announced is not None, timeout_s=10, what="the announcement read")
    body = {"model": settings.vllm.served_model_name, "prompt": "hi", "max_tokens": 2}
    answers: list[int] = []

    def hang() -> None:
        try:
            answers.append(client.post("/v1/completions", json=body).status_code)
        except httpx.HTTPError:
            answers.append(-1)

    hanging = [threading.Thread(target=hang) for _ in range(8)]
    try:
        for thread in hanging:
            thread.start()
        wait_until(lambda: gw.fleet.servers[0].in_flight == 8, timeout_s=10, what="8 requests on vLLM")
        started_at = time.monotonic()
        refused = client.post("/v1/completions", json=body)
        waited = time.monotonic() - started_at
    finally:
        black_hole.close()  # the held connections are reset: the eight end with an upstream error
        for thread in hanging:
            thread.join(timeout=30)
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] == "1"
    assert "within 0.3s" in refused.json()["error"]["message"]
    assert "8 requests on its 8 upstream connections" in refused.json()["error"]["message"]
    assert 0.3 <= waited < 5
    assert shed(client, admin, "upstream_connection") == 1
    assert len(answers) == 8


def test_a_per_tenant_cap_that_lets_a_few_tenants_fill_the_pool_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert GatewaySettings().max_concurrent_per_tenant * 4 <= GatewaySettings().upstream_connections
    monkeypatch.setenv("RTRL_GATEWAY__UPSTREAM_CONNECTIONS", "256")
    monkeypatch.setenv("RTRL_GATEWAY__MAX_CONCURRENT_PER_TENANT", "100")
    with pytest.raises(SettingsError) as caught:
        load_settings()
    assert "\n" not in str(caught.value)
    assert (
        "RTRL_GATEWAY: Value error, max_concurrent_per_tenant 100 lets 2 tenants take all 256 "
        "upstream_connections; lower it to at most 64 or raise upstream_connections to at least 400"
    ) in str(caught.value)
    monkeypatch.setenv("RTRL_GATEWAY__MAX_CONCURRENT_PER_TENANT", "64")
    assert load_settings().gateway.max_concurrent_per_tenant == 64
    monkeypatch.setenv("RTRL_GATEWAY__MAX_CONCURRENT_PER_TENANT", "0")  # no cap: allowed, logged at start
    assert load_settings().gateway.max_concurrent_per_tenant == 0


def test_client_connections_get_the_send_buffer_and_stall_timeout_of_the_settings() -> None:
    """What bounds how far a stream runs ahead of a client that does not read (Linux doubles the
    buffer), and how long the connection of a client that never reads outlives its stream."""
    import uvicorn

    from ingest.app import listening_socket

    config = uvicorn.Config(lambda scope, receive, send: None, host="127.0.0.1", port=0)
    sock = listening_socket(config, 65536, stall_timeout_s=1.5)
    sock.listen()  # uvicorn's server does this when it starts
    try:
        with socket.create_connection(sock.getsockname()) as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            accepted, _ = sock.accept()
            with accepted:
                assert accepted.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == 2 * 65536
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 1500
                # The client reads nothing: once the buffers are full, the kernel gives up on it.
                accepted.settimeout(10)
                started = time.monotonic()
                with pytest.raises(OSError) as gave_up:
                    while time.monotonic() - started < 10:
                        accepted.send(b"x" * 65536)
                assert isinstance(gave_up.value, TimeoutError) or gave_up.value.errno == 110  # ETIMEDOUT
                assert time.monotonic() - started < 8
    finally:
        sock.close()
    autotuned = listening_socket(config, 0, 0)
    autotuned.close()


def test_a_tenants_requests_in_flight_ask_for_at_most_its_token_budget() -> None:
    slots = TenantSlots(0, max_tokens=1000)
    alone = slots.take("acme")
    assert alone is not None and alone.reserve(5000)  # a tenant's only request always passes
    second = slots.take("acme")
    assert second is not None and not second.reserve(1)  # anything more is over the budget
    assert slots.tokens("acme") == 5000
    other = slots.take("bolt")
    assert other is not None and other.reserve(1000)  # another tenant has its own budget
    alone.release()
    assert second.reserve(600) and not (third := slots.take("acme")).reserve(401)  # type: ignore[union-attr]
    assert third is not None and third.reserve(400)
    for slot in (second, third, other):
        slot.release()
    assert slots._tokens == {} and slots._held == {}  # nothing left behind per tenant seen
    with pytest.raises(ValueError, match=">= 0"):
        TenantSlots(1, max_tokens=-1)


def test_past_its_token_budget_a_tenant_gets_429_and_others_are_served(
    tmp_path: Path, store: Store, started: list[TestClient]
) -> None:
    (closed,) = free_ports(1)  # nothing listens: every generation is a 502, vLLM never reached
    _, acme = store.create_api_key(role="tenant", tenant="acme", name="t")
    _, bolt = store.create_api_key(role="tenant", tenant="bolt", name="t")
    _, admin = store.create_api_key(role="admin", tenant=None, name="t")
    settings = gateway_settings(
        tmp_path, (f"http://127.0.0.1:{closed}",), max_inflight_tokens_per_tenant=1000, rate_limit_per_s=0
    )
    client, gw = start(settings, clients=started)
    model = settings.vllm.served_model_name
    held = gw.slots.take("acme")
    assert held is not None and held.reserve(900)  # acme's streams in flight ask for 900 tokens
    body = {"model": model, "prompt": "hi", "max_tokens": 200}
    refused = client.post("/v1/completions", json=body, headers={"authorization": f"Bearer {acme}"})
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert "max_inflight_tokens_per_tenant" in refused.json()["error"]["message"]
    assert shed(client, admin, "tenant_tokens") == 1
    fits = client.post(
        "/v1/completions", json=body | {"max_tokens": 100}, headers={"authorization": f"Bearer {acme}"}
    )
    assert fits.status_code == 502  # within the budget: it reached for vLLM
    other = client.post("/v1/completions", json=body, headers={"authorization": f"Bearer {bolt}"})
    assert other.status_code == 502  # bolt is not held back by acme
    held.release()
    alone = client.post(
        "/v1/completions", json=body | {"max_tokens": 2000}, headers={"authorization": f"Bearer {acme}"}
    )
    assert alone.status_code == 502  # alone, a request over the whole budget still goes
    assert (gw.slots.in_flight, gw.slots._tokens) == (0, {})
