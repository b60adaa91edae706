"""The objectives that are not RL (trainer/losses.py `rft`, `dpo`; trainer/objectives.py): their
loss values and gradients on hand-made tensors, DPO's pairing and its micro-batches, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from schemas.settings import DpoLoss, RftLoss
from serving.sampler import Row
from trainer.losses import Normaliser, TokenBatch, dpo, rft
from trainer.objectives import batches, dpo_micro_batches, pair_indices

pytestmark = pytest.mark.unit

LOG2 = math.log(2.0)


def token_batch(
    lp: list[list[float]],
    mu: list[list[float]],
    adv: list[float],
    mask: list[list[float]],
    pairs: list[int] | None = None,
    old: list[list[float]] | None = None,
) -> TokenBatch:
    return TokenBatch(
        logprobs=torch.tensor(lp, requires_grad=True),
        old_logprobs=torch.tensor(old if old is not None else lp),
        behaviour_logprobs=torch.tensor(mu),
        advantages=torch.tensor(adv),
        mask=torch.tensor(mask),
        pairs=None if pairs is None else torch.tensor(pairs),
    )


def grad_of(loss: torch.Tensor, b: TokenBatch) -> list[float]:
    """d loss / d log π_θ, row-major flat."""
    loss.backward()
    assert b.logprobs.grad is not None
    return b.logprobs.grad.flatten().tolist()


# ---- rft -------------------------------------------------------------------------------------------


def test_rft_is_the_token_mean_nll_of_the_accepted_rows() -> None:
    """Two accepted rows (weight 1), 3 tokens: L = −(log .5 + log .25 + log .1)/3, and every token's
    gradient is −1/3 (descent raises each accepted token's logprob by the same step)."""
    lp = [[math.log(0.5), math.log(0.25)], [math.log(0.1), 0.0]]
    b = token_batch(lp, lp, [1.0, 1.0], [[1.0, 1.0], [1.0, 0.0]])
    out = rft(b, RftLoss(), Normaliser(tokens=3, sequences=2))
    assert out.loss.item() == pytest.approx(-(math.log(0.5) + math.log(0.25) + math.log(0.1)) / 3)
    assert grad_of(out.loss, b) == pytest.approx([-1 / 3, -1 / 3, -1 / 3, 0.0])
    assert out.sums["ratio"] == pytest.approx(3.0) and out.sums["clipped"] == 0.0
    assert out.sums["tokens"] == 3.0


def test_rft_weighs_nothing_but_the_accepted_row() -> None:
    """A row with weight 0 (not accepted) adds neither loss nor gradient; the normaliser counts
    only the accepted tokens (trainer/objectives.py leaves the others out of the batch)."""
    lp = [[math.log(0.5), math.log(0.25)], [math.log(0.1), math.log(0.9)]]
    b = token_batch(lp, lp, [1.0, 0.0], [[1.0, 1.0], [1.0, 1.0]])
    out = rft(b, RftLoss(), Normaliser(tokens=2, sequences=1))
    assert out.loss.item() == pytest.approx(-(math.log(0.5) + math.log(0.25)) / 2)
    assert grad_of(out.loss, b) == pytest.approx([-0.5, -0.5, 0.0, 0.0])


def test_rft_keeps_the_kl_penalty_to_the_champion() -> None:
    """β · k1 token mean: log π_θ − log π_old = log 2 on both tokens, β = 0.5 adds 0.5 log 2."""
    lp = [[math.log(0.5), math.log(0.5)]]
    old = [[math.log(0.25), math.log(0.25)]]
    b = token_batch(lp, old, [1.0], [[1.0, 1.0]], old=old)
    out = rft(b, RftLoss(kl_coef=0.5, kl_estimator="k1"), Normaliser(tokens=2, sequences=1))
    assert out.loss.item() == pytest.approx(-math.log(0.5) + 0.5 * LOG2)


def test_rft_settings_default_to_every_net_positive_verdict() -> None:
    assert (RftLoss().min_reward, RftLoss().kl_coef) == (0.0, 0.0)
    assert (DpoLoss().beta, DpoLoss().margin, DpoLoss().kl_coef) == (0.1, 0.5, 0.0)


# ---- dpo -------------------------------------------------------------------------------------------


def one_pair(lp_w: float, lp_l: float) -> TokenBatch:
    """Winner: 2 tokens, μ .25 each; loser: 1 token, μ .4 (and one padded position)."""
    return token_batch(
        [[lp_w, lp_w], [lp_l, 0.0]],
        [[math.log(0.25), math.log(0.25)], [math.log(0.4), 0.0]],
        [1.0, -1.0],
        [[1.0, 1.0], [1.0, 0.0]],
        pairs=[0, 0],
    )


def test_dpo_loss_of_one_pair_by_hand() -> None:
    """π_θ: .5, .5 for the winner, .2 for the loser. h = (2 log(.5/.25)) − log(.2/.4) = 3 log 2;
    L = −log σ(0.1 · 3 log 2) = log(1 + 2^−0.3) = 0.59457. dL/d log π = ∓β σ(−βh) = ∓0.1 · 0.44820."""
    b = one_pair(math.log(0.5), math.log(0.2))
    out = dpo(b, DpoLoss(), Normaliser(tokens=3, sequences=1))
    assert out.loss.item() == pytest.approx(0.59457, abs=1e-5)
    g = 0.1 * (1 - 1 / (1 + math.exp(-0.3 * LOG2)))
    assert g == pytest.approx(0.044820, abs=1e-6)
    assert grad_of(out.loss, b) == pytest.approx([-g, -g, g, 0.0])


def test_dpo_starts_at_log_2_when_the_policy_is_the_reference() -> None:
    """π_θ = μ: h = 0, L = log 2, and the gradient is −β/2 on the winner's tokens, +β/2 on the loser's."""
    b = one_pair(math.log(0.25), math.log(0.4))
    out = dpo(b, DpoLoss(beta=0.2), Normaliser(tokens=3, sequences=1))
    assert out.loss.item() == pytest.approx(LOG2)
    assert grad_of(out.loss, b) == pytest.approx([-0.1, -0.1, 0.1, 0.0])


def test_a_dpo_step_raises_the_winners_logprob_and_lowers_the_losers() -> None:
    """Real gradient descent on free logits (4 tokens of vocabulary 3): after a few steps the
    winner's sequence logprob is up and the loser's down, both from the reference."""
    torch.manual_seed(0)
    logits = torch.nn.Parameter(torch.randn(2, 2, 3))
    targets = torch.tensor([[0, 1], [2, 2]])
    mask = torch.ones(2, 2)

    def logprobs() -> torch.Tensor:
        return torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]  # (2, 2)

    reference = logprobs().detach()
    optimizer = torch.optim.SGD([logits], lr=1.0)
    for _ in range(5):
        b = TokenBatch(
            logprobs(), reference, reference, torch.tensor([1.0, -1.0]), mask, pairs=torch.tensor([3, 3])
        )
        optimizer.zero_grad()
        dpo(b, DpoLoss(), Normaliser(tokens=4, sequences=1)).loss.backward()
        optimizer.step()
    moved = (logprobs().detach() - reference).sum(dim=1)
    assert moved[0] > 0 > moved[1]


