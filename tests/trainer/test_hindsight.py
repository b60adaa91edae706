"""Hindsight distillation from written corrections (trainer/hindsight.py): the spec's term, the
per-token advantages it adds (hand-worked, and on a tiny real model against a full forward pass),
what it leaves alone, and the per-token advantages through the micro-batch and the losses."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from schemas.rewards import SPECS, TAB_V1, HindsightTerm, RewardSpec
from schemas.settings import CispoLoss, GspoLoss, RftLoss, TrainerSettings
from serving.sampler import Row, collate
from store import TrainingEpisode, TrainingSegment
from store.episodes import Correction
from trainer import hindsight
from trainer.batch import carries_advantage, rows_of
from trainer.hindsight import completion_logprobs, distil, hints, teacher_row, token_terms
from trainer.losses import Normaliser, TokenBatch, cispo, gspo, rft

pytestmark = pytest.mark.unit

HINT = [90, 91]  # what the stand-in tokenizer makes of any hint
T0 = datetime(2026, 1, 1, tzinfo=UTC)


# ---- the spec's term ---------------------------------------------------------------------------------


def test_the_term_is_bounded_and_its_template_names_the_correction_once() -> None:
    assert HindsightTerm(weight=0.0).clip == 5.0 and "{correction}" in HindsightTerm(weight=1).template
    for bad in (
        {"weight": -0.1},
        {"weight": 10.5},
        {"weight": 1, "clip": 0},
        {"weight": 1, "template": "no placeholder"},
        {"weight": 1, "template": "{correction} and {correction}"},
        {"weight": 1, "extra": 1},
    ):
        with pytest.raises(ValidationError):
            HindsightTerm.model_validate(bad)


def test_the_hint_keeps_a_users_braces_and_joins_several_corrections() -> None:
    term = HindsightTerm(weight=1, template="[{correction}]")
    assert term.hint(["use {x}", "The answer is 12."]) == "[use {x}\nThe answer is 12.]"


def test_only_hindsight_v1_of_the_built_in_specs_has_a_term_and_a_json_spec_may_carry_one() -> None:
    assert {name for name, spec in SPECS.items() if spec.hindsight is not None} == {"hindsight-v1"}
    assert SPECS["hindsight-v1"].weights == TAB_V1.weights and SPECS["hindsight-v1"].primary == TAB_V1.primary
    spec = TAB_V1.model_copy(update={"hindsight": HindsightTerm(weight=0.5)})
    loaded = RewardSpec.model_validate_json(spec.model_dump_json())
    assert loaded.hindsight == HindsightTerm(weight=0.5) and loaded.spec_id == TAB_V1.spec_id
    with pytest.raises(ValidationError):
        RewardSpec.model_validate(TAB_V1.model_dump() | {"hindsight": {"weight": 1, "template": "x"}})


# ---- the per-token term --------------------------------------------------------------------------------


def test_token_terms_by_hand() -> None:
    """Gaps 0.5, −1.0, 8.9 at weight 0.5 and clip 5: 0.25, −0.5 and 0.5 · 5 = 2.5; the gap sum is unclipped."""
    terms, gap_sum = token_terms([-0.5, -2.0, -0.1], [-1.0, -1.0, -9.0], weight=0.5, clip=5.0)
    assert terms == pytest.approx((0.25, -0.5, 2.5)) and gap_sum == pytest.approx(8.4)


def segment(request: str, completion: list[int]) -> TrainingSegment:
    return TrainingSegment(
        prompt="p",
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=completion,
        completion_logprobs=[-1.0] * len(completion),
        trainable=True,
        role="policy",
        policy_version=1,
        request_id=request,
    )


def episode(name: str, *corrections: tuple[str, str], completion: list[int] | None = None) -> TrainingEpisode:
    return TrainingEpisode(
        episode_id=name,
        reward=0.0,
        policy_version=1,
        created_at=T0,
        segments=[segment(f"r-{name}", completion or [4, 5])],
        corrections=tuple(Correction(request, "correction", text, T0) for request, text in corrections),
    )


class Scorer:
    """A stand-in teacher/student: −1 per completion token without the hint, −0.25 with it (so the gap
    is +0.75 on every token); records the rows it scored."""

    def __init__(self) -> None:
        self.scored: list[Row] = []

    def __call__(self, rows: list[Row]) -> list[list[float]]:
        self.scored += rows
        out = []
        for row in rows:
            hinted = row.input_ids[row.prompt_len - len(HINT) : row.prompt_len] == HINT
            out.append([-0.25 if hinted else -1.0] * (len(row.input_ids) - row.prompt_len))
        return out


def tokenize(text: str) -> list[int]:
    return list(HINT)


def test_a_corrected_rows_tokens_get_the_term_on_top_of_its_advantage_and_the_others_are_unchanged() -> None:
    """e0 corrected (advantage 0.3), e1 not (−0.2), same tokens: e0's tokens get 0.3 + 2 · 0.75; e1's row
    is the row rows_of built, and was never scored."""
    episodes = [episode("e0", ("r-e0", "The answer is 12.")), episode("e1")]
    rows, _ = rows_of(episodes, [0.3, -0.2])
    scorer = Scorer()

    out = distil(
        HindsightTerm(weight=2.0), episodes, rows, tokenize=tokenize, score=scorer, add_missing=False
    )

    assert out.rows[0].token_advantages == pytest.approx((1.8, 1.8)) and out.rows[0].advantage == 0.3
    assert out.rows[1] == rows[1] and out.rows[1].token_advantages is None
    assert len(scorer.scored) == 2, "e0's row without and with the hint; e1 not scored"
    assert out.metrics == {
        "hindsight_episodes": 1.0,
        "hindsight_rows": 1.0,
        "hindsight_added_rows": 0.0,
        "hindsight_tokens": 2.0,
        "hindsight_gap_mean": pytest.approx(0.75),
    }


def test_the_hint_is_in_the_teachers_context_and_not_in_the_trained_tokens() -> None:
    """The teacher row is prompt + hint + the same completion; the trained row is untouched, and its
    loss mask covers its completion tokens only."""
    episodes = [episode("e0", ("r-e0", "The answer is 12."), completion=[7, 8, 9])]
    rows, _ = rows_of(episodes, [0.0])
    scorer = Scorer()

    out = distil(
        HindsightTerm(weight=1.0), episodes, rows, tokenize=tokenize, score=scorer, add_missing=False
    )

    student, teacher = scorer.scored
    assert student.input_ids == [1, 2, 3, 7, 8, 9] and student.prompt_len == 3
    assert teacher.input_ids == [1, 2, 3, *HINT, 7, 8, 9] and teacher.prompt_len == 3 + len(HINT)
    [trained] = out.rows
    assert trained.input_ids == [1, 2, 3, 7, 8, 9] and not set(HINT) & set(trained.input_ids)
    batch = collate([trained], pad_id=0)
    assert batch.mask.tolist() == [[0.0, 0.0, 1.0, 1.0, 1.0]]  # targets 7, 8, 9
    assert batch.token_advantages.tolist() == [[0.0, 0.0, 0.75, 0.75, 0.75]]
    assert teacher_row(trained, HINT).behaviour_logprobs == trained.behaviour_logprobs


def test_weight_zero_or_no_correction_changes_nothing_and_scores_nothing() -> None:
    corrected = [episode("e0", ("r-e0", "The answer is 12."))]
    plain = [episode("e0"), episode("e1", ("r-other-call", "about a call the episode does not have"))]
    for term, episodes in ((HindsightTerm(weight=0.0), corrected), (HindsightTerm(weight=1.0), plain)):
        rows, _ = rows_of(episodes, [0.5] * len(episodes))
        scorer = Scorer()
        out = distil(term, episodes, rows, tokenize=tokenize, score=scorer, add_missing=True)
        assert out.rows == rows and scorer.scored == [] and out.metrics == {"hindsight_episodes": 0.0}


def test_a_corrected_episode_the_objective_left_out_joins_at_advantage_zero() -> None:
    """Under rft only accepted episodes are rows: a rejected, corrected one joins with the term alone."""
    episodes = [episode("accepted"), episode("rejected", ("r-rejected", "The answer is 12."))]
    rows, _ = rows_of(episodes[:1], [1.0])

    out = distil(
        HindsightTerm(weight=1.0), episodes, rows, tokenize=tokenize, score=Scorer(), add_missing=True
    )

    assert [r.source for r in out.rows] == [("accepted", 0), ("rejected", 0)]
    assert out.rows[1].advantage == 0.0 and out.rows[1].token_advantages == pytest.approx((0.75, 0.75))
    assert out.metrics["hindsight_added_rows"] == 1.0 and carries_advantage(out.rows[1])
    assert not carries_advantage(Row([1, 2], 1, [-1.0], 0.0))


def test_hints_match_corrections_to_their_own_segment() -> None:
    two_calls = TrainingEpisode(
        episode_id="e",
        reward=0.0,
        policy_version=1,
        created_at=T0,
        segments=[segment("r-a", [4]), segment("r-b", [5])],
        corrections=(Correction("r-b", "correction", "first", T0), Correction("r-b", "edited", "second", T0)),
    )
    assert hints(HindsightTerm(weight=1, template="<{correction}>"), [two_calls]) == {
        ("e", 1): "<first\nsecond>"
    }


def test_run_loads_no_teacher_without_a_term_a_correction_or_under_dpo(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_teacher(*args: Any) -> None:
        raise AssertionError("the teacher was loaded")

    monkeypatch.setattr(hindsight, "Teacher", no_teacher)
    corrected = [episode("e0", ("r-e0", "The answer is 12."))]
    rows, _ = rows_of(corrected, [0.5])
    dpo = TrainerSettings.model_validate({"loss": {"type": "dpo"}})
    cispo_cfg = TrainerSettings()
    assert hindsight.run(None, cispo_cfg, corrected, rows, Path("c"), None).metrics == {}
    assert hindsight.run(HindsightTerm(weight=1), dpo, corrected, rows, Path("c"), None).rows == rows
    plain = [episode("e0")]
    assert hindsight.run(HindsightTerm(weight=1), cispo_cfg, plain, rows, Path("c"), None).rows == rows


# ---- on a tiny real model --------------------------------------------------------------------------


def tiny_model() -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape = dict(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=48,
        max_position_embeddings=64,
    )
    return Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True)).eval()


def full_logprobs(model: Any, ids: list[int], first: int) -> list[float]:
    """log softmax of a full forward pass: the logprob of each token from position `first` on."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[t - 1, ids[t]]) for t in range(first, len(ids))]


