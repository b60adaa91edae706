"""Token-level losses (CISPO, PPO-clip, GRPO, DAPO, Dr. GRPO, GSPO, the KL penalty) and the token
alignment of micro-batches, by hand."""

import math

import pytest
import torch

from schemas.settings import CispoLoss, DapoLoss, DrGrpoLoss, GrpoLoss, GspoLoss, PpoLoss
from serving.sampler import Row, collate
from trainer.advantages import overlong_penalty
from trainer.losses import LOSSES, Normaliser, TokenBatch, cispo, dapo, dpo, dr_grpo, grpo, gspo, ppo, rft

pytestmark = pytest.mark.unit

CFG = CispoLoss(
    eps_low=1.0, eps_high=0.28, is_cap=2.0, kl_coef=0.0
)  # the surrogate alone; the penalty: test_the_kl_penalty_to_the_champion
PPO_CFG = PpoLoss(eps_low=0.2, eps_high=0.2, is_cap=2.0)


def batch(
    lp: list[list[float]],
    old: list[list[float]],
    mu: list[list[float]],
    adv: list[float],
    mask: list[list[float]],
) -> TokenBatch:
    return TokenBatch(
        logprobs=torch.tensor(lp, requires_grad=True),
        old_logprobs=torch.tensor(old),
        behaviour_logprobs=torch.tensor(mu),
        advantages=torch.tensor(adv),
        mask=torch.tensor(mask),
    )


def grad_of(out_loss: torch.Tensor, b: TokenBatch) -> list[float]:
    """d loss / d log π_θ, row-major flat."""
    out_loss.backward()
    assert b.logprobs.grad is not None
    return b.logprobs.grad.flatten().tolist()


def test_registry_has_every_loss_and_each_has_its_papers_defaults() -> None:
    assert LOSSES == {
        "cispo": cispo,
        "ppo": ppo,
        "grpo": grpo,
        "dapo": dapo,
        "dr_grpo": dr_grpo,
        "gspo": gspo,
        "rft": rft,
        "dpo": dpo,
    }
    assert (CispoLoss().eps_low, CispoLoss().eps_high, CispoLoss().kl_coef) == (
        1.0,
        0.28,
        0.5,
    )  # no lower bound
    assert (PpoLoss().eps_low, PpoLoss().eps_high, PpoLoss().kl_coef) == (0.2, 0.2, 0.0)
    assert (GrpoLoss().eps_low, GrpoLoss().kl_coef, GrpoLoss().kl_estimator) == (0.2, 0.04, "k3")
    assert (DapoLoss().eps_low, DapoLoss().eps_high, DapoLoss().dynamic_sampling) == (0.2, 0.28, True)
    assert (GspoLoss().eps_low, GspoLoss().eps_high) == (3e-4, 4e-4)


def test_cispo_on_policy_is_reinforce_with_token_mean() -> None:
    lp = [[math.log(0.5), math.log(0.25)]]
    b = batch(lp, lp, lp, [2.0], [[1.0, 1.0]])
    out = cispo(b, CFG, Normaliser(tokens=2, sequences=1))
    # J = 1/2 · (1·2·log .5 + 1·2·log .25) = log .5 + log .25 ; loss = −J
    assert out.loss.item() == pytest.approx(-(math.log(0.5) + math.log(0.25)))
    # dloss/dlogπ = −sg(r̂)·Â/Σ|o| = −1·2/2 for every token
    assert grad_of(out.loss, b) == pytest.approx([-1.0, -1.0])
    assert out.sums == pytest.approx(
        {
            "ratio": 2.0,
            "clipped": 0.0,
            "kl_k1": 0.0,
            "kl_k3": 0.0,
            "kl_tokens": 2.0,
            "is_weight": 2.0,
            "tokens": 2.0,
        }
    )