def test_dpo_averages_pairs_and_ignores_rows_without_a_complete_pair() -> None:
    """Two pairs (ids 4 and 9, rows interleaved), a row of no pair (−1), a lone winner of pair 7 and
    a fully masked copy of a winner (a rank's padding): the loss is the mean of the two pairs'
    losses and only their rows have a gradient."""
    w, lo, r = math.log(0.5), math.log(0.2), math.log(0.25)
    b = token_batch(
        [[w], [r], [lo], [r], [w], [w], [w]],
        [[r], [r], [r], [r], [r], [r], [r]],
        [1.0, 1.0, -1.0, -1.0, 1.0, 1.0, 1.0],
        [[1.0], [1.0], [1.0], [1.0], [1.0], [1.0], [0.0]],
        pairs=[4, 9, 4, 9, -1, 7, 9],
    )
    out = dpo(b, DpoLoss(beta=1.0), Normaliser(tokens=6, sequences=2))
    h4 = math.log(0.5 / 0.25) - math.log(0.2 / 0.25)  # log 2.5; pair 9: h = 0
    expected = (math.log1p(math.exp(-h4)) + LOG2) / 2
    assert out.loss.item() == pytest.approx(expected)
    grad = grad_of(out.loss, b)
    assert grad[4:] == [0.0, 0.0, 0.0]
    assert grad[0] < 0 < grad[2] and grad[1] == pytest.approx(-0.25) and grad[3] == pytest.approx(0.25)