def test_on_a_tiny_model_the_term_is_the_teachers_minus_the_students_logprob_of_each_sampled_token() -> None:
    model = tiny_model()
    episodes = [
        episode("e0", ("r-e0", "hint"), completion=[40, 41, 42]),
        episode("e1", completion=[40, 41, 42]),
    ]
    rows, _ = rows_of(episodes, [0.5, 0.5])

    def score(batch: list[Row]) -> list[list[float]]:
        return completion_logprobs(model, batch, micro_batch=1)

    out = distil(
        HindsightTerm(weight=0.5, clip=50), episodes, rows, tokenize=tokenize, score=score, add_missing=False
    )

    teacher = full_logprobs(model, [1, 2, 3, *HINT, 40, 41, 42], first=5)
    student = full_logprobs(model, [1, 2, 3, 40, 41, 42], first=3)
    expected = [0.5 + 0.5 * (t - s) for t, s in zip(teacher, student, strict=True)]
    assert out.rows[0].token_advantages == pytest.approx(expected, abs=1e-5)
    assert any(abs(t - s) > 1e-4 for t, s in zip(teacher, student, strict=True)), "the hint changes something"
    assert out.rows[1] == rows[1]
    assert out.metrics["hindsight_gap_mean"] == pytest.approx(
        sum(t - s for t, s in zip(teacher, student, strict=True)) / 3, abs=1e-5
    )


