"""`rtrl simulate` through a real gateway, vLLM server and Kafka broker (the `services` fixture)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import TopicReader, run_rtrl

from schemas.events import FeedbackEvent, InteractionEvent, parse_event
from schemas.settings import Settings
from services.launch import gateway_process
from services.testing import free_ports

pytestmark = pytest.mark.integration

N = 6


def test_rtrl_simulate_sends_interactions_and_feedback(services: Settings, tmp_path: Path) -> None:
    (port,) = free_ports(1)
    settings = services.model_copy(
        update={
            "gateway": services.gateway.model_copy(update={"port": port, "spool_dir": tmp_path / "spool"})
        }
    )
    interactions = TopicReader(settings.kafka, settings.kafka.interactions_topic)
    feedback = TopicReader(settings.kafka, settings.kafka.feedback_topic)

    report_path = tmp_path / "report.json"
    with gateway_process(settings, tmp_path / "gateway.log") as gateway:
        result = run_rtrl(
            settings,
            "simulate",
            "--requests",
            str(N),
            "--concurrency",
            "3",
            "--task",
            "exclaim",
            "--preference",
            "evals.tasks:exclaim_preference",
            "--gateway",
            gateway,
            "--seed",
            "11",
            "--json",
            str(report_path),
            timeout_s=300,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert "acceptance" in result.stdout

    report = json.loads(report_path.read_text())
    assert (report["requests"], report["ok"], report["failed"]) == (N, N, 0)
    assert (
        report["feedback_sent"] >= N and report["feedback_failed"] == 0
    )  # the exclaim user always says something
    assert sum(report["per_version"].values()) == N
    assert 0.0 <= report["acceptance_rate"] <= 1.0
    assert report["acceptance_rate"] == pytest.approx(report["accepted"] / N)

    def simulated(record: object) -> bool:
        return b'"tenant":"sim"' in record.value  # type: ignore[attr-defined]

    events = [parse_event(r.value, InteractionEvent) for r in interactions.wait_for(simulated, count=N)]
    interactions.close()
    assert len(events) == N
    assert {e.policy_version for e in events} == set(report["per_version"])
    assert all(e.session_id and e.session_id.startswith("sim-user-") for e in events)
    sent = [
        parse_event(r.value, FeedbackEvent)
        for r in feedback.wait_for(simulated, count=report["feedback_sent"])
    ]
    feedback.close()
    assert len(sent) == report["feedback_sent"]
    assert {f.request_id for f in sent} == {e.request_id for e in events}
    accepted = {f.request_id for f in sent if f.kind == "accepted"}
    assert len(accepted) == report["accepted"]


@pytest.mark.unit
def test_sparse_and_flipped_feedback_is_seeded_and_keeps_what_users_think() -> None:
    """Of simulated users only `feedback_rate` say anything, and `flip_rate` of those the opposite."""
    import random

    from schemas.events import FeedbackKind, FeedbackSignal
    from simulation.users import _what_the_user_says

    accept = [FeedbackSignal(kind=FeedbackKind.accepted)]
    reject = [
        FeedbackSignal(kind=FeedbackKind.rejected),
        FeedbackSignal(kind=FeedbackKind.followup_dissatisfied),
    ]
    assert (
        _what_the_user_says(accept, True, random.Random(0), 1.0, 0.0) == accept
    )  # the default: everyone, honestly
    said = [_what_the_user_says(accept, True, random.Random(i), 0.3, 0.1) for i in range(4000)]
    silent = sum(s == [] for s in said) / len(said)
    flipped = sum(s == [FeedbackSignal(kind=FeedbackKind.rejected)] for s in said) / sum(
        s != [] for s in said
    )
    assert 0.67 < silent < 0.73 and 0.07 < flipped < 0.13
    assert [_what_the_user_says(accept, True, random.Random(i), 0.3, 0.1) for i in range(50)] == said[
        :50
    ]  # seeded
    assert (
        _what_the_user_says(reject, False, random.Random(1), 1.0, 1.0) == accept
    )  # a rejection flipped: accepted
    assert _what_the_user_says([], False, random.Random(1), 1.0, 1.0) == []  # nothing to flip


@pytest.mark.unit
def test_an_answer_that_is_no_completion_is_a_failed_request_not_the_end_of_the_simulation() -> None:
    """A server that answers 200 with an rtrl request id but no choices (a broken proxy, a wrong
    URL) fails those requests, each with what came back; the simulation runs to its report."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from simulation.users import simulate

    class Broken(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the http.server API
            self.rfile.read(int(self.headers["content-length"]))
            body = b'{"id": "cmpl-1", "object": "text_completion", "choices": []}'
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.send_header("x-rtrl-request-id", "r-1")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Broken)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        report = simulate(Settings(), f"http://127.0.0.1:{server.server_port}", 3, "exclaim", api_key="k")
    finally:
        server.shutdown()
        server.server_close()
    assert (report.requests, report.ok, report.failed, report.feedback_sent) == (3, 0, 3, 0)
    assert all("not a completion (IndexError" in e and '"choices": []' in e for e in report.errors), (
        report.errors
    )
