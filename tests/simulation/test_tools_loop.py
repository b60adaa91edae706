"""Tool calls through the whole loop (issue 40): the official ``openai`` client with ``tools`` through
the gateway, against vLLM serving the lookup model with its pythonic tool parser.

The session's vLLM servers serve the exclaim model without a tool parser, so this module starts a
server of its own (`tools_server`: the lookup model, ``rtrl model init --task lookup --recipe tools``,
built once, about 1.5 to 2.5 minutes on two cores; the server, about a minute more). On it:

* a tool call comes back parsed (``tool_calls``, no content), the agent sends the tool's result in a
  ``tool`` message with the same ``x-rtrl-episode-id``, the final answer comes back;
* the labeler settles one episode of two captured segments, both trainable; the tool's result is in
  the second segment's prompt (text and tokens) and in no completion, so the rows the trainer builds
  hold it only before ``prompt_len``: masked from the loss;
* the simulated agent of ``rtrl demo --scenario tools`` (simulation/tools.py) plays episodes the same way;
* a real cycle (DeepSpeed on CPU, MLflow) trains the episodes and registers a version.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from factories import fresh_topics

import streams
from evals.tasks import LOOKUP, LOOKUP_TOOL
from feedback.labeler import Labeler, make_consumer, make_producer
from registry import CHAMPION, Registry
from schemas.clock import wait_until
from schemas.settings import Settings, StoreSettings
from services.launch import gateway_process
from services.testing import free_ports
from store import Store
from store.models import Interaction

pytestmark = pytest.mark.integration

TENANT = "tools"
WINDOW_S = 600.0  # the labeler's settle window: longer than the test, so only episode_end settles


@pytest.fixture(scope="module")
def lookup_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model tuned to call the lookup tool and answer from its result."""
    from services.tinymodel import build

    return build(tmp_path_factory.mktemp("lookup") / "model", task="lookup", seed=0, recipe="tools")


@pytest.fixture(scope="module")
def tools_server(services: Settings, lookup_model: Path) -> Iterator[Settings]:
    """The session's settings with a vLLM server of this module's own as the only fleet server: the
    lookup model, started with --enable-auto-tool-choice --tool-call-parser pythonic, weight version 1."""
    from services.vllm import Vllm
    from serving import VllmClient

    (port,) = free_ports(1)
    vllm = services.vllm.model_copy(update={"model_dir": lookup_model, "tool_call_parser": "pythonic"})
    unit = Vllm(services.model_copy(update={"vllm": vllm}), port=port, name="vllm-tools")
    settings = services.model_copy(update={"vllm": vllm.model_copy(update={"servers": (unit.address,)})})
    unit.start()
    try:
        unit.wait_healthy(timeout_s=600)
        unit.after_start()
        with VllmClient(unit.address, model=vllm.served_model_name) as server:
            server.update_weight_version(1)
        yield settings
    finally:
        unit.stop()


@dataclass
class Loop:
    settings: Settings
    store: Store
    registry: Registry
    url: str
    key: str


@pytest.fixture
def loop(tools_server: Settings, lookup_model: Path, tmp_path: Path) -> Iterator[Loop]:
    """A gateway of this test's own in front of the tools server, fresh topics, store and registry."""
    (port,) = free_ports(1)
    tag = uuid.uuid4().hex[:8]
    settings = fresh_topics(tools_server, prefix="tools")
    settings = settings.model_copy(
        update={
            "store": StoreSettings(url=f"sqlite:///{tmp_path}/rtrl.db"),
            "services": settings.services.model_copy(update={"run_dir": tmp_path / "run"}),
            "gateway": settings.gateway.model_copy(update={"port": port, "spool_dir": tmp_path / "spool"}),
            "mlflow": settings.mlflow.model_copy(
                update={"model_name": f"tools-{tag}", "experiment": f"tools-{tag}"}
            ),
            "labeler": settings.labeler.model_copy(
                update={"reward_spec": "tab-v1", "settle_window_s": WINDOW_S, "poll_timeout_ms": 200}
            ),
            "trainer": settings.trainer.model_copy(
                update={
                    "min_samples": 4,
                    "max_episodes": 64,
                    "steps": 2,
                    "micro_batch": 8,
                    "checkpoint_dir": tmp_path / "ckpt",
                }
            ),
            # Every episode trains (none is held out for the gate's off-policy estimate).
            "gate": settings.gate.model_copy(
                update={"ope": settings.gate.ope.model_copy(update={"holdout_percent": 0})}
            ),
        }
    )
    streams.ensure_topics(settings.kafka)
    store = Store(settings.store.url)
    store.migrate()
    _, key = store.create_api_key(role="tenant", tenant=TENANT, name="tools test", rate_per_s=0)
    registry = Registry.from_settings(settings)
    registry.set_alias(CHAMPION, registry.register_checkpoint(lookup_model, tags={"rtrl.base": "true"}))
    try:
        with gateway_process(settings, tmp_path / "gateway.log") as url:
            yield Loop(settings, store, registry, url, key)
    finally:
        store.close()


