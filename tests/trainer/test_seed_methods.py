"""The seed methods end to end on real services: multi-segment episodes sent through the gateway, labelled
by the labeler from Kafka, and trained by a real cycle (DeepSpeed on CPU, MLflow), one test per method
(docs/methods.md): Kimi PARL, Cursor's self-summarization, Chroma's self-editing agent, and the judge
term of a reward spec with its endpoint down.

Each test starts its own gateway (`rtrl gateway`, a child process) on fresh topics and a store of its own,
runs the labeler in-process until the episodes settle on the client's end signal (the settle window is
long: a window settlement would fail the test), then checks three things the issue asks for:

* the right segments become rows, each with its episode's advantage (trainer.batch.rows_of on what the
  cycle selects);
* tokens that must not learn get zero gradient, checked on the gradient of the cycle's own loss with
  respect to every target position (`assert_gradients_only_on_completions`): prompt tokens, sub-agent
  output seen as an observation, and padding get exactly zero, the trainable completion tokens not;
* a real cycle registers a version, and its MLflow run has the method's measurements (PARL: the λ
  schedule and critical steps).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from factories import fresh_topics
from prometheus_client import REGISTRY

import streams
from feedback.labeler import Labeler, make_consumer, make_producer
from registry import CHAMPION, Registry
from schemas.clock import wait_until
from schemas.settings import JudgeSettings, Settings, StoreSettings
from services.launch import gateway_process
from services.testing import free_ports
from store import Store, TrainingEpisode
from store.models import Episode, Interaction

pytestmark = pytest.mark.integration

TENANT = "acme"
WINDOW_S = 600.0  # the labeler's settle window: longer than any test, so only end signals settle


@dataclass
class Loop:
    """One test's gateway, labeler settings, store and registry."""

    settings: Settings  # the labeler's (long settle window)
    store: Store
    registry: Registry
    url: str
    http: httpx.Client
    key: str

    def call(
        self,
        prompt: str,
        episode: str,
        segment: int,
        role: str = "policy",
        agent: str | None = None,
        seed: int = 0,
        max_tokens: int = 8,
    ) -> tuple[str, str]:
        """One model call of `episode` through the gateway: (request id, completion text)."""
        headers = {"x-rtrl-episode-id": episode, "x-rtrl-segment-index": str(segment), "x-rtrl-role": role}
        if agent is not None:
            headers["x-rtrl-agent"] = agent
        body = {
            "model": self.settings.vllm.served_model_name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "seed": seed,
            "stop": ["\n"],
        }
        response = self.http.post(f"{self.url}/v1/completions", json=body, headers=headers)
        assert response.status_code == 200, response.text
        return response.headers["x-rtrl-request-id"], response.json()["choices"][0]["text"]

    def feedback(self, *items: dict[str, Any]) -> None:
        response = self.http.post(f"{self.url}/v1/feedback", json=list(items))
        assert response.status_code == 202, response.text

    def label(self, settled: int, timeout_s: float = 180.0, **labeler: Any) -> Labeler:
        """Run a labeler (this loop's settings, `labeler` overrides) until `settled` episodes are settled."""
        settings = self.settings.model_copy(
            update={"labeler": self.settings.labeler.model_copy(update=labeler)}
        )
        worker = Labeler(settings, self.store, make_consumer(settings), make_producer(settings))

        def done() -> bool:
            worker.step()
            return self.store.stats()["episodes_settled"] >= settled

        try:
            wait_until(done, timeout_s=timeout_s, interval_s=0.0, what=f"{settled} episodes settled")
        except TimeoutError as exc:
            with self.store.transaction() as session:
                from sqlalchemy import select

                from store.models import Feedback

                state = {
                    "episodes": [(e.episode_id, e.status) for e in session.scalars(select(Episode))],
                    "segments": [
                        (i.episode_id, i.segment_index, i.late) for i in session.scalars(select(Interaction))
                    ],
                    "feedback": [
                        (f.kind, f.request_id[:8], f.episode_id, f.joined_episode_id, f.late)
                        for f in session.scalars(select(Feedback))
                    ],
                }
            raise AssertionError(
                f"{exc}; assigned {worker.consumer.assignment()}; the store: {state}"
            ) from None
        finally:
            worker.consumer.close(autocommit=False)
            worker.producer.close()
            worker.close()
        return worker

    def training_settings(self) -> Settings:
        """The trainer's settings: what the labeler settled is trainable at once."""
        return self.settings.model_copy(
            update={"labeler": self.settings.labeler.model_copy(update={"settle_window_s": 0.0})}
        )

    def episodes(self) -> dict[str, Episode]:
        with self.store.transaction() as session:
            from sqlalchemy import select

            rows = session.scalars(select(Episode)).all()
            session.expunge_all()
            return {e.episode_id.split(":", 1)[1]: e for e in rows}

    def segments(self, episode: str) -> list[Interaction]:
        with self.store.transaction() as session:
            from sqlalchemy import select

            rows = session.scalars(
                select(Interaction)
                .where(Interaction.episode_id == f"{TENANT}:{episode}")
                .order_by(Interaction.segment_index)
            ).all()
            session.expunge_all()
            return list(rows)