def test_dpo_needs_the_pairs() -> None:
    lp = [[0.0]]
    with pytest.raises(ValueError, match="pair"):
        dpo(token_batch(lp, lp, [1.0], [[1.0]]), DpoLoss(), Normaliser(tokens=1, sequences=1))


# ---- pairing ---------------------------------------------------------------------------------------


def test_pairs_form_within_a_prompt_only() -> None:
    assert pair_indices(["a", "b"], [1.0, -1.0], 0.5) == []
    assert pair_indices(["a", "b", "a", "b"], [1.0, 1.0, -1.0, -1.0], 0.5) == [(0, 2), (1, 3)]


def test_a_pair_needs_the_margin_and_ties_never_pair() -> None:
    assert pair_indices(["a", "a"], [0.4, 0.0], 0.5) == []
    assert pair_indices(["a", "a"], [0.0, 0.5], 0.5) == [(1, 0)]  # at least the margin
    assert pair_indices(["a", "a", "a"], [0.5, 0.5, 0.5], 0.01) == []


def test_odd_counts_leave_one_episode_unpaired() -> None:
    """Three answers (up, down, down): one pair, the other rejected answer left without a partner."""
    assert pair_indices(["a", "a", "a"], [0.5, -0.5, -0.5], 0.5) == [(0, 1)]
    assert pair_indices(["a"] * 5, [0.5, -0.5, 0.5, -0.5, 0.5], 0.5) == [(2, 1), (4, 3)]


def test_pairing_finds_the_most_disjoint_pairs() -> None:
    """0, 1, 2, 3 with margin 2: best-with-worst (3–0) would leave 1 and 2, closer than 2; the
    lowest two against the highest two in order give two pairs."""
    assert pair_indices(["a"] * 4, [0.0, 1.0, 2.0, 3.0], 2.0) == [(2, 0), (3, 1)]


def test_pairing_refuses_a_margin_that_would_pair_ties() -> None:
    with pytest.raises(ValueError, match="margin"):
        pair_indices(["a", "a"], [1.0, 1.0], 0.0)


# ---- micro-batches ---------------------------------------------------------------------------------


def row(length: int, pair: int, advantage: float) -> Row:
    return Row(
        input_ids=list(range(1, length + 1)),
        prompt_len=1,
        behaviour_logprobs=[-1.0] * (length - 1),
        advantage=advantage,
        pair=pair,
    )


def test_dpo_micro_batches_never_split_a_pair() -> None:
    """Micro-batches of 3 rows and pairs of 2 (pair 2 has a winner of two segments: 3 rows): no pair
    is cut, shorter pairs first, and the normaliser counts pairs."""
    rows = [row(9, 0, 1.0), row(3, 1, 1.0), row(8, 0, -1.0), row(2, 1, -1.0)]
    rows += [row(4, 2, 1.0), row(5, 2, 1.0), row(4, 2, -1.0)]
    cut = dpo_micro_batches(rows, 3, pad_id=0)
    assert [mb.pairs.tolist() for mb in cut] == [[1, 1], [2, 2, 2], [0, 0]]
    assert [mb.advantages.tolist() for mb in cut][0] == [1.0, -1.0]
    micro, norm = batches(DpoLoss(), rows, 3, pad_id=0)
    assert len(micro) == 3 and (norm.sequences, norm.tokens) == (
        3,
        sum(len(r.behaviour_logprobs) for r in rows),
    )
    _, rl_norm = batches(RftLoss(), rows, 3, pad_id=0)
    assert rl_norm.sequences == len(rows)
