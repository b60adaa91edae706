"""Join and settle on SQLite: out-of-order feedback, windows, late and orphaned feedback."""

from pathlib import Path

import pytest
from factories import FakeClock, Feeder, at, feedback, interaction
from sqlalchemy import delete, select, update

from schemas.events import InteractionEvent
from schemas.rewards import JUDGED_V1, PARL_V1, TAB_V1
from store import Store
from store.models import Cycle, Episode, Feedback

pytestmark = pytest.mark.unit


def episode(store: Store, episode_id: str) -> Episode:
    with store.transaction() as session:
        row = session.get(Episode, episode_id)
        assert row is not None
        return row


def test_feedback_before_its_interaction_joins_when_it_arrives(store: Store) -> None:
    feeder = Feeder(store)
    feeder.send(feedback("r-e1-0", "accepted"), now=at(0))
    feeder.send(feedback("r-e1-0", "edit_persisted"), now=at(1))
    assert store.stats()["feedback_unjoined"] == 2
    _, report = feeder.send(interaction("e1"), now=at(2))
    assert (report.joined, report.settled_terminal) == (2, 1)
    settled = episode(store, "e1")
    assert (settled.status, settled.settle_reason, settled.settled_at) == (
        "settled",
        "terminal_feedback",
        at(2),
    )
    assert settled.reward == 1.75  # accepted 0.75 + edit_persisted 1.0
    assert settled.reward_components == {"accepted": 0.75, "edit_persisted": 1.0}
    assert settled.reward_spec == "tab-v1@2"


def test_an_unfinished_answer_is_labelled_negative_never_dropped_or_neutral(store: Store) -> None:
    """Cursor's second reward hack: a response the loop cannot score (here cut off by max_tokens)
    must not pay better than answering and being rejected (-0.25), with or without feedback."""
    feeder = Feeder(store)
    feeder.send(
        interaction("cut", finish_reason="length"),
        interaction("done", finish_reason="stop"),
        interaction("cut-rejected", finish_reason="length"),
        feedback("r-cut-rejected-0", "rejected"),
        now=at(0),
    )
    assert feeder.settle_window(at(31)) == 2
    cut, done, rejected = (episode(store, e) for e in ("cut", "done", "cut-rejected"))
    assert cut.reward == -0.5 and cut.reward_components == {"no_feedback": 0.0, "unfinished": -0.5}
    assert done.reward == 0.0 and done.reward_components == {"no_feedback": 0.0}
    assert rejected.reward == -0.75 and rejected.reward_components == {"rejected": -0.25, "unfinished": -0.5}
    assert cut.reward < -0.25  # failing never beats a rejected answer


def test_an_untrainable_unfinished_segment_does_not_count(store: Store) -> None:
    # A stream the client hung up on is published truncated and untrainable: not the model's failure.
    feeder = Feeder(store)
    feeder.send(interaction("gone", finish_reason="length", trainable=False, truncated=True), now=at(0))
    assert feeder.settle_window(at(31)) == 1
    assert episode(store, "gone").reward_components == {"no_feedback": 0.0}


def test_non_terminal_feedback_settles_when_the_window_passes(store: Store) -> None:
    feeder = Feeder(store)
    feeder.send(interaction("e1"), now=at(0))
    feeder.send(feedback("r-e1-0", "accepted"), now=at(20))  # extends the window to t=50
    assert feeder.settle_window(at(49)) == 0
    assert episode(store, "e1").status == "open"
    assert feeder.settle_window(at(51)) == 1
    settled = episode(store, "e1")
    assert (settled.settle_reason, settled.reward) == ("window", 0.75)


def test_an_episode_without_feedback_is_labelled_zero(store: Store) -> None:
    feeder = Feeder(store)
    feeder.send(interaction("e1"), now=at(0))
    assert feeder.settle_window(at(31)) == 1
    settled = episode(store, "e1")
    assert (settled.reward, settled.reward_components, settled.settle_reason) == (
        0.0,
        {"no_feedback": 0.0},
        "window",
    )


def test_late_feedback_is_kept_and_flagged_not_rewarded(store: Store) -> None:
    feeder = Feeder(store)
    feeder.send(interaction("e1"), feedback("r-e1-0", "rejected"), now=at(0))
    _, report = feeder.send(feedback("r-e1-0", "thumbs_up"), now=at(5))
    assert (report.late_feedback, report.joined) == (1, 0)
    assert episode(store, "e1").reward == -0.25
    stats = store.stats()
    assert (stats["feedback"], stats["feedback_late"], stats["feedback_joined"]) == (2, 1, 2)