@pytest.fixture
def make_loop(services: Settings, tiny_model_dir: Path, tmp_path: Path) -> Callable[..., Any]:
    """`with make_loop(reward_spec, judge=None) as loop:` a gateway, store and registry of this test."""

    @contextmanager
    def make(reward_spec: str, judge: JudgeSettings | None = None) -> Iterator[Loop]:
        tag = uuid.uuid4().hex[:8]
        (port,) = free_ports(1)
        settings = fresh_topics(services, prefix="methods")
        settings = settings.model_copy(
            update={
                "store": StoreSettings(url=f"sqlite:///{tmp_path}/rtrl-{tag}.db"),
                "services": settings.services.model_copy(update={"run_dir": tmp_path / f"run-{tag}"}),
                "gateway": settings.gateway.model_copy(
                    update={"port": port, "spool_dir": tmp_path / f"spool-{tag}"}
                ),
                "mlflow": settings.mlflow.model_copy(
                    update={"model_name": f"methods-{tag}", "experiment": f"methods-{tag}"}
                ),
                "labeler": settings.labeler.model_copy(
                    update={
                        "reward_spec": reward_spec,
                        "settle_window_s": WINDOW_S,
                        "poll_timeout_ms": 200,
                        "judge": judge,
                    }
                ),
                "trainer": settings.trainer.model_copy(
                    update={
                        "min_samples": 4,
                        "max_episodes": 64,
                        "steps": 2,
                        "micro_batch": 8,
                        "checkpoint_dir": tmp_path / f"ckpt-{tag}",
                    }
                ),
                "gate": settings.gate.model_copy(
                    update={"ope": settings.gate.ope.model_copy(update={"holdout_percent": 0})}
                ),
            }
        )
        streams.ensure_topics(settings.kafka)
        store = Store(settings.store.url)
        store.migrate()
        _, key = store.create_api_key(role="tenant", tenant=TENANT, name="methods test", rate_per_s=0)
        registry = Registry.from_settings(settings)
        registry.set_alias(CHAMPION, registry.register_checkpoint(tiny_model_dir, tags={"rtrl.base": "true"}))
        http = httpx.Client(timeout=60, headers={"authorization": f"Bearer {key}"})
        try:
            with gateway_process(settings, tmp_path / f"gateway-{tag}.log") as url:
                yield Loop(settings, store, registry, url, http, key)
        finally:
            http.close()
            store.close()

    return make


def trainable_calls(episodes: list[TrainingEpisode], role: str | None = None) -> set[tuple[int, ...]]:
    """prompt + completion of every trainable call with a completion (of `role`, if given)."""
    return {
        tuple(s.prompt_token_ids + s.completion_token_ids)
        for e in episodes
        for s in e.segments
        if s.trainable and s.completion_token_ids and role in (None, s.role)
    }


