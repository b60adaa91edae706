"""Episode measurements (schemas/episodes.py): hand-worked summaries, context edits, PARL stages and
critical steps, and a training batch's means."""

import pytest

from schemas.episodes import SegmentShape, batch_metrics, episode_metrics, is_parl, parl_metrics

pytestmark = pytest.mark.unit


def seg(
    prompt: str,
    completion: str,
    role: str = "policy",
    agent: str | None = None,
    finish_reason: str | None = "stop",
) -> SegmentShape:
    """A segment whose token counts are its word counts (one token a word); sub-agents are never trainable."""
    return SegmentShape(
        role=role,
        agent=agent,
        prompt_len=len(prompt.split()),
        completion_len=len(completion.split()),
        finish_reason=finish_reason,
        trainable=role != "subagent",
        prompt=prompt,
        completion=completion,
    )


def test_one_segment_is_measured_from_its_lengths_alone() -> None:
    only = SegmentShape(
        role="policy", agent=None, prompt_len=3, completion_len=2, finish_reason="stop", trainable=True
    )
    assert episode_metrics([only]) == {
        "segments": 1,
        "trainable_segments": 1,
        "summaries": 0,
        "max_context_tokens": 5,
        "completion_tokens": 2,
        "context_edits": 0,
        "rewritten_chars": 0,
    }
    assert not is_parl([only])
    assert episode_metrics([]) == {
        "segments": 0,
        "trainable_segments": 0,
        "summaries": 0,
        "max_context_tokens": 0,
        "completion_tokens": 0,
        "context_edits": 0,
        "rewritten_chars": 0,
    }


def test_a_summarize_chain_counts_the_summary_and_the_replaced_context() -> None:
    segments = [
        seg("task ", "work "),  # context "task work " (10 characters)
        seg("task work summarize ", "sum ", role="summary"),  # continues it; context of 24 characters
        seg("task sum go ", "done "),  # the summary replaces the work: only "task " (5) carried over
    ]
    assert episode_metrics(segments) == {
        "segments": 3,
        "trainable_segments": 3,
        "summaries": 1,
        "max_context_tokens": 4,  # the summary call (3 + 1) and the last one (3 + 1)
        "completion_tokens": 3,
        "context_edits": 1,
        "rewritten_chars": 19,  # 24 - 5
    }


def test_a_self_edit_that_drops_the_middle_of_the_context_is_an_edit() -> None:
    segments = [
        seg("a b c ", "d "),  # context "a b c d "
        seg("a b c d e ", "f g "),  # continues it: no edit; context "a b c d e f g " (14 characters)
        seg("a b e f g h ", "i "),  # drops "c d ": "a b " (4) kept as prefix, 10 rewritten
    ]
    metrics = episode_metrics(segments)
    assert (metrics["context_edits"], metrics["rewritten_chars"]) == (1, 10)
    assert (metrics["max_context_tokens"], metrics["completion_tokens"], metrics["summaries"]) == (7, 4, 0)


def test_parl_stages_critical_steps_and_finished_subagents() -> None:
    segments = [
        seg("o ", "1 ", role="orchestrator"),  # stage 1
        seg("a ", "2 ", role="subagent", agent="A"),  # A stopped here ...
        seg(
            "a 2 x ", "3 ", role="subagent", agent="A", finish_reason="length"
        ),  # ... but its last call did not
        seg("b ", "4 ", role="subagent", agent="B"),
        seg("o 1 4 ", "5 ", role="orchestrator"),  # stage 2: B's answer reaches the orchestrator
        seg("o 1 4 5 z ", "6 ", role="orchestrator"),  # stage 3
    ]
    assert is_parl(segments)
    assert episode_metrics(segments) == {
        "segments": 6,
        "trainable_segments": 3,
        "summaries": 0,
        "max_context_tokens": 6,
        "completion_tokens": 6,
        "context_edits": 0,
        "rewritten_chars": 0,  # each agent continues its own context
        "stages": 3,
        "critical_steps": 5,  # (1 orchestrator + A's 2 calls) + 1 + 1
        "subagents": 2,
        "subagents_finished": 1,  # B; A's last call hit max_tokens
        "subagents_used": 1,  # B: its "4" is in stage 2's prompt
        "subagent_calls_off_pin": 0,  # no versions known
    }


