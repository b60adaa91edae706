"""``GET /v1/models`` of the gateway, with the whole application in-process: its lifespan runs on a
SQLite store (the API keys) and a publisher that never reaches a broker; no vLLM server is called
(the route answers from the settings)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from starlette.testclient import TestClient

from ingest.app import create_app
from schemas.settings import (
    GatewaySettings,
    ServicesSettings,
    Settings,
    StoreSettings,
    TrainerSettings,
    VllmSettings,
)
from store import Store

pytestmark = pytest.mark.unit

Gateway = Callable[..., TestClient]


@pytest.fixture
def gateway(store: Store, tmp_path: Path) -> Iterator[Gateway]:
    """`gateway(served_model_name=..., adapter=..., **gateway_settings)` -> a started TestClient."""
    clients: list[TestClient] = []

    def start(served_model_name: str = "rtrl-tiny", adapter: str = "full", **gateway: Any) -> TestClient:
        settings = Settings(
            store=StoreSettings(url=f"sqlite:///{tmp_path}/rtrl.db"),
            gateway=GatewaySettings(spool_dir=tmp_path / "spool", auth="keys", **gateway),
            services=ServicesSettings(run_dir=tmp_path / "run"),
            vllm=VllmSettings(served_model_name=served_model_name, sampling_defaults={}),
            trainer=TrainerSettings(adapter=adapter),
        )
        client = TestClient(create_app(settings, connect=lambda: None), raise_server_exceptions=True)
        client.__enter__()  # runs the lifespan: keys loaded from the store before the first request
        clients.append(client)
        return client

    yield start
    for client in clients:
        client.__exit__(None, None, None)


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_the_served_model_is_listed_in_openais_shape_for_any_key(gateway: Gateway, store: Store) -> None:
    _, tenant = store.create_api_key(role="tenant", tenant="acme", name="app")
    _, admin = store.create_api_key(role="admin", tenant=None, name="ops")
    before = int(time.time())
    client = gateway()
    after = int(time.time())
    for key in (tenant, admin):
        response = client.get("/v1/models", headers=auth(key))
        assert response.status_code == 200
        body = response.json()
        assert body == {
            "object": "list",
            "data": [
                {
                    "id": "rtrl-tiny",
                    "object": "model",
                    "created": body["data"][0]["created"],
                    "owned_by": "rtrl",
                }
            ],
        }
        assert before <= body["data"][0]["created"] <= after  # when the gateway started
    one = client.get("/v1/models/rtrl-tiny", headers=auth(tenant))
    assert one.status_code == 200 and one.json() == body["data"][0]
    other = client.get("/v1/models/gpt-4o", headers=auth(tenant))
    assert other.status_code == 404
    assert other.json()["error"]["type"] == "NotFoundError" and "'gpt-4o' is not served here" in other.text
    metrics = client.get("/metrics", headers=auth(admin)).text
    assert 'rtrl_gateway_requests_total{endpoint="models",status="200"} 3.0' in metrics
    assert 'rtrl_gateway_requests_total{endpoint="models",status="404"} 1.0' in metrics


def test_models_need_a_valid_key_and_keep_to_its_rate(gateway: Gateway, store: Store) -> None:
    _, key = store.create_api_key(role="tenant", tenant="acme", name="app")
    client = gateway(rate_limit_per_s=0.01, rate_limit_burst=2)
    missing = client.get("/v1/models")
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert missing.json()["error"]["type"] == "AuthenticationError"
    assert client.get("/v1/models", headers=auth(key + "x")).status_code == 401
    assert client.get("/v1/models/rtrl-tiny").status_code == 401
    assert [client.get("/v1/models", headers=auth(key)).status_code for _ in range(3)] == [200, 200, 429]


def test_in_lora_mode_the_adapters_name_is_listed(gateway: Gateway, store: Store) -> None:
    _, key = store.create_api_key(role="tenant", tenant="acme", name="app")
    client = gateway(served_model_name="support-bot", adapter="lora")
    assert [m["id"] for m in client.get("/v1/models", headers=auth(key)).json()["data"]] == ["support-bot"]
    assert (
        client.get("/v1/models/support-bot-base", headers=auth(key)).status_code == 404
    )  # the base is not served


def test_the_official_client_lists_and_retrieves_the_model(gateway: Gateway, store: Store) -> None:
    _, key = store.create_api_key(role="tenant", tenant="acme", name="app")
    http = gateway()

    def client(api_key: str) -> openai.OpenAI:
        return openai.OpenAI(api_key=api_key, base_url=f"{http.base_url}/v1", http_client=http, max_retries=0)

    models = client(key).models.list()
    assert [(m.id, m.object, m.owned_by) for m in models] == [("rtrl-tiny", "model", "rtrl")]
    assert client(key).models.retrieve("rtrl-tiny").id == "rtrl-tiny"
    with pytest.raises(openai.NotFoundError):
        client(key).models.retrieve("gpt-4o")
    with pytest.raises(openai.AuthenticationError, match="invalid or revoked API key"):
        client("sk-not-a-key").models.list()