def select_rows(loop: Loop) -> tuple[list[TrainingEpisode], list[Any]]:
    """What a cycle would select now and the rows it would train (trainer/cycle.py and trainer/batch.py, with its advantages)."""
    from trainer.advantages import BaselineState, compute_advantages
    from trainer.batch import episode_prompt_key, rows_of
    from trainer.selection import select_trainable

    settings = loop.training_settings()
    episodes = select_trainable(settings, loop.store, loop.registry.champion())
    adv, _ = compute_advantages(
        [episode_prompt_key(e) for e in episodes], [e.reward for e in episodes], BaselineState()
    )
    rows, left_out = rows_of(episodes, adv.values)
    assert left_out == {}
    return episodes, rows


def assert_gradients_only_on_completions(
    tiny_model_dir: Path, settings: Settings, rows: list[Any], observations: list[list[int]] | None = None
) -> None:
    """Backpropagate the cycle's own loss through the champion and check the gradient at every target
    position: exactly zero on prompt tokens (`observations`, token runs that must sit in some row's prompt,
    included) and padding, non-zero on every trainable completion token of a row with an advantage."""
    from transformers import AutoModelForCausalLM

    from serving.sampler import micro_batches, token_logprobs
    from trainer.losses import Normaliser, TokenBatch, loss_function

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    batches = micro_batches(rows, 64, pad_id=0)
    norm = Normaliser(tokens=sum(b.tokens for b in batches), sequences=len(rows))
    loss_fn = loss_function(settings.trainer.loss)
    seen = {tuple(o): False for o in observations or []}
    for mb in batches:
        logprobs, possible, _ = token_logprobs(model, mb)  # (B, L−1)
        logprobs.retain_grad()
        mask = mb.mask * possible
        out = loss_fn(
            TokenBatch(logprobs, logprobs.detach(), mb.behaviour_logprobs, mb.advantages, mask),
            settings.trainer.loss,
            norm,
        )
        out.loss.backward()
        grad = logprobs.grad
        assert grad is not None
        assert torch.all(grad[mask == 0] == 0), "a prompt, observation or padding position has a gradient"
        for b in range(mb.input_ids.shape[0]):
            if abs(float(mb.advantages[b])) > 1e-9:
                assert torch.all(grad[b][mask[b] == 1] != 0), "a trainable completion token has no gradient"
            ids = mb.input_ids[b].tolist()
            prompt_len = int(mb.prompt_len[b])
            for run in seen:
                at = _find(ids[:prompt_len], list(run))
                if at is not None:
                    seen[run] = True
                    # Target position t predicts token t + 1: the observation's tokens are targets at.. at+len-2.
                    positions = range(max(at - 1, 0), at + len(run) - 1)
                    assert all(float(grad[b, t]) == 0.0 for t in positions)
        model.zero_grad()
    assert all(seen.values()), (
        f"observations not found in any row's prompt: {[k for k, v in seen.items() if not v]}"
    )


def _find(haystack: list[int], needle: list[int]) -> int | None:
    for i in range(len(haystack) - len(needle) + 1):
        if haystack[i : i + len(needle)] == needle:
            return i
    return None


def train_cycle(loop: Loop) -> Any:
    from trainer.cycle import run_cycle

    result = run_cycle(loop.training_settings(), loop.store, loop.registry, owner="methods-test")
    assert result.status == "registered", result
    return result


# ---- Kimi PARL ----------------------------------------------------------------------------------------