def test_orphaned_feedback_is_counted_not_lost(store: Store, clock: FakeClock) -> None:
    feeder = Feeder(store)
    feeder.send(feedback("never-served", "accepted"), now=clock())
    clock.advance(29)
    assert store.stats(orphan_after_s=30)["feedback_orphaned"] == 0
    clock.advance(2)
    feeder.settle_window(clock())
    stats = store.stats(orphan_after_s=30)
    assert (stats["feedback"], stats["feedback_orphaned"]) == (1, 1)


def test_feedback_of_another_tenant_does_not_join(store: Store) -> None:
    feeder = Feeder(store)
    feeder.send(
        interaction("e1", tenant="acme"), feedback("r-e1-0", "edit_persisted", tenant="mallory"), now=at(0)
    )
    assert episode(store, "e1").status == "open"
    assert store.stats()["feedback_unjoined"] == 1


def test_multi_segment_episode_feedback_by_episode_id(store: Store) -> None:
    feeder = Feeder(store)
    feeder.send(
        interaction("agent", 0, version="v4"),
        interaction("agent", 1, version="v3", created_at=at(-5)),  # served just before a hot-swap
        now=at(0),
    )
    feeder.send(feedback("r-elsewhere", "task_outcome", value=0.5, episode_id="agent"), now=at(3))
    settled = episode(store, "agent")
    assert (settled.status, settled.reward, settled.policy_version, settled.policy_number) == (
        "settled",
        0.5,
        "v3",
        3,
    )
    assert settled.first_event_at == at(-5)
    with store.transaction() as session:
        assert session.scalar(select(Feedback.joined_episode_id)) == "agent"


def test_feedback_and_its_interaction_in_one_batch(store: Store) -> None:
    feeder = Feeder(store)
    _, report = feeder.send(
        feedback("r-e1-0", "tool_call_error"), interaction("e1"), feedback("r-e1-0", "rejected")
    )
    assert report.settled_terminal == 1
    assert episode(store, "e1").reward == -1.25  # tool_call_error -1 + rejected -0.25


# ---- episodes of several segments: when they end -----------------------------------------------------


def test_terminal_feedback_about_one_request_joins_a_multi_segment_episode_without_ending_it(
    store: Store,
) -> None:
    feeder = Feeder(store)
    feeder.send(interaction("agent", 0), interaction("agent", 1), now=at(0))
    _, report = feeder.send(feedback("r-agent-0", "rejected"), now=at(1))  # about the first call only
    assert (report.joined, report.settled_terminal) == (1, 0)
    assert episode(store, "agent").status == "open"
    # The client says the episode is over, naming one of its requests (no episode id).
    _, report = feeder.send(feedback("r-agent-1", "episode_end"), now=at(2))
    assert (report.joined, report.settled_terminal) == (1, 1)
    assert [(s.reward, s.reason) for s in report.settled] == [(-0.25, "terminal_feedback")]
    settled = episode(store, "agent")
    assert (settled.status, settled.settle_reason, settled.settled_at) == (
        "settled",
        "terminal_feedback",
        at(2),
    )
    assert settled.reward_components == {"rejected": -0.25}  # episode_end carries no reward


def test_terminal_feedback_naming_the_episode_ends_it(store: Store) -> None:
    feeder = Feeder(store)
    feeder.send(interaction("agent", 0), interaction("agent", 1), now=at(0))
    _, report = feeder.send(feedback("r-agent-0", "accepted", episode_id="agent"), now=at(1))  # not terminal
    assert (report.joined, report.settled_terminal) == (1, 0)
    _, report = feeder.send(feedback("r-agent-0", "task_outcome", value=0.5, episode_id="agent"), now=at(2))
    assert report.settled_terminal == 1
    settled = episode(store, "agent")
    assert (settled.status, settled.reward, settled.reward_components) == (
        "settled",
        1.25,
        {"accepted": 0.75, "task_outcome": 0.5},
    )