def test_cispo_clips_the_weight_but_keeps_the_gradient_of_every_token() -> None:
    # token 0: r = 2 (> 1 + 0.28, clipped to 1.28); token 1: r = 0.5 (no lower bound with eps_low = 1).
    lp = [[math.log(0.4), math.log(0.1)]]
    old = [[math.log(0.2), math.log(0.2)]]
    b = batch(lp, old, old, [1.0], [[1.0, 1.0]])
    out = cispo(b, CFG, Normaliser(tokens=2, sequences=1))
    assert grad_of(out.loss, b) == pytest.approx([-1.28 / 2, -0.5 / 2])
    assert out.sums["clipped"] == 1.0
    assert out.sums["ratio"] == pytest.approx(2.5)
    assert out.sums["kl_k1"] == pytest.approx(-math.log(2) - math.log(0.5))  # = 0
    # k3 = r - 1 - log r per token: (2 - 1 - log 2) + (0.5 - 1 - log 0.5) = 0.5; k1 hides the move, k3 does not.
    assert out.sums["kl_k3"] == pytest.approx((1 - math.log(2)) + (-0.5 + math.log(2)))


def test_ppo_zeroes_the_gradient_of_clipped_tokens_that_cispo_keeps() -> None:
    lp = [[math.log(0.4)]]
    old = [[math.log(0.2)]]  # r = 2
    b_pos = batch(lp, old, old, [1.0], [[1.0]])
    assert grad_of(ppo(b_pos, PPO_CFG, Normaliser(1, 1)).loss, b_pos) == [
        0.0
    ]  # min picks the clipped constant
    b_neg = batch(lp, old, old, [-1.0], [[1.0]])
    # Â < 0: min(r·Â, 1.2·Â) = r·Â = −2; d(−rÂ)/dlogπ = −Â·r = 2
    assert grad_of(ppo(b_neg, PPO_CFG, Normaliser(1, 1)).loss, b_neg) == pytest.approx([2.0])
    b_cispo = batch(lp, old, old, [1.0], [[1.0]])
    assert grad_of(cispo(b_cispo, PPO_CFG, Normaliser(1, 1)).loss, b_cispo) == pytest.approx([-1.2])


def test_truncated_importance_weight_from_behaviour_logprobs() -> None:
    lp = [[math.log(0.3), math.log(0.3)]]
    mu = [[math.log(0.1), math.log(0.25)]]  # π_old/μ = 3 → capped at 2 ; 1.2
    b = batch(lp, lp, mu, [1.0], [[1.0, 1.0]])
    out = cispo(b, CFG, Normaliser(tokens=2, sequences=1))
    assert grad_of(out.loss, b) == pytest.approx([-2.0 / 2, -1.2 / 2])
    assert out.sums["is_weight"] == pytest.approx(3.2)