def test_parl_orchestrator_trains_subagents_stay_frozen_and_the_run_has_the_schedule(
    make_loop: Callable[..., Any], tiny_model_dir: Path
) -> None:
    questions = ["What is 2 plus 3?", "Name a color.", "What is 4 plus 1?", "What comes after 6?"]
    with make_loop("parl-v1") as loop:
        observations = []
        for n, question in enumerate(questions):
            episode, q = f"parl-{n}", f"Q: {question}\nA:"
            _, plan = loop.call(q, episode, 0, role="orchestrator", seed=n)
            # Stage 1: sub-agent a makes two calls, b one; their answers come back as observations.
            _, a1 = loop.call("Q: What is 1 plus 1?\nA:", episode, 1, role="subagent", agent="a", seed=n)
            _, a2 = loop.call(
                f"Q: What is 1 plus 1?\nA:{a1}\nQ: And 2 plus 2?\nA:",
                episode,
                2,
                role="subagent",
                agent="a",
                seed=n,
            )
            _, b1 = loop.call("Q: Name a fruit.\nA:", episode, 3, role="subagent", agent="b", seed=n)
            # Stage 2: the orchestrator answers with what its sub-agents found.
            final_prompt = f"{q}{plan}\nNotes:{a2} {b1}\n{q}"
            last, _ = loop.call(final_prompt, episode, 4, role="orchestrator", seed=n)
            loop.feedback(
                {"request_id": last, "episode_id": episode, "kind": "task_outcome", "value": float(n % 2)}
            )
            observations.append(f"Notes:{a2} {b1}")
        loop.label(settled=len(questions))

        # ---- labelled: one reward per episode, its shaping and its critical steps ----------------------
        episodes = loop.episodes()
        for n in range(len(questions)):
            episode = episodes[f"parl-{n}"]
            segments = loop.segments(f"parl-{n}")
            assert episode.settle_reason == "terminal_feedback"
            assert [s.role for s in segments] == [
                "orchestrator",
                "subagent",
                "subagent",
                "subagent",
                "orchestrator",
            ]
            assert [s.trainable for s in segments] == [True, False, False, False, True]
            assert [s.agent for s in segments] == [None, "a", "a", "b", None]
            metrics = episode.metrics or {}
            # Stage 1: 1 orchestrator call + sub-agent a's 2; stage 2: 1 orchestrator call.
            assert (metrics["stages"], metrics["critical_steps"], metrics["subagents"]) == (2, 4, 2)
            finished = sum(s.finish_reason == "stop" for s in (segments[2], segments[3]))
            assert metrics["subagents_finished"] == finished
            # Used: finished, and its answer is new in the final orchestrator call's prompt (schemas/episodes.py).
            context = segments[0].prompt + segments[0].completion
            used = sum(
                s.finish_reason == "stop"
                and s.completion.strip() != ""
                and s.completion.strip() in segments[4].prompt
                and s.completion.strip() not in context
                for s in (segments[2], segments[3])
            )
            assert metrics["subagents_used"] == used
            assert (metrics["cycle"], metrics["lambda_parallel"], metrics["lambda_finish"]) == (0, 0.2, 0.2)
            components = episode.reward_components or {}
            assert components["task_outcome"] == float(n % 2)
            assert components["parl_parallel"] == pytest.approx(0.2 * 2 / 4)
            assert components["parl_finish"] == pytest.approx(0.2 * used / 2)
            assert episode.reward == pytest.approx(sum(components.values()))

        # ---- rows: the orchestrator's two calls per episode, with the episode's advantage ---------------
        selected, rows = select_rows(loop)
        assert len(selected) == len(questions)
        assert (
            {tuple(r.input_ids) for r in rows}
            == trainable_calls(selected)
            == trainable_calls(selected, "orchestrator")
        )
        assert len(rows) >= len(questions) + 1
        subagent_calls = {
            tuple(s.prompt_token_ids + s.completion_token_ids)
            for e in selected
            for s in e.segments
            if s.role == "subagent"
        }
        assert subagent_calls and not subagent_calls & {tuple(r.input_ids) for r in rows}  # never a row
        # What the sub-agents said reaches the orchestrator only as prompt: observed, never learnt.
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        runs = [tokenizer(o, add_special_tokens=False)["input_ids"][1:-1] for o in observations]
        assert_gradients_only_on_completions(
            tiny_model_dir, loop.settings, rows, [r for r in runs if len(r) >= 2]
        )

        # ---- a real cycle; its MLflow run has the λ schedule and the critical steps --------------------
        result = train_cycle(loop)
        assert result.trainable_rows == len(rows)
        run = loop.registry.run(result.mlflow_run_id)
        params, logged = run.data.params, run.data.metrics
        assert (
            params["reward.spec"],
            params["reward.parl.lambda_parallel"],
            params["reward.parl.anneal_cycles"],
        ) == ("parl-v1@2", "0.2", "10")
        assert (logged["parl_cycle"], logged["parl_lambda_parallel"], logged["parl_lambda_finish"]) == (
            0,
            0.2,
            0.2,
        )
        assert logged["parl_critical_steps_mean"] == 4.0 and logged["parl_subagents_mean"] == 2.0
        assert logged["parl_episode_lambda_parallel_mean"] == pytest.approx(0.2)

        # One cycle has trained: an episode settled now is labelled one step down the schedule.
        assert loop.store.trained_cycles("parl-v1@2") == 1 and loop.store.trained_cycles("tab-v1@2") == 0
        _, plan = loop.call("Q: Name a color.\nA:", "parl-late", 0, role="orchestrator", seed=9)
        last, _ = loop.call("Q: Name a fruit.\nA:", "parl-late", 1, role="subagent", agent="a", seed=9)
        loop.feedback({"request_id": last, "episode_id": "parl-late", "kind": "episode_end"})
        loop.label(settled=len(questions) + 1)
        late = loop.episodes()["parl-late"].metrics or {}
        assert (late["cycle"], late["lambda_parallel"]) == (1, pytest.approx(0.18))


