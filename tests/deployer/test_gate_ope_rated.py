"""The ope suite estimates the reward on rated held-out episodes (``gate.ope.episodes``, docs/gate.md
Suites: ope): an unrated episode's settled reward says nothing about the model, and averaging it in
dilutes a loss of acceptance by the feedback rate. `ope_suite` end to end with the store and the
forward passes faked at their function boundaries (planted logprobs, no model, no service)."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from deployer import gate_suites, ope
from schemas.events import SamplingParams
from schemas.settings import Settings
from store.episodes import TrainingEpisode, TrainingSegment

pytestmark = pytest.mark.unit

# tab-v1 (the demo's spec): accepted 0.75, rejected -0.25; an unrated episode settles at 0.
ACCEPTED, REJECTED = 0.75, -0.25
# The challenger's importance weights: accepted episodes down, rejected ones up, so that among the rated
# its acceptance is 37.5 % against the logging policy's 50 % (a 12.5-point loss, issue 39's), and the
# rated share stays 30 % (0.15 x 0.75 + 0.15 x 1.25 = 0.3: the no_feedback alarm has nothing to see).
LESS, MORE = math.log(0.75), math.log(1.25)


def _episode(i: int, rated: bool, accepted: bool, judged: bool = False) -> TrainingEpisode:
    sampling = SamplingParams(temperature=0.7, max_tokens=16, logprobs_mode="processed")
    if rated:
        components = {"accepted": ACCEPTED} if accepted else {"rejected": REJECTED}
    else:
        components = {"no_feedback": 0.0, **({"judge": 0.25} if judged else {})}
    return TrainingEpisode(
        episode_id=f"e{i}",
        reward=sum(components.values()),
        policy_version=1,
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
        segments=[
            TrainingSegment(f"prompt {i}", [1, 2], [3, 4], [-1.0, -1.0], True, "assistant", 1, sampling)
        ],
        no_feedback=not rated,
        components=components,
    )


def held_out(n: int = 1000, rated_per_ten: int = 3) -> list[TrainingEpisode]:
    """`n` held-out episodes, `rated_per_ten` in ten rated (30 % by default), half of those accepted."""
    return [_episode(i, i % 10 < rated_per_ten, i % 20 < 10) for i in range(n)]


class FakeStore:
    def __init__(self, episodes: list[TrainingEpisode]) -> None:
        self.episodes = episodes

    def select_heldout(self, n: int, **kwargs: Any) -> list[TrainingEpisode]:
        return self.episodes


@pytest.fixture(autouse=True)
def planted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The champion (and the anchor) is the logging policy; the challenger accepts less (`LESS`, `MORE`)."""

    def scored(weights: ope.Weights, logged: list[ope.Logged]) -> ope.Scored:
        if weights.path.name != "challenger":
            lp = [e.behaviour for e in logged]
        else:
            lp = [
                e.behaviour + (0.0 if e.no_feedback else LESS if "accepted" in e.components else MORE)
                for e in logged
            ]
        return ope.Scored(lp, lp)

    monkeypatch.setattr(ope, "sequence_logprobs", scored)


def with_ope(**update: Any) -> Settings:
    settings = Settings()
    gate_cfg = settings.gate.model_copy(
        update={"ope": settings.gate.ope.model_copy(update={"estimator": "snips", **update})}
    )
    return settings.model_copy(update={"gate": gate_cfg})


def suite(
    settings: Settings, episodes: list[TrainingEpisode], anchor: bool = False
) -> gate_suites.OpeVerdicts:
    return gate_suites.ope_suite(
        settings,
        FakeStore(episodes),  # type: ignore[arg-type]
        ope.Weights(Path("challenger")),
        ope.Weights(Path("champion")),
        seed=1,
        anchor=ope.Weights(Path("anchor")) if anchor else None,
    )


def test_the_rated_estimate_catches_the_acceptance_loss_that_all_episodes_dilute_into_the_margin() -> None:
    rated = suite(with_ope(), held_out()).suite
    every = suite(with_ope(episodes="all"), held_out()).suite
    assert rated.difference is not None and every.difference is not None
    # Among the rated, 12.5 points less acceptance is 0.125 reward units under tab-v1 (0.75 - (-0.25) = 1
    # per acceptance): challenger 0.375 x 0.75 - 0.625 x 0.25 = 0.125 against 0.5 x 0.75 - 0.5 x 0.25 = 0.25.
    assert rated.challenger == pytest.approx(0.125) and rated.champion == pytest.approx(0.25)
    assert rated.difference.estimate == pytest.approx(-0.125)
    assert rated.conclusive and rated.passed is False
    # Over every episode the same loss is 30 % of that, 0.0375: inside the 0.05 margin, and it passes.
    assert every.challenger == pytest.approx(0.0375) and every.champion == pytest.approx(0.075)
    assert every.difference.estimate == pytest.approx(-0.0375)
    assert every.conclusive and every.passed is True and every.difference.low > -every.margin