def test_masked_tokens_get_no_gradient_and_normalisers_differ() -> None:
    lp = [[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]]
    mask = [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    b = batch(lp, lp, lp, [1.0, 1.0], mask)
    # token mean over the whole step (Normaliser says 8 tokens in all micro-batches)
    assert grad_of(ppo(b, PPO_CFG, Normaliser(tokens=8, sequences=4)).loss, b) == pytest.approx(
        [-1 / 8, 0.0, 0.0, -1 / 8, -1 / 8, -1 / 8]
    )
    b2 = batch(lp, lp, lp, [1.0, 1.0], mask)
    # GRPO: 1/G Σ_i 1/|o_i| Σ_t — row 0 has 1 token, row 1 has 3; G = 4 sequences in the step
    assert grad_of(grpo(b2, PPO_CFG, Normaliser(tokens=8, sequences=4)).loss, b2) == pytest.approx(
        [-1 / 4, 0.0, 0.0, -1 / 12, -1 / 12, -1 / 12]
    )


def test_collate_aligns_completion_tokens_with_their_predicting_position() -> None:
    rows = [
        Row(input_ids=[5, 6, 7, 8], prompt_len=2, behaviour_logprobs=[-0.1, -0.2], advantage=1.0),
        Row(input_ids=[9, 10, 11], prompt_len=1, behaviour_logprobs=[-0.3, -0.4], advantage=-1.0),
    ]
    mb = collate(rows, pad_id=0)
    assert mb.input_ids.tolist() == [[5, 6, 7, 8], [9, 10, 11, 0]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert mb.targets.tolist() == [[6, 7, 8], [10, 11, 0]]
    # targets 7, 8 of row 0 (positions 1, 2) and 10, 11 of row 1 (positions 0, 1) are completions
    assert mb.mask.tolist() == [[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    assert mb.behaviour_logprobs.flatten().tolist() == pytest.approx([0.0, -0.1, -0.2, -0.3, -0.4, 0.0])
    assert mb.advantages.tolist() == [1.0, -1.0]
    assert mb.tokens == 4
    with pytest.raises(ValueError, match="row 0"):
        collate([Row(input_ids=[1, 2, 3], prompt_len=1, behaviour_logprobs=[-0.1], advantage=0.0)], 0)


def test_dapo_clips_higher_than_ppo() -> None:
    lp, old = [[math.log(0.25)]], [[math.log(0.2)]]  # r = 1.25: clipped at 1.2, not at 1.28
    b = batch(lp, old, old, [1.0], [[1.0]])
    assert grad_of(ppo(b, PPO_CFG, Normaliser(1, 1)).loss, b) == [0.0]
    b = batch(lp, old, old, [1.0], [[1.0]])
    assert grad_of(dapo(b, DapoLoss(), Normaliser(1, 1)).loss, b) == pytest.approx([-1.25])


def test_dr_grpo_divides_every_token_by_the_same_constant() -> None:
    lp = [[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]]
    b = batch(lp, lp, lp, [1.0, 1.0], [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    # 1/(G·L) with G = 4 sequences in the step and L = 10: the short row's token weighs as much as the others.
    got = grad_of(dr_grpo(b, DrGrpoLoss(norm_tokens=10), Normaliser(tokens=8, sequences=4)).loss, b)
    assert got == pytest.approx([-1 / 40, 0.0, 0.0, -1 / 40, -1 / 40, -1 / 40])


def test_gspo_uses_one_length_normalised_ratio_per_sequence() -> None:
    # Token ratios 2 and 0.5: the sequence ratio (2 · 0.5)^(1/2) = 1, inside the clip.
    lp, old = [[math.log(0.4), math.log(0.1)]], [[math.log(0.2), math.log(0.2)]]
    b = batch(lp, old, old, [1.0], [[1.0, 1.0]])
    out = gspo(b, GspoLoss(), Normaliser(tokens=2, sequences=1))
    assert out.loss.item() == pytest.approx(-1.0)  # −s·Â
    assert grad_of(out.loss, b) == pytest.approx([-0.5, -0.5])  # −Â·s/|o| per token
    assert out.sums["clipped"] == 0.0
    # s = 2: clipped at 1 + 4e-4 for Â > 0 (no gradient); for Â < 0 the unclipped branch, +Â·s/|o|.
    lp = [[math.log(0.4), math.log(0.4)]]
    b = batch(lp, old, old, [1.0], [[1.0, 1.0]])
    out = gspo(b, GspoLoss(), Normaliser(tokens=2, sequences=1))
    assert grad_of(out.loss, b) == [0.0, 0.0] and out.sums["clipped"] == 2.0
    b = batch(lp, old, old, [-1.0], [[1.0, 1.0]])
    assert grad_of(gspo(b, GspoLoss(), Normaliser(tokens=2, sequences=1)).loss, b) == pytest.approx(
        [1.0, 1.0]
    )


def test_gspo_truncates_the_behaviour_weight_per_sequence() -> None:
    lp = [[math.log(0.3), math.log(0.3)]]
    mu = [[math.log(0.1), math.log(0.1)]]  # (π_old/μ) per token 3: geometric mean 3, capped at 2
    b = batch(lp, lp, mu, [1.0], [[1.0, 1.0]])
    out = gspo(b, GspoLoss(is_cap=2.0), Normaliser(tokens=2, sequences=1))
    assert out.loss.item() == pytest.approx(-2.0)
    assert out.sums["is_weight"] == pytest.approx(4.0)  # 2 per token


@pytest.mark.parametrize(
    ("estimator", "value", "grad"), [("k3", 0.5 - 1 - math.log(0.5), 0.5), ("k1", math.log(2), 1.0)]
)
def test_the_kl_penalty_to_the_champion(estimator: str, value: float, grad: float) -> None:
    # π_θ = 0.4, π_old = 0.2, Â = 0: only the penalty. k3 = r − 1 − log r with r = π_old/π_θ = 0.5,
    # d/dlogπ_θ = 1 − r; k1 = log π_θ − log π_old, d/dlogπ_θ = 1.
    lp, old = [[math.log(0.4)]], [[math.log(0.2)]]
    b = batch(lp, old, old, [0.0], [[1.0]])
    cfg = PpoLoss(kl_coef=0.1, kl_estimator=estimator)
    out = ppo(b, cfg, Normaliser(1, 1))
    assert out.loss.item() == pytest.approx(0.1 * value)
    assert grad_of(out.loss, b) == pytest.approx([0.1 * grad])


def test_dapo_overlong_penalty() -> None:
    # max_tokens 100, buffer 0.2: free up to 80 tokens, then linear to −1 at 100.
    assert [overlong_penalty(n, 100, 0.2) for n in (50, 80, 90, 100, 120)] == pytest.approx(
        [0, 0, -0.5, -1, -1]
    )
    assert overlong_penalty(120, None, 0.2) == 0.0 and overlong_penalty(120, 100, 0.0) == 0.0


def test_an_episode_is_shaped_by_its_most_overlong_trainable_segment() -> None:
    from datetime import UTC, datetime

    from schemas.events import SamplingParams
    from store import TrainingEpisode, TrainingSegment
    from trainer.batch import episode_overlong_penalty

    def segment(length: int, max_tokens: int | None, trainable: bool = True) -> TrainingSegment:
        return TrainingSegment(
            prompt="p",
            prompt_token_ids=[1],
            completion_token_ids=[2] * length,
            completion_logprobs=[-0.1] * length,
            trainable=trainable,
            role="policy",
            policy_version=1,
            sampling=SamplingParams(max_tokens=max_tokens),
        )

    def episode(*segments: TrainingSegment) -> TrainingEpisode:
        return TrainingEpisode(
            episode_id="e",
            reward=1.0,
            policy_version=1,
            created_at=datetime.now(UTC),
            segments=list(segments),
        )

    assert episode_overlong_penalty(episode(segment(5, 10), segment(9, 10)), 0.2) == pytest.approx(-0.5)
    assert episode_overlong_penalty(episode(segment(10, 10, trainable=False), segment(5, 10)), 0.2) == 0.0
    assert episode_overlong_penalty(episode(segment(50, None)), 0.2) == 0.0


# ---- the KL penalty to the fixed reference (trainer/reference.py) ---------------------------------


def ref_batch(lp: list[list[float]], ref: list[list[float]] | None, adv: float = 0.0) -> TokenBatch:
    """One row whose π_old is π_θ itself (no champion term, ratio 1), with π_ref's logprobs `ref`."""
    mask = [[1.0] * len(lp[0])]
    return TokenBatch(
        logprobs=torch.tensor(lp, requires_grad=True),
        old_logprobs=torch.tensor(lp),
        behaviour_logprobs=torch.tensor(lp),
        advantages=torch.tensor([adv]),
        mask=torch.tensor(mask),
        ref_tempered=None if ref is None else torch.tensor(ref),
        pairs=torch.tensor([-1]),
    )


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_the_reference_penalty_is_zero_where_the_policy_is_the_reference(estimator: str) -> None:
    lp = [[math.log(0.3), math.log(0.6)]]
    b = ref_batch(lp, lp)
    out = ppo(b, PpoLoss(kl_coef=0.0, ref_kl_coef=0.5, kl_estimator=estimator), Normaliser(2, 1))
    assert out.loss.item() == pytest.approx(0.0, abs=1e-7)
    assert out.sums["ref_kl_k1"] == pytest.approx(0.0, abs=1e-7)
    assert out.sums["ref_kl_k3"] == pytest.approx(0.0, abs=1e-7)
    # k3's gradient is 1 − π_ref/π_θ: 0 at the reference; k1's is the constant β per token.
    assert grad_of(out.loss, b) == pytest.approx([0.0, 0.0] if estimator == "k3" else [0.25, 0.25])


@pytest.mark.parametrize(
    ("theta", "ref", "estimator", "value", "grad"),
    [
        # π_θ above π_ref: the gradient of the loss is positive, so descent lowers log π_θ toward π_ref.
        (0.4, 0.2, "k3", 0.5 - 1 - math.log(0.5), 1 - 0.5),
        (0.4, 0.2, "k1", math.log(2), 1.0),
        # π_θ below π_ref: k3's gradient is negative, descent raises log π_θ toward π_ref.
        (0.1, 0.2, "k3", 2 - 1 - math.log(2), 1 - 2),
    ],
)
def test_the_reference_penalty_pulls_the_policy_toward_the_reference(
    theta: float, ref: float, estimator: str, value: float, grad: float
) -> None:
    # Â = 0 and π_old = π_θ: the reference penalty alone, k3 = r − 1 − log r with r = π_ref/π_θ,
    # d/dlogπ_θ = 1 − r; k1 = log π_θ − log π_ref, d/dlogπ_θ = 1.
    b = ref_batch([[math.log(theta)]], [[math.log(ref)]])
    out = cispo(b, CispoLoss(kl_coef=0.0, ref_kl_coef=0.1, kl_estimator=estimator), Normaliser(1, 1))
    assert out.loss.item() == pytest.approx(0.1 * value)
    assert grad_of(out.loss, b) == pytest.approx([0.1 * grad])
    assert out.sums["ref_kl_k1"] == pytest.approx(math.log(theta / ref))
    assert out.sums["ref_kl_k3"] == pytest.approx(ref / theta - 1 - math.log(ref / theta))


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_every_loss_weighs_the_reference_as_it_weighs_the_champion(loss: str) -> None:
    """At Â = 0 only the penalties are left: β_ref·KL(π_θ ‖ π_ref) is the same number, and the same
    gradient, as β·KL(π_θ ‖ π_old) with π_old in π_ref's place, under every loss's normalisation."""
    from pydantic import TypeAdapter

    from schemas.settings import LossSettings

    lp = [[math.log(0.5), math.log(0.25), math.log(0.1)], [math.log(0.2), math.log(0.7), 0.0]]
    ref = [[math.log(0.4), math.log(0.25), math.log(0.3)], [math.log(0.1), math.log(0.9), 0.0]]
    mask = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    norm = Normaliser(tokens=5, sequences=2)

    def run(kl: float, ref_kl: float, old: list[list[float]], ref_lp: list[list[float]] | None):
        cfg = TypeAdapter(LossSettings).validate_python({"type": loss, "kl_coef": kl, "ref_kl_coef": ref_kl})
        b = TokenBatch(
            logprobs=torch.tensor(lp, requires_grad=True),
            old_logprobs=torch.tensor(old),
            behaviour_logprobs=torch.tensor(old),
            advantages=torch.zeros(2),
            mask=torch.tensor(mask),
            pairs=torch.tensor([-1, -1]),
            ref_tempered=None if ref_lp is None else torch.tensor(ref_lp),
        )
        out = LOSSES[loss](b, cfg, norm)
        return out.loss.item(), grad_of(out.loss, b)

    champion = run(0.3, 0.0, ref, None)
    reference = run(0.0, 0.3, lp, ref)
    assert champion[0] != 0.0
    assert reference[0] == pytest.approx(champion[0], abs=1e-6)
    assert reference[1] == pytest.approx(champion[1], abs=1e-6)
    both = run(0.3, 0.3, ref, ref)
    assert both[0] == pytest.approx(2 * champion[0], abs=1e-6), "the two penalties add up"


def test_a_batch_without_the_references_logprobs_is_refused_when_the_penalty_is_on() -> None:
    lp = [[math.log(0.4)]]
    with pytest.raises(ValueError, match="ref_kl_coef"):
        ppo(ref_batch(lp, None), PpoLoss(ref_kl_coef=0.1), Normaliser(1, 1))
    out = ppo(ref_batch(lp, None), PpoLoss(ref_kl_coef=0.0), Normaliser(1, 1))  # off: nothing needed
    assert "ref_kl_k1" not in out.sums