# ---- Cursor self-summarization ------------------------------------------------------------------------


def test_a_summary_chain_shares_the_final_reward_and_its_summary_is_trained(
    make_loop: Callable[..., Any], tiny_model_dir: Path
) -> None:
    questions = ["What is 2 plus 3?", "Name a color.", "What is 4 plus 1?", "What comes after 6?"]
    with make_loop("tab-v1") as loop:
        for n, question in enumerate(questions):
            episode, q = f"sum-{n}", f"Q: {question}\nA:"
            _, work = loop.call(q, episode, 0, seed=n)
            _, summary = loop.call(f"{q}{work}\nSummary:", episode, 1, role="summary", seed=n)
            last, _ = loop.call(f"Summary:{summary}\n{q}", episode, 2, seed=n)
            # The user's verdict is about the last call; the client then ends the episode.
            loop.feedback(
                {"request_id": last, "kind": "accepted" if n % 2 else "rejected"},
                {"request_id": last, "episode_id": episode, "kind": "episode_end"},
            )
        loop.label(settled=len(questions))

        episodes = loop.episodes()
        for n in range(len(questions)):
            episode = episodes[f"sum-{n}"]
            assert episode.settle_reason == "terminal_feedback"
            assert episode.reward == (0.75 if n % 2 else -0.25)
            metrics = episode.metrics or {}
            assert (metrics["segments"], metrics["summaries"], metrics["context_edits"]) == (3, 1, 1)
            segments = loop.segments(f"sum-{n}")
            assert metrics["max_context_tokens"] == max(
                len(s.prompt_token_ids) + len(s.completion_token_ids) for s in segments
            )

        selected, rows = select_rows(loop)
        # Work, summary and work: every generated token trains.
        assert {tuple(r.input_ids) for r in rows} == trainable_calls(selected) and len(rows) >= 2 * len(
            questions
        )
        by_episode = {e.episode_id: e for e in selected}
        for episode in by_episode.values():
            calls = [tuple(s.prompt_token_ids + s.completion_token_ids) for s in episode.segments]
            advantages = {r.advantage for r in rows if tuple(r.input_ids) in calls}
            assert len(advantages) == 1, "the chain's calls share one advantage"
        summaries = {
            tuple(s.prompt_token_ids + s.completion_token_ids)
            for e in selected
            for s in e.segments
            if s.role == "summary"
        }
        assert summaries & {tuple(r.input_ids) for r in rows} == trainable_calls(selected, "summary")
        assert trainable_calls(selected, "summary")
        assert_gradients_only_on_completions(tiny_model_dir, loop.settings, rows)

        result = train_cycle(loop)
        assert result.trainable_rows == len(rows)
        logged = loop.registry.run(result.mlflow_run_id).data.metrics
        assert (logged["episode_summaries_mean"], logged["episode_segments_mean"]) == (1.0, 3.0)
        assert logged["episode_context_tokens_max"] == max(m.metrics["max_context_tokens"] for m in selected)