def test_a_subagent_counts_as_used_only_when_its_answer_reaches_the_orchestrator_as_news() -> None:
    """r_finish pays for sub-agents whose result the orchestrator used (docs/methods.md, PARL): a
    sub-agent that stopped by itself and whose last answer is in a later orchestrator call's prompt
    and was not in the orchestrator's context before the sub-agent ran."""
    segments = [
        seg(
            "Q ", "plan ", role="orchestrator"
        ),  # the orchestrator's context before its sub-agents: "Q plan "
        seg("a ", "forty two ", role="subagent", agent="A"),  # used: its answer is new in the next prompt
        seg("b ", " ", role="subagent", agent="B"),  # stopped, answered nothing: nothing to use
        seg("c ", "plan ", role="subagent", agent="C"),  # stopped, but repeats what the orchestrator had
        seg("d ", "seven ", role="subagent", agent="D"),  # stopped, its answer never passed back
        seg("e ", "nine ", role="subagent", agent="E", finish_reason="length"),  # passed back, but cut off
        seg("Q plan Notes: forty two plan nine Q ", "done ", role="orchestrator"),
    ]
    metrics = parl_metrics(segments)
    assert (metrics["subagents"], metrics["subagents_finished"], metrics["subagents_used"]) == (5, 4, 1)
    # Four sub-agents that stopped at once and whose answers the orchestrator never saw: none used.
    trivial = [
        seg("Q ", "plan ", role="orchestrator"),
        *(seg(f"s{i} ", "ok ", role="subagent", agent=f"S{i}") for i in range(4)),
        seg("Q plan Q ", "done ", role="orchestrator"),
    ]
    assert (parl_metrics(trivial)["subagents_finished"], parl_metrics(trivial)["subagents_used"]) == (4, 0)
    # An answer seen by a later stage's orchestrator call counts; one with no orchestrator call after it does not.
    later = [
        seg("Q ", "plan ", role="orchestrator"),
        seg("a ", "forty ", role="subagent", agent="A"),
        seg("Q plan ", "more ", role="orchestrator"),
        seg("b ", "two ", role="subagent", agent="B"),
        seg("Q plan more then forty ", "done ", role="orchestrator"),
        seg("c ", "late ", role="subagent", agent="C"),
    ]
    assert parl_metrics(later)["subagents_used"] == 1  # A; B's "two" never came back, C ran last


def test_subagent_calls_served_off_the_orchestrators_version_are_counted() -> None:
    """Sub-agents are pinned to the version the episode's orchestrator started under; the calls the
    fleet served from another version (a swap mid-episode) are counted, never hidden."""

    def at(segment: SegmentShape, version: str | None) -> SegmentShape:
        return SegmentShape(**{**segment.__dict__, "version": version})

    segments = [
        at(seg("Q ", "plan ", role="orchestrator"), "v3"),
        at(seg("a ", "1 ", role="subagent", agent="A"), "v3"),
        at(seg("a 1 ", "2 ", role="subagent", agent="A"), "v4"),  # the server was swapped mid-episode
        at(seg("b ", "3 ", role="subagent", agent="B"), "v4"),
        at(seg("Q plan 2 3 ", "done ", role="orchestrator"), "v4"),
    ]
    assert parl_metrics(segments)["subagent_calls_off_pin"] == 2
    assert parl_metrics([at(s, "v3") for s in segments])["subagent_calls_off_pin"] == 0
    assert parl_metrics([at(s, None) for s in segments])["subagent_calls_off_pin"] == 0  # versions unknown


def test_subagent_calls_without_an_id_are_each_their_own_subagent() -> None:
    sub = seg("s ", "t ", role="subagent")
    anonymous = [seg("o ", "1 ", role="orchestrator"), sub, sub]
    named = [
        seg("o ", "1 ", role="orchestrator"),
        seg("s ", "t ", role="subagent", agent="A"),
        seg("s t ", "u ", role="subagent", agent="A"),
    ]
    # No orchestrator call after them: no answer was used.
    assert parl_metrics(anonymous) == {
        "stages": 1,
        "critical_steps": 2,
        "subagents": 2,
        "subagents_finished": 2,
        "subagents_used": 0,
        "subagent_calls_off_pin": 0,
    }
    assert parl_metrics(named) == {
        "stages": 1,
        "critical_steps": 3,
        "subagents": 1,
        "subagents_finished": 1,
        "subagents_used": 0,
        "subagent_calls_off_pin": 0,
    }
    # Two anonymous sub-agents are never compared with each other: no context edit (as one agent,
    # "s " would not continue "s t ").
    assert episode_metrics(anonymous)["context_edits"] == 0


def test_subagent_calls_before_the_first_orchestrator_call_form_a_stage() -> None:
    segments = [
        seg("a ", "1 ", role="subagent", agent="A"),
        seg("a 1 ", "2 ", role="subagent", agent="A"),  # stage 1: no orchestrator call, A's 2 calls
        seg("o ", "3 ", role="orchestrator"),
        seg("b ", "4 ", role="subagent", agent="B", finish_reason=None),  # stage 2: 1 + 1
    ]
    assert parl_metrics(segments) == {
        "stages": 2,
        "critical_steps": 4,
        "subagents": 2,
        "subagents_finished": 1,
        "subagents_used": 0,
        "subagent_calls_off_pin": 0,
    }


