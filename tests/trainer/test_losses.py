"""Token-level losses (CISPO, PPO-clip, GRPO) and the token alignment of micro-batches, by hand."""

import math

import pytest
import torch

from schemas.settings import LossSettings
from trainer.engine import Row, collate
from trainer.losses import LOSSES, Normaliser, TokenBatch, cispo, grpo, ppo

pytestmark = pytest.mark.unit

CFG = LossSettings(type="cispo", eps_low=1.0, eps_high=0.28, is_cap=2.0)
PPO_CFG = LossSettings(type="ppo", eps_low=0.2, eps_high=0.2, is_cap=2.0)


def batch(lp: list[list[float]], old: list[list[float]], mu: list[list[float]], adv: list[float],
          mask: list[list[float]]) -> TokenBatch:
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


def test_registry_has_the_three_losses() -> None:
    assert LOSSES == {"cispo": cispo, "ppo": ppo, "grpo": grpo}


def test_cispo_on_policy_is_reinforce_with_token_mean() -> None:
    lp = [[math.log(0.5), math.log(0.25)]]
    b = batch(lp, lp, lp, [2.0], [[1.0, 1.0]])
    out = cispo(b, CFG, Normaliser(tokens=2, sequences=1))
    # J = 1/2 · (1·2·log .5 + 1·2·log .25) = log .5 + log .25 ; loss = −J
    assert out.loss.item() == pytest.approx(-(math.log(0.5) + math.log(0.25)))
    # dloss/dlogπ = −sg(r̂)·Â/Σ|o| = −1·2/2 for every token
    assert grad_of(out.loss, b) == pytest.approx([-1.0, -1.0])
    assert out.sums == pytest.approx({"ratio": 2.0, "clipped": 0.0, "kl_k1": 0.0, "is_weight": 2.0, "tokens": 2.0})


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


def test_ppo_zeroes_the_gradient_of_clipped_tokens_that_cispo_keeps() -> None:
    lp = [[math.log(0.4)]]
    old = [[math.log(0.2)]]  # r = 2
    b_pos = batch(lp, old, old, [1.0], [[1.0]])
    assert grad_of(ppo(b_pos, PPO_CFG, Normaliser(1, 1)).loss, b_pos) == [0.0]  # min picks the clipped constant
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