# ---- Chroma self-editing ------------------------------------------------------------------------------


def test_a_self_editing_agent_trains_on_what_each_call_saw_with_the_full_trajectory_reward(
    make_loop: Callable[..., Any], tiny_model_dir: Path
) -> None:
    chunks = ["[1] two plus three is five", "[2] red is a color", "[3] seven follows six"]
    questions = ["What is 2 plus 3?", "Name a color.", "What is 4 plus 1?", "What comes after 6?"]
    with make_loop("tab-v1") as loop:
        assert loop.settings.trainer.loss.type == "cispo"  # the default loss
        for n, question in enumerate(questions):
            episode, q = f"edit-{n}", f"Q: {question}\nA:"
            context = "\n".join(chunks) + "\n"
            _, first = loop.call(context + q, episode, 0, seed=n)
            _, prune = loop.call(
                f"{context}{q}{first}\nPrune:", episode, 1, seed=n
            )  # the prune action's tokens
            pruned = "\n".join(c for k, c in enumerate(chunks) if k != n % len(chunks)) + "\n"
            last, _ = loop.call(pruned + q, episode, 2, seed=n)  # sees the pruned context
            # The outcome is the full trajectory's (what the agent found before pruning), for the episode.
            loop.feedback(
                {"request_id": last, "episode_id": episode, "kind": "task_outcome", "value": float(n % 2)}
            )
        loop.label(settled=len(questions))

        episodes = loop.episodes()
        for n in range(len(questions)):
            episode = episodes[f"edit-{n}"]
            assert (episode.settle_reason, episode.reward) == ("terminal_feedback", float(n % 2))
            metrics = episode.metrics or {}
            assert metrics["context_edits"] == 1 and metrics["rewritten_chars"] > 0

        selected, rows = select_rows(loop)
        assert {tuple(r.input_ids) for r in rows} == trainable_calls(selected)
        for episode in selected:
            first, prune, last = episode.segments
            # The last call saw the pruned context, and its row is exactly that, not the full history.
            full = first.prompt_token_ids
            assert last.prompt_token_ids != full[: len(last.prompt_token_ids)]
            assert len(last.prompt_token_ids) < len(full)
            if last.completion_token_ids:
                row = next(
                    r for r in rows if r.input_ids == last.prompt_token_ids + last.completion_token_ids
                )
                assert row.prompt_len == len(last.prompt_token_ids)
            if prune.completion_token_ids:  # the prune action is trained like any other tokens
                assert any(r.input_ids == prune.prompt_token_ids + prune.completion_token_ids for r in rows)
        assert_gradients_only_on_completions(tiny_model_dir, loop.settings, rows)

        result = train_cycle(loop)
        run = loop.registry.run(result.mlflow_run_id)
        assert run.data.params["trainer.loss.type"] == "cispo"
        assert run.data.metrics["episode_context_edits_mean"] == 1.0


# ---- judged rewards -----------------------------------------------------------------------------------


