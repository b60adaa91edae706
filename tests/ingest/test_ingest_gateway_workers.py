"""The gateway with two worker processes (``gateway.workers = 2``, ingest/prefork.py) in front of
the session's vLLM server and Kafka: every request served and captured exactly once, ``/metrics``
the sum over both workers, and SIGTERM draining both (a stream in flight finishes and is captured).

Run by the main session (it starts vLLM and Kafka):
    PYTHONPATH=. .venv/bin/python -m pytest tests/ingest/test_ingest_gateway_workers.py -m integration -q
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import TopicReader, alive

# The gateway tests' fixtures: the session's keys, a gateway factory, the interactions topic.
from test_ingest_gateway import PROMPT, GatewayFactory, Keys, interactions, keys, start_gateway

from schemas.events import InteractionEvent, parse_event
from schemas.settings import Settings

pytestmark = pytest.mark.integration
__all__ = ["interactions", "keys", "start_gateway"]  # fixtures, used by name

REQUESTS = 40
CLIENTS = 8


def completion(
    gateway: str, keys: Keys, model: str, i: int, started: threading.Event | None = None
) -> httpx.Response:
    """One completion on a connection of its own, so the kernel may hand it to either worker; with
    `started`, a stream, and `started` is set once its headers have arrived."""
    body: dict[str, Any] = {"model": model, "prompt": PROMPT, "max_tokens": 8, "seed": i, "temperature": 1.0}
    if started is not None:
        body |= {"stream": True, "max_tokens": 64}
    with (
        httpx.Client(timeout=120) as client,
        client.stream(
            "POST", f"{gateway}/v1/completions", json=body, headers=keys.auth(keys.acme)
        ) as response,
    ):
        if started is not None:
            started.set()
        response.read()
    return response


def sample(page: str, name: str) -> float:
    for line in page.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not on the metrics page")


def test_two_workers_serve_capture_once_sum_metrics_and_drain(
    services: Settings,
    start_gateway: GatewayFactory,
    interactions: TopicReader,
    keys: Keys,
    tmp_path: Path,
) -> None:
    model = services.vllm.served_model_name
    with start_gateway(workers=2) as gateway:
        with ThreadPoolExecutor(CLIENTS) as pool:
            responses = list(pool.map(lambda i: completion(gateway, keys, model, i), range(REQUESTS)))
        assert [r.status_code for r in responses] == [200] * REQUESTS
        ids = {r.headers["x-rtrl-request-id"] for r in responses}
        assert len(ids) == REQUESTS

        page = httpx.get(f"{gateway}/metrics", headers=keys.auth(keys.admin), timeout=10).text
        served = 'rtrl_gateway_requests_total{endpoint="completions",status="200"}'
        assert sample(page, served) == REQUESTS  # both workers' counts, whichever answered
        assert sample(page, "rtrl_gateway_upstream_connections") == 2 * services.gateway.upstream_connections

        (log,) = tmp_path.glob("gateway-*.log")
        workers = [int(p) for p in re.findall(r"gateway worker \d+ started \(pid (\d+)\)", log.read_text())]
        assert len(workers) == 2 and all(alive(pid) for pid in workers)
        # Both workers took connections (each logs its own uvicorn start; the requests' spread is
        # the kernel's, so only that both run is asserted, not an even share).

        # A stream in flight when the gateway is stopped: the worker serving it drains it.
        streamed: list[httpx.Response] = []
        started = threading.Event()
        streaming = threading.Thread(
            target=lambda: streamed.append(completion(gateway, keys, model, 10_000, started))
        )
        streaming.start()
        assert started.wait(60), "the stream did not start"
    # Leaving the block sent SIGTERM to the supervisor and waited for it to exit.
    streaming.join(120)
    assert not any(alive(pid) for pid in workers)
    assert streamed and streamed[0].status_code == 200 and "[DONE]" in streamed[0].text
    ids.add(streamed[0].headers["x-rtrl-request-id"])

    # Every request captured exactly once (the stream's too), whichever worker served it.
    records = interactions.wait_for(lambda r: r.key.decode() in ids, count=len(ids), timeout_s=120)
    captured = [parse_event(r.value, InteractionEvent).request_id for r in records]
    assert sorted(captured) == sorted(ids)