@dataclass
class Played:
    """One episode as the client saw it: the parsed answers and the gateway's request ids."""

    question: str
    first: Any  # openai ChatCompletion
    first_id: str
    final: Any | None = None  # None: the model answered without calling the tool
    final_id: str | None = None
    result: str | None = None  # the tool's result


def create(
    client: Any, messages: list[dict[str, Any]], episode: str, segment: int, seed: int
) -> tuple[Any, str]:
    """One chat call with the lookup tool (tool_choice auto): (the parsed answer, x-rtrl-request-id)."""
    raw = client.chat.completions.with_raw_response.create(
        model="rtrl-tiny",
        messages=messages,
        tools=[LOOKUP_TOOL],
        tool_choice="auto",
        max_tokens=LOOKUP.max_tokens,
        seed=seed,
        extra_headers={
            "x-rtrl-episode-id": episode,
            "x-rtrl-segment-index": str(segment),
            "x-rtrl-role": "policy",
        },
    )
    return raw.parse(), raw.headers["x-rtrl-request-id"]


def tool_episode(client: Any, question: str, episode: str, seed: int) -> Played:
    """One episode as an application with tools plays it, with the openai client."""
    from simulation.tools import run_tool

    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    first, first_id = create(client, messages, episode, 0, seed)
    calls = first.choices[0].message.tool_calls
    if not calls:
        return Played(question, first, first_id)
    [call] = calls
    result = run_tool(call.model_dump(mode="json"))
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(mode="json")]},
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    final, final_id = create(client, messages, episode, 1, seed)
    return Played(question, first, first_id, final, final_id, result)


def label(loop: Loop, settled: int) -> None:
    """Run a labeler until `settled` episodes are settled."""
    worker = Labeler(loop.settings, loop.store, make_consumer(loop.settings), make_producer(loop.settings))

    def done() -> bool:
        worker.step()
        return loop.store.stats()["episodes_settled"] >= settled

    try:
        wait_until(done, timeout_s=180, interval_s=0.0, what=f"{settled} episodes settled")
    finally:
        worker.consumer.close(autocommit=False)
        worker.producer.close()
        worker.close()


def segments(loop: Loop, episode: str) -> list[Interaction]:
    from sqlalchemy import select

    with loop.store.transaction() as session:
        rows = session.scalars(
            select(Interaction)
            .where(Interaction.episode_id == f"{TENANT}:{episode}")
            .order_by(Interaction.segment_index)
        ).all()
        session.expunge_all()
        return list(rows)


def find(haystack: list[int], needle: list[int]) -> int | None:
    for i in range(len(haystack) - len(needle) + 1):
        if haystack[i : i + len(needle)] == needle:
            return i
    return None