def test_episodes_are_labelled_without_the_judge_term_and_flagged_while_the_judge_is_down(
    make_loop: Callable[..., Any],
) -> None:
    (dead,) = free_ports(1)  # nothing listens there
    judge = JudgeSettings(url=f"http://127.0.0.1:{dead}/v1", model="judge", retries=1, timeout_s=1.0)

    def unavailable() -> float:
        return REGISTRY.get_sample_value("rtrl_labeler_judged_total", {"outcome": "unavailable"}) or 0.0

    before = unavailable()
    with make_loop("judged-v1", judge=judge) as loop:
        for n in range(4):
            episode = f"judged-{n}"
            _, work = loop.call("Q: What is 2 plus 3?\nA:", episode, 0, seed=n)
            last, _ = loop.call(f"Q: What is 2 plus 3?\nA:{work}\nQ: And 1 plus 1?\nA:", episode, 1, seed=n)
            loop.feedback(
                {"request_id": last, "episode_id": episode, "kind": "task_outcome", "value": float(n % 2)}
            )
        loop.label(settled=4)

        assert loop.store.stats()["episodes_judging"] == 0
        for name, episode in loop.episodes().items():
            value = float(int(name.rsplit("-", 1)[1]) % 2)
            components = episode.reward_components or {}
            assert components == {"task_outcome": value, "judge_unavailable": 0.0}, components
            assert episode.reward == value and (episode.metrics or {})["judge"] is None
        assert unavailable() - before == 4
        # Labelled, so trained: a cycle counts them as judged without a grade.
        result = train_cycle(loop)
        logged = loop.registry.run(result.mlflow_run_id).data.metrics
        assert (logged["judge_episodes"], logged["judge_unavailable"]) == (4.0, 4.0)


def test_the_judge_term_grades_whole_episodes_on_the_local_vllm_server(
    make_loop: Callable[..., Any], services: Settings
) -> None:
    def compared() -> float:
        return REGISTRY.get_sample_value("rtrl_labeler_judge_compared_total") or 0.0

    judge = JudgeSettings(url=f"{services.vllm.servers[0]}/v1", model=services.vllm.served_model_name)
    before = compared()
    with make_loop("judged-v1", judge=judge) as loop:
        for n in range(4):
            last, _ = loop.call("Q: Name a color.\nA:", f"graded-{n}", 0, seed=n)
            loop.feedback(
                {"request_id": last, "kind": "rejected" if n % 2 else "accepted"},
                {"request_id": last, "episode_id": f"graded-{n}", "kind": "episode_end"},
            )
        loop.label(settled=4)
        for episode in loop.episodes().values():
            components, grade = episode.reward_components or {}, (episode.metrics or {})["judge"]
            assert 0.0 <= grade <= 1.0
            assert components["judge"] == pytest.approx(0.25 * (2 * grade - 1))
            assert episode.reward == pytest.approx(sum(components.values()))
        assert compared() - before == 4  # every episode had an outcome to compare


# ---- the simulated agents of `rtrl demo --scenario` ---------------------------------------------------


@pytest.mark.parametrize("scenario", ["parl", "summarize", "self-edit"])
def test_the_demo_agents_episodes_end_on_their_signal_with_their_structure(
    make_loop: Callable[..., Any], services: Settings, scenario: str
) -> None:
    from simulation.agents import SCENARIO_SPECS, run_agents

    judge = JudgeSettings(url=f"{services.vllm.servers[0]}/v1", model=services.vllm.served_model_name)
    with make_loop(SCENARIO_SPECS[scenario], judge=judge if scenario == "self-edit" else None) as loop:
        report = run_agents(loop.settings, loop.url, scenario, 3, "exclaim", api_key=loop.key, seed=5)
        assert (report.ok, report.failed, report.feedback_failed) == (3, 0, 0), report.errors
        loop.label(settled=3)
        episodes = loop.episodes()
        assert len(episodes) == 3 and {e.settle_reason for e in episodes.values()} == {"terminal_feedback"}
        metrics = [e.metrics or {} for e in episodes.values()]
        assert sum(m["segments"] for m in metrics) == report.segments
        if scenario == "parl":
            assert sum(m["subagents"] for m in metrics) == report.subagents
            assert all(m["stages"] == 2 and m["critical_steps"] >= 3 for m in metrics)
        elif scenario == "summarize":
            assert sum(m["summaries"] for m in metrics) == report.summaries
        else:
            assert all(m["context_edits"] >= 1 for m in metrics)  # the last call saw the pruned context
            assert all(
                "judge" in (e.reward_components or {}) or "judge_unavailable" in (e.reward_components or {})
                for e in episodes.values()
            )
