"""``POST /v1/feedback`` with the whole application in-process (a SQLite store for the keys, a
publisher that never reaches a broker): bodies no tenant can stall the gateway with, and idempotency
keys scoped to the caller's tenant (docs/security.md, Feedback bodies and Idempotency keys)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from ingest import intake
from ingest.app import create_app
from ingest.auth import EventRate, RequestIds, request_id_secret
from ingest.feedback_route import INLINE_VALUES
from schemas.clock import wait_until
from schemas.events import Id, new_id
from schemas.settings import GatewaySettings, ServicesSettings, Settings, StoreSettings, VllmSettings
from store import Store

pytestmark = pytest.mark.unit

FLOOD = b"[" + b",".join([b"{}"] * 349_000) + b"]"  # what the hostile tenant sent: just under 1 MiB


class Gateway:
    """A started in-process gateway, its tenants' keys, request ids as it signs them, what it
    published and, for each `intake.parse` call, whether it ran on the event loop."""

    def __init__(self, client: TestClient, keys: dict[str, str], run_dir: Path) -> None:
        self.client = client
        self.keys = keys
        self.ids = RequestIds(request_id_secret(None, run_dir))
        self.published: list[dict[str, Any]] = []
        self.parsed_on_loop: list[bool] = []

    def post(self, tenant: str, body: object | bytes) -> Any:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self.client.post(
            "/v1/feedback",
            content=content,
            headers={"authorization": f"Bearer {self.keys[tenant]}", "content-type": "application/json"},
        )


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@pytest.fixture
def gateway(store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Gateway]:
    keys = {t: store.create_api_key(role="tenant", tenant=t, name="app")[1] for t in ("acme", "bolt")}
    settings = Settings(
        store=StoreSettings(url=f"sqlite:///{tmp_path}/rtrl.db"),
        gateway=GatewaySettings(
            spool_dir=tmp_path / "spool", auth="keys", rate_limit_per_s=0, feedback_events_per_s=0
        ),
        services=ServicesSettings(run_dir=tmp_path / "run"),
        vllm=VllmSettings(sampling_defaults={}),
    )
    with TestClient(create_app(settings, connect=lambda: None), raise_server_exceptions=True) as client:
        gw = Gateway(client, keys, tmp_path / "run")
        publisher = client.app.state.gateway.publisher  # type: ignore[attr-defined]

        def confirmed(topic: str, key: str, value: str, schema: str, event_id: str) -> Future[str]:
            gw.published.append(json.loads(value))
            on_kafka: Future[str] = Future()
            on_kafka.set_result("kafka")
            return on_kafka

        monkeypatch.setattr(publisher, "publish_confirmed", confirmed)
        parse = intake.parse

        def spied(raw: bytes) -> list[intake.FeedbackIn] | intake.Invalid:
            gw.parsed_on_loop.append(_on_event_loop())
            return parse(raw)

        monkeypatch.setattr(intake, "parse", spied)
        yield gw


def test_a_flood_of_empty_items_is_refused_before_it_is_parsed(gateway: Gateway) -> None:
    assert len(FLOOD) < GatewaySettings().max_feedback_bytes  # the body limit lets it in
    refused = gateway.post("acme", FLOOD)
    assert refused.status_code == 422
    assert refused.json() == {
        "detail": "send between 1 and 1000 feedback events per request; this body has 349000 "
        "(its '{' characters, counted before parsing)"
    }
    many_values = gateway.post("acme", b"[" + b",".join([b"1"] * 10_000) + b"]")
    many_keys = gateway.post("acme", json.dumps({f"k{i}": 0 for i in range(20_000)}).encode())
    for response, values in ((many_values, 10_000), (many_keys, 20_000)):
        assert response.status_code == 422
        assert response.json()["detail"] == (
            f"a feedback body of at most 1000 events has at most 9000 values; this body has {values} "
            "(its commas plus one, counted before parsing)"
        )
    assert gateway.parsed_on_loop == []  # none of them reached validation
    assert gateway.published == []


def test_the_largest_valid_body_passes_the_precheck() -> None:
    item = {
        "event_id": "e" * 200,
        "request_id": "r" * 200,
        "episode_id": "p" * 200,
        "tenant": "acme",
        "kind": "task_outcome",
        "value": 0.5,
        "created_at": "2026-12-05T08:30:15,5+00:00",  # ISO 8601 allows a comma before the fraction
    }
    body = json.dumps([item] * intake.MAX_FEEDBACK_EVENTS).encode()
    assert intake.precheck(body) is None and intake.precheck(json.dumps(item).encode()) is None
    assert len(intake.parse(body)) == intake.MAX_FEEDBACK_EVENTS  # type: ignore[arg-type]
    assert intake.precheck(json.dumps([item] * (intake.MAX_FEEDBACK_EVENTS + 1)).encode()) is not None


def test_a_refusal_lists_ten_errors_and_their_count_without_the_input(gateway: Gateway) -> None:
    long_id = "x" * 10_000
    response = gateway.post("acme", [{"request_id": long_id, "kind": "loved_it"}] * 50)
    assert response.status_code == 422
    body = response.json()
    assert body["error_count"] == 100  # two errors in each of 50 items
    assert [(e["loc"], e["type"]) for e in body["detail"][:2]] == [
        ([0, "request_id"], "string_too_long"),
        ([0, "kind"], "enum"),
    ]
    assert len(body["detail"]) == intake.MAX_ERRORS_SHOWN and all("input" not in e for e in body["detail"])
    assert len(response.content) < 5000  # the 500 kB of ids are not sent back
    assert gateway.post("acme", b"{nope").json()["detail"][0]["type"] == "json_invalid"


def test_big_bodies_are_parsed_off_the_event_loop(gateway: Gateway) -> None:
    rid = gateway.ids.new("acme")
    small = gateway.post("acme", {"request_id": rid, "kind": "accepted"})
    batch = [{"request_id": rid, "kind": "task_outcome", "value": 0.5}] * intake.MAX_FEEDBACK_EVENTS
    assert intake.values_in(json.dumps(batch).encode()) > INLINE_VALUES
    big = gateway.post("acme", batch)
    bad = gateway.post("acme", [{"request_id": rid, "kind": "loved_it"}] * 200)
    assert (small.status_code, big.status_code, bad.status_code) == (202, 202, 422)
    assert gateway.parsed_on_loop == [True, False, False]
    assert len(gateway.published) == 1 + intake.MAX_FEEDBACK_EVENTS


def test_an_idempotency_key_belongs_to_the_callers_tenant(gateway: Gateway) -> None:
    def send(tenant: str, **item: str) -> list[str]:
        response = gateway.post(tenant, [{"request_id": gateway.ids.new(tenant), "kind": "accepted", **item}])
        assert response.status_code == 202, response.text
        ids: list[str] = response.json()["event_ids"]
        return ids

    first, retry = send("acme", event_id="k-1"), send("acme", event_id="k-1")
    theirs = send("bolt", event_id="k-1")
    fresh, fresh_again = send("acme"), send("acme")
    assert first == retry == [intake.scoped_event_id("acme", "k-1")]  # a retry is recognised downstream
    assert theirs == [intake.scoped_event_id("bolt", "k-1")] != first  # bolt's key is not acme's
    assert fresh != fresh_again and uuid.UUID(fresh[0]).version == 4  # no key: a fresh id each time
    assert [e["event_id"] for e in gateway.published] == first + retry + theirs + fresh + fresh_again
    assert [e["tenant"] for e in gateway.published] == ["acme", "acme", "bolt", "acme", "acme"]


def test_a_tenant_past_its_feedback_events_a_second_gets_429_and_others_are_served(gateway: Gateway) -> None:
    gw = gateway.client.app.state.gateway  # type: ignore[attr-defined]
    gw.feedback_rate = EventRate(rate_per_s=100.0, burst=1000)  # the defaults; the fixture turned them off
    rid = gateway.ids.new("acme")
    flood = [{"request_id": rid, "kind": "accepted"}] * intake.MAX_FEEDBACK_EVENTS
    assert gateway.post("acme", flood).status_code == 202  # one full body passes at once
    refused = gateway.post("acme", flood)
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 9
    assert "gateway.feedback_events_per_s" in refused.json()["detail"]
    other = gateway.post("bolt", {"request_id": gateway.ids.new("bolt"), "kind": "accepted"})
    assert other.status_code == 202  # bolt has its own budget
    assert len(gateway.published) == intake.MAX_FEEDBACK_EVENTS + 1  # nothing of the refused body


def test_scoped_event_ids_are_ids_of_their_own_kind() -> None:
    from pydantic import TypeAdapter

    scoped: Callable[[str, str], str] = intake.scoped_event_id
    assert scoped("acme", "k") == scoped("acme", "k")
    assert len({scoped("acme", "k"), scoped("bolt", "k"), scoped("acme", "k2"), scoped("acm", "ek")}) == 4
    assert TypeAdapter(Id).validate_python(scoped("acme", "x" * 200)) == scoped("acme", "x" * 200)
    assert len(scoped("acme", "k")) == len(new_id()) == 32
    assert uuid.UUID(scoped("acme", "k")).version == 5 != uuid.UUID(new_id()).version


# ---- Corrections: feedback that carries text (schemas/events.py, TEXT_KINDS) -----------------------

CODE = 'def f(x):\n    return {"a": x, "b": [1, 2]}  # \\"quoted\\" and \\\\ a backslash, {not, structure}'


def test_a_correction_is_published_with_its_text_redacted(gateway: Gateway) -> None:
    gw = gateway.client.app.state.gateway  # type: ignore[attr-defined]
    gw.feedback_rate = EventRate(rate_per_s=1.0, burst=2)  # two events at once, no more
    rid = gateway.ids.new("acme")
    sent = [
        {"request_id": rid, "kind": "rejected"},
        {
            "request_id": rid,
            "kind": "correction",
            "text": "the answer is 12, mail me at ann@example.com {ok}",
        },
    ]
    response = gateway.post("acme", sent)  # its braces and commas are no events: the rate lets it through
    assert response.status_code == 202, response.text
    assert [e["kind"] for e in gateway.published] == ["rejected", "correction"]
    assert gateway.published[0]["text"] is None
    assert gateway.published[1]["text"] == "the answer is 12, mail me at [REDACTED:email] {ok}"
    assert gateway.published[1]["schema_version"] == "rtrl.feedback.v1"


def test_an_edit_may_carry_its_code(gateway: Gateway) -> None:
    rid = gateway.ids.new("acme")
    response = gateway.post("acme", {"request_id": rid, "kind": "edited", "text": CODE})
    assert response.status_code == 202, response.text
    assert gateway.published[-1]["text"] == CODE


def test_a_long_text_is_redacted_off_the_event_loop(gateway: Gateway) -> None:
    rid = gateway.ids.new("acme")
    short = gateway.post("acme", {"request_id": rid, "kind": "correction", "text": "12"})
    long = gateway.post("acme", {"request_id": rid, "kind": "correction", "text": "ann@example.com " * 100})
    plain = gateway.post(
        "acme", [{"request_id": rid, "kind": "accepted", "event_id": f"k{i}"} for i in range(30)]
    )
    assert (short.status_code, long.status_code, plain.status_code) == (202, 202, 202)
    assert gateway.parsed_on_loop == [True, False, True]  # a plain batch of 1.6 kB has nothing to redact
    assert gateway.published[1]["text"] == "[REDACTED:email] " * 100
    # The key spelt with an escape is the same field to the parser: still off the loop.
    item = json.dumps({"request_id": rid, "kind": "correction", "text": "ann@example.com " * 100})
    escaped = item.replace('"text"', '"\\u0074ext"', 1)
    assert gateway.post("acme", escaped.encode()).status_code == 202
    assert gateway.parsed_on_loop[-1] is False and gateway.published[-1]["text"] == "[REDACTED:email] " * 100


@pytest.mark.parametrize(
    ("item", "reason"),
    [
        ({"kind": "correction"}, "feedback[0]: a correction needs its text (the corrected answer or a hint)"),
        ({"kind": "accepted", "text": "nice"}, "feedback[0]: feedback of kind accepted carries no text"),
    ],
)
def test_text_that_does_not_fit_the_kind_is_refused_with_its_reason(
    gateway: Gateway, item: dict[str, str], reason: str
) -> None:
    response = gateway.post("acme", {"request_id": gateway.ids.new("acme"), **item})
    assert response.status_code == 422
    assert response.json()["detail"][0].startswith(reason)
    assert gateway.published == []


def test_hostile_corrections_are_refused_not_published(gateway: Gateway) -> None:
    rid = gateway.ids.new("acme")
    too_long = gateway.post("acme", {"request_id": rid, "kind": "correction", "text": "x" * 8001})
    assert too_long.status_code == 422
    assert [(e["loc"], e["type"]) for e in too_long.json()["detail"]] == [(["text"], "string_too_long")]
    nul = gateway.post("acme", {"request_id": rid, "kind": "correction", "text": "a\u0000b"})
    assert nul.status_code == 422 and "NUL" in nul.json()["detail"][0]["msg"]
    not_utf8 = gateway.post(
        "acme", b'{"request_id": "' + rid.encode() + b'", "kind": "correction", "text": "\xff"}'
    )
    assert not_utf8.status_code == 422 and not_utf8.json()["detail"][0]["type"] == "json_invalid"
    surrogate = gateway.post("acme", b'{"request_id": "r", "kind": "correction", "text": "\\ud800"}')
    assert surrogate.status_code == 422
    body = json.dumps([{"request_id": rid, "kind": "correction", "text": "y" * 8000}] * 200).encode()
    huge = gateway.post("acme", body)
    assert huge.status_code == 413  # over gateway.max_feedback_bytes: one line, in the OpenAI shape
    assert huge.json() == {
        "error": {
            "message": f"request body of {len(body)} bytes is over the 1048576-byte limit",
            "type": "BadRequestError",
            "param": None,
            "code": 413,
        }
    }
    assert gateway.published == []


def test_a_mask_longer_than_the_text_is_cut_to_the_limit(gateway: Gateway) -> None:
    text = ("a@b.cc " * 1200)[:8000]  # each 6-character address becomes a 16-character mask
    response = gateway.post(
        "acme", {"request_id": gateway.ids.new("acme"), "kind": "correction", "text": text}
    )
    assert response.status_code == 202, response.text
    published = gateway.published[-1]["text"]
    assert len(published) == 8000 and published.startswith("[REDACTED:email] [REDACTED:email]")
    assert "a@b.cc" not in published


def test_only_structure_outside_strings_is_counted() -> None:
    item = {"request_id": "r", "kind": "edited", "text": CODE + ",{" * 3000}
    counted = intake.counts(json.dumps([item] * 2).encode())
    assert counted == intake.Counts(events=2, values=6)  # two objects of three values: five commas
    plain = {"request_id": "r", "kind": "accepted"}
    assert intake.counts(json.dumps(plain).encode()) == intake.Counts(events=1, values=2)
    quotes = b'[{"text": "' + b'"",' * 40_000 + b'"}]'
    problem = intake.counts(quotes)
    assert isinstance(problem, str) and problem.startswith(
        "a feedback body of at most 1000 events has at most"
    )
    # A string cannot hide a flood: "text" inside one is escaped, and the flood's braces are outside.
    hidden = (
        b'[{"request_id": "r", "kind": "edited", "text": "\\"text\\""},' + b",".join([b"{}"] * 2000) + b"]"
    )
    assert intake.precheck(hidden) is not None


# ---- Accepted means durable (docs/security.md) ---------------------------------------------------


def durable_app(store: Store, tmp_path: Path, **gateway: Any) -> tuple[TestClient, dict[str, str]]:
    """The whole application with its real publisher and no broker: feedback can only be spooled."""
    keys = {"acme": store.create_api_key(role="tenant", tenant="acme", name="app")[1]}
    settings = Settings(
        store=StoreSettings(url=f"sqlite:///{tmp_path}/rtrl.db"),
        gateway=GatewaySettings(spool_dir=tmp_path / "spool", auth="keys", rate_limit_per_s=0, **gateway),
        services=ServicesSettings(run_dir=tmp_path / "run"),
        vllm=VllmSettings(sampling_defaults={}),
    )
    return TestClient(create_app(settings, connect=lambda: None)), keys


def send_feedback(client: TestClient, key: str, run_dir: Path, event_id: str = "k-1") -> Any:
    rid = RequestIds(request_id_secret(None, run_dir)).new("acme")
    body = {"request_id": rid, "kind": "accepted", "event_id": event_id}
    return client.post("/v1/feedback", json=body, headers={"authorization": f"Bearer {key}"})


def test_feedback_is_answered_202_only_once_it_is_in_the_spool(store: Store, tmp_path: Path) -> None:
    client, keys = durable_app(store, tmp_path)
    with client:
        publisher = client.app.state.gateway.publisher  # type: ignore[attr-defined]
        response = send_feedback(client, keys["acme"], tmp_path / "run")
        assert response.status_code == 202, response.text
        spooled = [r for p in publisher.spool.sealed_segments() for r in publisher.spool.read(p).records]
        assert [r.event_id for r in spooled] == response.json()["event_ids"]  # on disk before the 202


def test_feedback_the_spool_cannot_take_is_answered_503(store: Store, tmp_path: Path) -> None:
    client, keys = durable_app(store, tmp_path, spool_max_bytes=10, overflow_max_bytes=0)
    with client:
        response = send_feedback(client, keys["acme"], tmp_path / "run")
    assert response.status_code == 503 and response.headers["retry-after"] == "5"
    message = response.json()["error"]["message"]
    assert message == (
        "feedback not stored: the gateway's spool and overflow file are full; "
        "retry with the same event_id values"
    )


def test_feedback_waits_for_durability_without_holding_the_event_loop(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While one feedback request waits for its event to be acknowledged, the gateway answers
    others; a confirmation that never comes is a 503 after `confirm_within_s`."""
    client, keys = durable_app(store, tmp_path, publish_timeout_s=0.5)
    pending: list[Future[str]] = []

    def never_yet(topic: str, key: str, value: str, schema: str, event_id: str) -> Future[str]:
        pending.append(Future())
        return pending[-1]

    with client:
        monkeypatch.setattr(client.app.state.gateway.publisher, "publish_confirmed", never_yet)  # type: ignore[attr-defined]
        with ThreadPoolExecutor(max_workers=1) as pool:
            waiting = pool.submit(send_feedback, client, keys["acme"], tmp_path / "run")
            wait_until(lambda: bool(pending), timeout_s=10, what="the feedback request waiting")
            assert client.get("/healthz").status_code == 200  # the loop is free meanwhile
            pending[0].set_result("kafka")
            assert waiting.result(timeout=10).status_code == 202
        started = time.monotonic()
        timed_out = send_feedback(client, keys["acme"], tmp_path / "run", event_id="k-2")
        waited = time.monotonic() - started
    assert timed_out.status_code == 503 and timed_out.headers["retry-after"] == "1"
    assert (
        "1 of 1 events were not on Kafka or in the spool within 1.75s" in timed_out.json()["error"]["message"]
    )
    assert 1.75 <= waited < 5


def test_shutdown_awaits_captures_then_flushes_the_publisher(store: Store, tmp_path: Path) -> None:
    """A capture still running when the gateway stops publishes its event before the publisher
    closes (no broker: into the spool); one that outlasts shutdown_grace_s is cancelled."""
    client, _ = durable_app(store, tmp_path, shutdown_grace_s=1.0)
    with client:
        gw = client.app.state.gateway  # type: ignore[attr-defined]
        publisher = gw.publisher

        async def capture(delay_s: float, key: str) -> None:
            await asyncio.sleep(delay_s)
            gw.publisher.publish("rtrl.interactions.v1", key, "{}", "rtrl.interaction.v1", key)

        async def start() -> None:
            for delay_s, key in ((0.2, "late"), (30.0, "never")):
                task = asyncio.get_running_loop().create_task(capture(delay_s, key))
                gw.tasks.add(task)
                task.add_done_callback(gw.tasks.discard)

        client.portal.call(start)  # type: ignore[union-attr]
        started = time.monotonic()
    assert time.monotonic() - started < 5
    spooled = [r.key for p in publisher.spool.sealed_segments() for r in publisher.spool.read(p).records]
    assert spooled == ["late"]