def test_a_tool_call_its_result_and_the_answer_are_one_episode_masked_and_trained(
    loop: Loop, lookup_model: Path
) -> None:
    from openai import OpenAI
    from transformers import AutoTokenizer

    from simulation.tools import run_tool_agents
    from trainer.cycle import run_cycle

    client = OpenAI(base_url=f"{loop.url}/v1", api_key=loop.key, max_retries=0, timeout=120)
    http = httpx.Client(timeout=60, headers={"authorization": f"Bearer {loop.key}"})
    played: dict[str, Played] = {}
    try:
        # ---- the openai client with tools: call, result, answer; feedback ends each episode ----------
        # Sampled at temperature 1 (trainable); the model calls the tool for about 99 % of the training
        # questions, so four tries give at least one two-segment episode all but surely.
        for n, q in enumerate(LOOKUP.train_questions()[:4]):
            played[f"tools-{n}"] = tool_episode(client, q.text, f"tools-{n}", seed=n)
        two = [name for name, p in played.items() if p.final is not None]
        assert two, {name: p.first.choices[0].message for name, p in played.items()}
        episode, p = two[0], played[two[0]]
        [call] = p.first.choices[0].message.tool_calls
        assert (call.type, call.function.name) == ("function", "lookup")
        assert set(json.loads(call.function.arguments)) == {"item"}
        assert p.first.choices[0].finish_reason == "tool_calls" and p.first.choices[0].message.content is None
        assert not p.final.choices[0].message.tool_calls and p.final.choices[0].message.content is not None
        assert p.result
        for n, (name, each) in enumerate(played.items()):
            _feedback(http, loop, name, each.final_id or each.first_id, accepted=n % 2 == 0)
        # ---- the demo's simulated agent, the same way ------------------------------------------------
        report = run_tool_agents(loop.settings, loop.url, 2, "lookup", api_key=loop.key, seed=7, run="t")
        assert (report.ok, report.failed, report.feedback_failed) == (2, 0, 0), report.errors
        label(loop, settled=len(played) + 2)
    finally:
        http.close()
        client.close()

    # ---- captured: one episode of two segments, the tool's result only in the second's prompt -------
    captured = segments(loop, episode)
    assert [s.segment_index for s in captured] == [0, 1]
    assert all(s.trainable and s.role == "policy" for s in captured), [
        (s.trainable, s.role) for s in captured
    ]
    assert captured[0].prompt.endswith(LOOKUP.call_prompt(p.question))
    assert json.loads(captured[0].completion) == [{"name": "lookup", "arguments": call.function.arguments}]
    assert captured[1].prompt.endswith(f"</s>\nR: {p.result}\nA:") and "R: " not in captured[0].prompt
    assert all("R: " not in s.completion for s in captured)
    assert captured[1].completion == p.final.choices[0].message.content
    assert captured[1].prompt_token_ids[: len(captured[0].prompt_token_ids)] == captured[0].prompt_token_ids

    tokenizer = AutoTokenizer.from_pretrained(lookup_model)
    observed = tokenizer(f"\nR: {p.result}\n", add_special_tokens=False)["input_ids"][1:-1]
    assert len(observed) >= 2
    assert find(captured[1].prompt_token_ids, observed) is not None
    assert all(find(s.completion_token_ids, observed) is None for s in captured)

    # ---- trained: the rows hold the result before prompt_len (no loss there); a real cycle ----------
    from trainer.advantages import BaselineState, compute_advantages
    from trainer.batch import episode_prompt_key, rows_of
    from trainer.selection import select_trainable

    training = loop.settings.model_copy(
        update={"labeler": loop.settings.labeler.model_copy(update={"settle_window_s": 0.0})}
    )
    selected = select_trainable(training, loop.store, loop.registry.champion())
    advantages, _ = compute_advantages(
        [episode_prompt_key(e) for e in selected], [e.reward for e in selected], BaselineState()
    )
    rows, _ = rows_of(selected, advantages.values)
    second = [r for r in rows if r.source == (f"{TENANT}:{episode}", 1)]
    assert len(second) == 1 and len([r for r in rows if r.source == (f"{TENANT}:{episode}", 0)]) == 1
    at = find(second[0].input_ids, observed)
    assert at is not None and at + len(observed) <= second[0].prompt_len  # masked: prompt, never a target
    result_cycle = run_cycle(training, loop.store, loop.registry, owner="tools-test")
    assert result_cycle.status == "registered", result_cycle


def _feedback(http: httpx.Client, loop: Loop, episode: str, request_id: str, accepted: bool) -> None:
    """The users' verdict on the episode's final answer, then episode_end, which settles it."""
    items = [
        {"request_id": request_id, "kind": "accepted" if accepted else "rejected"},
        {"request_id": request_id, "episode_id": episode, "kind": "episode_end"},
    ]
    response = http.post(f"{loop.url}/v1/feedback", json=items)
    assert response.status_code == 202, response.text