def test_all_reproduces_the_estimate_over_every_usable_episode() -> None:
    """Under all the verdict is the one the suite gave before it kept rated episodes only:
    `_ope_verdict` on every usable episode, the note prefixed with the unrated count."""
    settings = with_ope(episodes="all")
    every = suite(settings, held_out()).suite
    logged, _ = ope.usable(held_out())
    chal = [
        e.behaviour + (0.0 if e.no_feedback else LESS if "accepted" in e.components else MORE) for e in logged
    ]
    before, _ = gate_suites._ope_verdict(
        settings, logged, chal, [e.behaviour for e in logged], 1, "", "champion"
    )
    assert every.difference == before.difference and every.ess == before.ess and every.n == 1000
    assert every.unrated == 0
    assert every.note.startswith(
        "every usable held-out episode (gate.ope.episodes all), 700 of them unrated; "
    )


def test_the_note_and_the_record_count_kept_and_unrated_episodes_and_the_anchor_reads_the_same() -> None:
    verdicts = suite(with_ope(), held_out(), anchor=True)
    rated, anchored = verdicts.suite, verdicts.anchored
    assert (rated.n, rated.unrated) == (300, 700)
    assert rated.note.startswith(
        "rated episodes only (gate.ope.episodes rated): 300 of 1000 usable held-out episodes kept, "
        "700 left out as unrated (no feedback, no judge's grade); estimator snips; 300 held-out episodes, "
    )
    # The anchor is the logging policy here, as the champion is: the very same verdict, on the same episodes.
    assert anchored is not None and (anchored.n, anchored.unrated) == (300, 700)
    assert anchored.difference == rated.difference and "anchor 300.0" in anchored.note
    # The alarms still read every episode: the challenger leaves as many unrated as the champion.
    fired = {a.name: a.fired for a in verdicts.alarms}
    assert fired == {"kl": False, "no_feedback": False}


def test_too_few_rated_episodes_is_inconclusive_and_says_so() -> None:
    episodes = held_out(300, rated_per_ten=1)  # 30 rated of 300: fewer than min_ess 32
    verdicts = suite(with_ope(), episodes, anchor=True)
    rated = verdicts.suite
    assert not rated.conclusive and rated.passed is None and rated.difference is None
    assert (rated.n, rated.unrated) == (30, 270)
    assert rated.note == (
        "rated episodes only (gate.ope.episodes rated): 30 of 300 usable held-out episodes kept, 270 left out "
        "as unrated (no feedback, no judge's grade): fewer than gate.ope.min_ess 32"
    )
    assert verdicts.anchored is not None and not verdicts.anchored.conclusive
    # The same traffic over every episode concludes (and, diluted, passes).
    every = suite(with_ope(episodes="all"), episodes).suite
    assert every.conclusive and every.n == 300


def test_a_judged_episode_without_feedback_is_rated_as_the_trainer_counts_it() -> None:
    logged, _ = ope.usable(
        [_episode(0, False, False), _episode(1, False, False, judged=True), _episode(2, True, True)]
    )
    assert gate_suites.kept_episodes(with_ope(), logged) == [1, 2]
    assert gate_suites.kept_episodes(with_ope(episodes="all"), logged) == [0, 1, 2]


class NewestFirstStore(FakeStore):
    """`select_heldout` as the store answers it: the newest `n` (the list is newest first), of the
    rated only with `rated_only`."""

    def select_heldout(self, n: int, *, rated_only: bool = False, **kwargs: Any) -> list[TrainingEpisode]:
        return [e for e in self.episodes if not rated_only or not e.no_feedback or "judge" in e.components][
            :n
        ]


def test_sparse_feedback_still_gets_the_rated_episodes_behind_the_newest_unrated_ones() -> None:
    """At a low feedback rate the newest max_episodes hold almost no rated episode; the suite also
    selects the newest max_episodes rated ones, older ones included, so its verdict concludes. The
    alarms still read only the newest max_episodes, rated or not."""
    unrated = [_episode(i, False, False) for i in range(600)]
    older_rated = [_episode(600 + i, True, i % 20 < 10) for i in range(300)]
    settings = with_ope(max_episodes=512)
    verdicts = gate_suites.ope_suite(
        settings,
        NewestFirstStore(unrated + older_rated),  # type: ignore[arg-type]
        ope.Weights(Path("challenger")),
        ope.Weights(Path("champion")),
        seed=1,
    )
    rated = verdicts.suite
    assert (rated.n, rated.unrated) == (300, 512)  # all 300 rated, behind 512 newest unrated
    assert rated.conclusive and rated.passed is False
    assert rated.difference is not None and rated.difference.estimate == pytest.approx(-0.125)
    # Before, only the newest 512 were read: no rated episode among them.
    fired = {a.name: a.fired for a in verdicts.alarms}
    assert fired == {"kl": False, "no_feedback": False}  # the alarms' sample: 512 unrated, unmoved