def test_episode_end_naming_the_episode_ends_it_without_any_of_its_requests(store: Store) -> None:
    feeder = Feeder(store)
    feeder.send(interaction("agent", 0), interaction("agent", 1), now=at(0))
    _, report = feeder.send(feedback("r-app", "episode_end", episode_id="agent"), now=at(1))
    assert report.settled_terminal == 1
    assert episode(store, "agent").reward_components == {"no_feedback": 0.0}


def test_a_single_call_episode_still_ends_on_terminal_feedback_about_its_call(store: Store) -> None:
    feeder = Feeder(store)
    feeder.send(interaction("one"), now=at(0))
    _, report = feeder.send(feedback("r-one-0", "rejected"), now=at(1))
    assert report.settled_terminal == 1
    assert (episode(store, "one").status, episode(store, "one").reward) == ("settled", -0.25)
    # An episode whose only segment so far is not segment 0 is a multi-segment episode in progress.
    feeder.send(interaction("later", 1), now=at(0))
    _, report = feeder.send(feedback("r-later-1", "rejected"), now=at(1))
    assert (report.joined, report.settled_terminal) == (1, 0)
    assert episode(store, "later").status == "open"


def test_settled_episodes_carry_their_measurements(store: Store) -> None:
    feeder = Feeder(store)
    feeder.send(
        interaction("one"),
        interaction("chain", 0),  # "def f(" + "x):": 5 tokens
        interaction(
            "chain",
            1,
            role="summary",
            prompt="def f(x): summarize",
            completion=" f takes x",
            prompt_token_ids=[1, 2, 3, 4, 5, 6],
            completion_token_ids=[7, 8],
            completion_logprobs=[-0.1, -0.2],
        ),  # continues it: 8 tokens, 29 characters
        interaction(
            "chain", 2, prompt="f takes x. Go on", prompt_token_ids=[7, 8, 9], finish_reason="length"
        ),  # the summary replaces all 29 characters
        now=at(0),
    )
    assert feeder.settle_window(at(31)) == 2
    assert episode(store, "one").metrics == {
        "segments": 1,
        "trainable_segments": 1,
        "summaries": 0,
        "max_context_tokens": 5,
        "completion_tokens": 2,
        "context_edits": 0,
        "rewritten_chars": 0,
        "unfinished": 0,
    }
    chain = episode(store, "chain")
    assert chain.metrics == {
        "segments": 3,
        "trainable_segments": 3,
        "summaries": 1,
        "max_context_tokens": 8,
        "completion_tokens": 6,
        "context_edits": 1,
        "rewritten_chars": 29,
        "unfinished": 1,
    }
    assert chain.reward_components == {"no_feedback": 0.0, "unfinished": -0.5}
    # The trainer reads them with the episode.
    selected = {e.episode_id: e for e in store.select_episodes(1, 0, 10)}
    assert selected["chain"].metrics == chain.metrics
    assert selected["chain"].components == {"no_feedback": 0.0, "unfinished": -0.5}


# ---- PARL shaping under parl-v1 ---------------------------------------------------------------------


def parl_episode(episode_id: str) -> list[InteractionEvent]:
    """Orchestrator, sub-agents A (stopped) and B (cut off) in its stage, orchestrator that sees both
    answers: 2 stages, 3 critical steps, A's result used."""
    return [
        interaction(episode_id, 0, role="orchestrator", prompt="Q:", completion=" plan"),
        interaction(
            episode_id,
            1,
            role="subagent",
            agent="A",
            trainable=False,
            finish_reason="stop",
            prompt="a:",
            completion=" forty two",
        ),
        interaction(
            episode_id,
            2,
            role="subagent",
            agent="B",
            trainable=False,
            finish_reason="length",
            prompt="b:",
            completion=" seven",
        ),
        interaction(
            episode_id,
            3,
            role="orchestrator",
            prompt="Q: plan\nNotes: forty two seven\nQ:",
            finish_reason="stop",
        ),
    ]


def train_on(store: Store, episode_ids: list[str], *statuses: str) -> int:
    """A cycle that claims `episode_ids` and moves through `statuses`; its id."""
    cycle = store.acquire_cycle("w", ttl_s=60, champion=1)
    assert cycle is not None
    store.mark_used(cycle, episode_ids)
    for status in statuses:
        store.finish_cycle(cycle, status, challenger=2)
    return cycle