def test_batch_metrics_average_over_the_episodes_that_have_each_measurement() -> None:
    parl_shaped = (
        {
            "segments": 6,
            "summaries": 0,
            "max_context_tokens": 7,
            "context_edits": 0,
            "stages": 3,
            "critical_steps": 5,
            "subagents": 2,
            "subagents_finished": 1,
            "subagents_used": 1,
            "subagent_calls_off_pin": 2,
            "cycle": 5,
            "lambda_parallel": 0.1,
            "lambda_finish": 0.05,
        },
        {"rejected": -0.25, "parl_parallel": 0.05, "parl_finish": 0.025},
    )
    parl_unshaped = (  # a PARL episode labelled under a spec without the shaping, before use was measured
        {
            "segments": 2,
            "summaries": 0,
            "max_context_tokens": 3,
            "context_edits": 1,
            "stages": 1,
            "critical_steps": 2,
            "subagents": 2,
            "subagents_finished": 2,
        },
        {"accepted": 0.75},
    )
    unavailable = (
        {
            "segments": 1,
            "summaries": 0,
            "max_context_tokens": 5,
            "context_edits": 0,
            "judge": None,
            "judge_disagrees": None,
        },
        {"no_feedback": 0.0, "judge_unavailable": 0.0},
    )
    judged_good = (
        {
            "segments": 3,
            "summaries": 1,
            "max_context_tokens": 9,
            "context_edits": 1,
            "judge": 0.8,
            "judge_disagrees": True,
        },
        {"rejected": -0.25, "judge": 0.15},
    )
    judged_bad = (
        {
            "segments": 1,
            "summaries": 0,
            "max_context_tokens": 4,
            "context_edits": 0,
            "judge": 0.2,
            "judge_disagrees": False,
        },
        {"rejected": -0.25, "judge": -0.15},
    )
    older = ({}, {"accepted": 0.75})  # settled before episodes were measured: ignored
    out = batch_metrics([parl_shaped, older, parl_unshaped, unavailable, judged_good, judged_bad])
    assert out == pytest.approx(
        {
            "episode_segments_mean": 13 / 5,  # 6 + 2 + 1 + 3 + 1
            "episode_summaries_mean": 0.2,
            "episode_context_tokens_mean": 28 / 5,  # 7 + 3 + 5 + 9 + 4
            "episode_context_tokens_max": 9.0,
            "episode_context_edits_mean": 0.4,
            "parl_episodes": 2.0,
            "parl_critical_steps_mean": 3.5,
            "parl_critical_steps_max": 5.0,
            "parl_subagents_mean": 2.0,
            "parl_subagents_finished_share": 0.75,  # (1 + 2) / (2 + 2)
            "parl_subagents_used_share": 0.5,  # 1 / 2: the episode that has the measurement
            "parl_subagent_calls_off_pin_mean": 2.0,
            "parl_episode_lambda_parallel_mean": 0.1,  # the shaped episode only
            "parl_episode_lambda_finish_mean": 0.05,
            "parl_parallel_reward_mean": 0.05,
            "parl_finish_reward_mean": 0.025,
            "judge_episodes": 3.0,
            "judge_unavailable": 1.0,
            "judge_grade_mean": 0.5,  # (0.8 + 0.2) / 2, the ungraded one left out
            "judge_compared": 2.0,
            "judge_disagreement_rate": 0.5,
        }
    )
    assert batch_metrics([]) == {} and batch_metrics([older]) == {}


def test_a_parl_batch_without_subagents_has_no_finished_share_to_divide_by() -> None:
    orchestrator_only = (
        {
            "segments": 1,
            "summaries": 0,
            "max_context_tokens": 3,
            "stages": 1,
            "critical_steps": 1,
            "subagents": 0,
            "subagents_finished": 0,
        },
        {},
    )
    out = batch_metrics([orchestrator_only])
    assert (out["parl_subagents_finished_share"], out["episode_context_edits_mean"]) == (0.0, 0.0)
    assert not {"judge_episodes", "parl_episode_lambda_parallel_mean"} & set(out)


def test_a_long_context_is_compared_in_milliseconds_not_seconds() -> None:
    """Prompts of a few hundred kilobytes (limits.max_prompt_bytes): the common prefix is found by
    slice comparisons, not a Python loop over characters (docs/security.md, Caps per episode)."""
    import time

    long = "x" * 250_000
    segments = [seg(long, "y"), seg(long + "z", "w")] * 20  # every call rewrites the last character
    started = time.perf_counter()
    metrics = episode_metrics(segments)
    assert metrics["context_edits"] == 39 and metrics["rewritten_chars"] > 0
    assert time.perf_counter() - started < 1.0