# ---- per-token advantages in the micro-batch and the losses -----------------------------------------


def test_collate_broadcasts_a_rows_advantage_unless_it_has_its_tokens_own() -> None:
    rows = [Row([1, 2, 3], 1, [-1.0, -1.0], 0.5), Row([1, 2, 3], 2, [-1.0], 0.5, token_advantages=(2.0,))]
    batch = collate(rows, pad_id=0)
    assert batch.token_advantages.tolist() == [[0.5, 0.5], [0.0, 2.0]]
    with pytest.raises(ValueError, match="token advantages"):
        collate([Row([1, 2, 3], 1, [-1.0, -1.0], 0.5, token_advantages=(1.0,))], pad_id=0)


def token_batch(token_advantages: torch.Tensor | None) -> TokenBatch:
    logprobs = torch.tensor([[-1.0, -2.0]])
    return TokenBatch(
        logprobs=logprobs,
        old_logprobs=logprobs,
        behaviour_logprobs=logprobs,
        advantages=torch.tensor([1.0]),
        mask=torch.ones(1, 2),
        token_advantages=token_advantages,
    )


def test_losses_weigh_each_token_by_its_own_advantage() -> None:
    """rft: −(1 · −1 + 3 · −2) / 2 = 3.5 with advantages 1 and 3 per token (1.5 with the row's 1 on
    both); cispo at ratio 1 and behaviour weight 1 is the same sum; gspo takes the tokens' mean, 2."""
    norm = Normaliser(tokens=2, sequences=1)
    per_token = torch.tensor([[1.0, 3.0]])
    assert float(rft(token_batch(per_token), RftLoss(), norm).loss) == pytest.approx(3.5)
    assert float(rft(token_batch(None), RftLoss(), norm).loss) == pytest.approx(1.5)
    assert float(cispo(token_batch(per_token), CispoLoss(), norm).loss) == pytest.approx(3.5)
    assert token_batch(per_token).sequence_advantage().tolist() == [2.0]
    assert float(gspo(token_batch(per_token), GspoLoss(), norm).loss) == pytest.approx(-2.0)


def test_the_worker_gauges_the_last_cycles_distilled_episodes_and_gap() -> None:
    from prometheus_client import REGISTRY

    from trainer import metrics

    out = {"status": "promoted", "episodes": 4, "mean_reward": 0.0}
    metrics.cycle_ended(
        out | {"hindsight": {"hindsight_episodes": 3.0, "hindsight_gap_mean": 0.25}}, chain_s=1.0
    )

    def gauged(stat: str) -> float | None:
        return REGISTRY.get_sample_value("rtrl_trainer_last_cycle", {"stat": stat})

    assert (gauged("hindsight_episodes"), gauged("hindsight_gap_mean")) == (3.0, 0.25)