def test_parl_episodes_get_the_shaping_of_the_cycles_trained_so_far(store: Store) -> None:
    feeder = Feeder(store, spec=PARL_V1)
    feeder.send(*parl_episode("p0"), interaction("plain"), now=at(0))
    feeder.send(
        feedback("r-p0-3", "task_outcome", episode_id="p0"), feedback("r-plain-0", "rejected"), now=at(1)
    )
    p0 = episode(store, "p0")
    # cycle 0: λ = 0.2; r_parallel = 2/4, r_finish = 1/2 (A used; B's last call hit max_tokens).
    assert p0.reward_components == {"task_outcome": 1.0, "parl_parallel": 0.1, "parl_finish": 0.1}
    assert p0.reward == pytest.approx(1.2) and p0.reward_spec == PARL_V1.spec_id
    assert {
        k: p0.metrics[k]
        for k in (
            "stages",
            "critical_steps",
            "subagents",
            "subagents_finished",
            "subagents_used",
            "subagent_calls_off_pin",
            "cycle",
            "lambda_parallel",
            "lambda_finish",
            "unfinished",
            "context_edits",
        )
    } == {
        "context_edits": 0,  # the orchestrator continues its context; each sub-agent has its own
        "stages": 2,
        "critical_steps": 3,
        "subagents": 2,
        "subagents_finished": 1,
        "subagents_used": 1,
        "subagent_calls_off_pin": 0,
        "cycle": 0,
        "lambda_parallel": 0.2,
        "lambda_finish": 0.2,
        "unfinished": 0,  # B is not trainable: not unfinished
    }
    plain = episode(store, "plain")  # not a PARL episode: no shaping, no schedule
    assert plain.reward_components == {"rejected": -0.25}
    assert not {"cycle", "lambda_parallel", "stages"} & set(plain.metrics)

    # Cycles that trained a version on this spec's episodes count (rejected, promoted, registered);
    # a failed one does not.
    for n in range(1, 5):
        feeder.send(*parl_episode(f"q{n}"), feedback(f"r-q{n}-3", "episode_end"), now=at(1))
    for n, final in enumerate(
        (("rejected",), ("registered", "promoted"), ("failed",), ("registered",)), start=1
    ):
        train_on(store, [f"q{n}"], *final)
    assert store.trained_cycles(PARL_V1.spec_id) == 3

    feeder.send(*parl_episode("p3"), now=at(2))
    feeder.send(feedback("r-p3-3", "episode_end"), now=at(3))
    p3 = episode(store, "p3")
    # cycle 3 of 10: λ = 0.2 · 0.7 = 0.14; 0.14 · 1/2 each.
    assert (p3.metrics["cycle"], p3.metrics["lambda_parallel"], p3.metrics["lambda_finish"]) == (
        3,
        pytest.approx(0.14),
        pytest.approx(0.14),
    )
    assert p3.reward_components == {
        "no_feedback": 0.0,
        "parl_parallel": pytest.approx(0.07),
        "parl_finish": pytest.approx(0.07),
    }
    assert p3.reward == pytest.approx(0.14)


def test_finishing_pays_only_for_subagents_whose_result_the_orchestrator_used(store: Store) -> None:
    """Four trivial sub-agents that stop at once and whose answers never reach the orchestrator earn
    r_parallel (they were spawned) but no r_finish: finishing unused work is spurious parallelism."""
    feeder = Feeder(store, spec=PARL_V1)
    feeder.send(
        interaction("t", 0, role="orchestrator", prompt="Q:", completion=" plan"),
        *(
            interaction(
                "t",
                i,
                role="subagent",
                agent=f"S{i}",
                trainable=False,
                finish_reason="stop",
                prompt=f"s{i}:",
                completion=" ok",
            )
            for i in range(1, 5)
        ),
        interaction("t", 5, role="orchestrator", prompt="Q: plan\nQ:", completion=" done"),
        feedback("r-t-5", "task_outcome", value=0.0, episode_id="t"),
        now=at(0),
    )
    trivial = episode(store, "t")
    # λ = 0.2: r_parallel = 4/4, r_finish = 0/4.
    assert trivial.reward_components == {"task_outcome": 0.0, "parl_parallel": 0.2, "parl_finish": 0.0}
    assert (
        trivial.metrics["subagents"],
        trivial.metrics["subagents_finished"],
        trivial.metrics["subagents_used"],
    ) == (4, 4, 0)


def test_the_parl_schedule_counts_the_cycles_trained_under_its_own_spec(store: Store) -> None:
    """Ten cycles trained under tab-v1 do not move parl-v1's schedule: a switch to parl-v1 starts at
    λ(0). What a cycle trained under is recorded on the cycle, so pruning its episodes keeps the count."""
    tab = Feeder(store)
    for n in range(10):
        tab.send(interaction(f"t{n}"), feedback(f"r-t{n}-0", "rejected"), now=at(0))
        train_on(store, [f"t{n}"], "rejected")
    parl = Feeder(store, spec=PARL_V1)
    parl.send(*parl_episode("p0"), feedback("r-p0-3", "episode_end"), now=at(1))
    p0 = episode(store, "p0")
    assert (p0.metrics["cycle"], p0.metrics["lambda_parallel"], p0.metrics["lambda_finish"]) == (0, 0.2, 0.2)
    assert (store.trained_cycles("tab-v1@2"), store.trained_cycles(PARL_V1.spec_id)) == (10, 0)
    assert store.get_cycle(1).reward_spec == "tab-v1@2"  # type: ignore[union-attr]

    for n in range(1, 3):
        parl.send(*parl_episode(f"q{n}"), feedback(f"r-q{n}-3", "episode_end"), now=at(1))
        train_on(store, [f"q{n}"], "rejected")
    assert store.trained_cycles(PARL_V1.spec_id) == 2
    with store.transaction() as session:  # retention prunes the episodes of finished cycles
        session.execute(delete(Episode).where(Episode.episode_id.in_(["q1", "t0", "t1"])))
    assert (store.trained_cycles(PARL_V1.spec_id), store.trained_cycles("tab-v1@2")) == (2, 10)

    parl.send(*parl_episode("p2"), feedback("r-p2-3", "episode_end"), now=at(2))
    assert episode(store, "p2").metrics["cycle"] == 2


def test_the_migration_records_the_spec_of_the_cycles_trained_before_it(tmp_path: Path) -> None:
    """Migration 0010 gives each existing cycle the spec of the episodes it claimed, where they share one."""
    store = Store(f"sqlite:///{tmp_path}/old.db")
    store.migrate("0009")
    other = TAB_V1.model_copy(update={"name": "other", "version": 1})  # no PARL: settling reads no cycles
    for prefix, feeder in (("t", Feeder(store)), ("o", Feeder(store, spec=other))):
        for n in range(2):
            feeder.send(interaction(f"{prefix}{n}"), feedback(f"r-{prefix}{n}-0", "rejected"), now=at(0))
    # Cycles 1 (rejected: t0), 2 (promoted: o0), 3 (rejected: t1 and o1, mixed), 4 (failed: released its episodes).
    claims = {
        1: ("rejected", ["t0"]),
        2: ("promoted", ["o0"]),
        3: ("rejected", ["t1", "o1"]),
        4: ("failed", []),
    }
    with store.transaction() as session:
        for cycle_id, (status, episodes) in claims.items():
            session.execute(
                Cycle.__table__.insert().values(  # type: ignore[attr-defined]
                    id=cycle_id,
                    status=status,
                    owner="w",
                    lease_expires_at=at(0),
                    champion_version="v1",
                    started_at=at(0),
                )
            )
            session.execute(
                update(Episode).where(Episode.episode_id.in_(episodes)).values(used_in_cycle=cycle_id)
            )
    store.migrate()
    assert {n: store.get_cycle(n).reward_spec for n in claims} == {  # type: ignore[union-attr]
        1: "tab-v1@2",
        2: "other@1",
        3: None,
        4: None,
    }
    assert (store.trained_cycles("tab-v1@2"), store.trained_cycles("other@1")) == (1, 1)
    store.close()


# ---- judged episodes under judged-v1 -----------------------------------------------------------------


def test_a_judged_episode_closes_waits_for_its_judge_and_settles_once(store: Store) -> None:
    feeder = Feeder(store, spec=JUDGED_V1)
    feeder.send(
        interaction("j", 0, prompt="Fix the bug", completion="step one "),
        interaction("j", 1, role="summary", prompt="Fix the bug step one Summarize", completion="summary"),
        interaction("j", 2, prompt="summary Continue", prompt_token_ids=[9], completion="done"),  # pruned
        interaction("one", completion="  x):\n"),
        now=at(0),
    )
    feeder.send(feedback("r-j-0", "rejected"), now=at(1))  # joins; the episode goes on
    _, report = feeder.send(feedback("r-j-2", "episode_end"), now=at(2))
    assert (report.settled_terminal, report.settled) == (1, [])  # closed, not yet settled
    closed = episode(store, "j")
    assert (closed.status, closed.reward, closed.settle_reason) == ("judging", None, "terminal_feedback")
    assert closed.metrics["segments"] == 3 and closed.metrics["summaries"] == 1
    stats = store.stats()
    assert (stats["episodes_judging"], stats["episodes_settled"], stats["episodes_open"]) == (1, 0, 1)
    assert store.count_trainable(1, 0) == 0

    # Closed means closed: what arrives now is late.
    _, report = feeder.send(
        feedback("r-j-1", "thumbs_up"), interaction("j", 3, completion="after"), now=at(3)
    )
    assert (report.late_feedback, report.late_segments, report.joined) == (1, 1, 0)
    assert feeder.settle_window(at(40)) == 0  # "one" closes for its judge too
    assert store.stats()["episodes_judging"] == 2

    with store.labelling(at(41)) as tx:
        waiting = tx.awaiting_judge(10)
        assert [(w.episode_id, w.prompt, w.trajectory) for w in waiting] == [
            ("j", "Fix the bug", "[policy] step one\n[summary] summary\n[policy] done"),  # no late segment
            ("one", "def f(", "x):"),
        ]
        assert [w.episode_id for w in tx.awaiting_judge(1)] == ["j"]  # closed first, judged first
        judged = tx.settle_judged(JUDGED_V1, {"j": 0.75})
    assert [(s.reward, s.reason, s.judge, s.judge_disagrees) for s in judged] == [
        (-0.125, "terminal_feedback", "scored", True),  # the judge liked what the user rejected
    ]
    settled = episode(store, "j")
    assert settled.status == "settled" and settled.reward_spec == "judged-v1@1"
    assert settled.reward_components == {"rejected": -0.25, "judge": 0.125}  # 0.25 · (2 · 0.75 − 1)
    metrics = settled.metrics
    assert (metrics["judge"], metrics["judge_disagrees"], metrics["segments"]) == (0.75, True, 3)

    with store.labelling(at(42)) as tx:
        unavailable = tx.settle_judged(JUDGED_V1, {"one": None})
    assert [(s.reward, s.reason, s.judge, s.judge_disagrees) for s in unavailable] == [
        (0.0, "window", "unavailable", None),
    ]
    one = episode(store, "one")
    assert one.reward_components == {"no_feedback": 0.0, "judge_unavailable": 0.0}
    assert (one.metrics["judge"], one.metrics["judge_disagrees"]) == (None, None)

    with store.labelling(at(43)) as tx:
        assert tx.settle_judged(JUDGED_V1, {"j": 0.0, "one": 1.0, "unknown": 0.5}) == []  # settled once
        assert tx.awaiting_judge(10) == []
    assert episode(store, "j").reward == -0.125
    assert store.stats()["episodes_judging"] == 0
    assert store.count_trainable(1, 0, spec_id="judged-v1@1") == 2


def test_waiting_feedback_joins_its_tenants_episode_when_another_tenant_reuses_the_request(
    store: Store,
) -> None:
    """Feedback left waiting (its episode was gone when it came, as retention leaves it) is found
    again through a batch whose interaction of another tenant carries the same request id: it joins
    its own tenant's episode (looked up in the store), never the batch's."""
    feeder = Feeder(store)
    feeder.send(interaction("eb", request="r-shared", tenant="beta"), now=at(0))
    with store.transaction() as session:
        session.delete(session.get(Episode, "eb"))  # as retention deletes a closed episode
    feeder.send(feedback("r-shared", "thumbs_up", tenant="beta"), now=at(1))
    assert store.stats()["feedback_unjoined"] == 1
    feeder.send(interaction("eb", 1, tenant="beta"), now=at(2))  # a later segment opens eb again
    _, report = feeder.send(interaction("ea", request="r-shared", tenant="alpha"), now=at(3))
    assert report.joined == 1
    with store.transaction() as session:
        joined = session.scalars(select(Feedback.joined_episode_id).where(Feedback.tenant == "beta")).all()
    assert joined == ["eb"]
