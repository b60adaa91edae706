"""The trainer's logprobs under each row's sampling (trainer/engine.py `processed_log_softmax`,
`token_logprobs`): hand-worked values, an independent reference, truncated tokens, gradients."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from schemas.events import SamplingParams
from serving import sampler
from serving.sampler import Row, Sampling, apply_penalties, collate, processed_log_softmax, token_logprobs

pytestmark = pytest.mark.unit


def one(
    logits: list[float], temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> list[float]:
    out = processed_log_softmax(
        torch.tensor([[logits]]),
        torch.tensor([temperature]),
        torch.tensor([top_k]),
        torch.tensor([top_p]),
        torch.tensor([min_p]),
    )
    return out[0, 0].tolist()


def test_top_p_by_hand() -> None:
    # softmax([2, 1, 0, -1]) = [0.644, 0.237, 0.087, 0.032]. Top-p 0.7 keeps a token while the mass
    # ranked above it is < 0.7: token 0 (0), token 1 (0.644); token 2 has 0.881 above it.
    got = one([2.0, 1.0, 0.0, -1.0], top_p=0.7)
    assert got[:2] == pytest.approx([math.log(1 / (1 + math.e**-1)), math.log(math.e**-1 / (1 + math.e**-1))])
    assert got[2:] == [-math.inf, -math.inf]


def test_temperature_and_top_k_and_min_p_by_hand() -> None:
    # T = 0.5 doubles the logits: softmax([4, 2, 0, -2]).
    z = [4.0, 2.0, 0.0, -2.0]
    lse = math.log(sum(math.exp(v) for v in z))
    assert one([2.0, 1.0, 0.0, -1.0], temperature=0.5) == pytest.approx([v - lse for v in z])
    # top-k 2 keeps the two largest; ties with the k-th are kept.
    assert one([2.0, 1.0, 1.0, -1.0], top_k=2)[3] == -math.inf
    assert all(math.isfinite(v) for v in one([2.0, 1.0, 1.0, -1.0], top_k=2)[:3])
    # min-p 0.3 drops tokens less likely than 0.3 x the most likely (0.644): 0.087 and 0.032 go.
    got = one([2.0, 1.0, 0.0, -1.0], min_p=0.3)
    assert got[2:] == [-math.inf, -math.inf] and got[0] == pytest.approx(math.log(1 / (1 + math.e**-1)))


def reference(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    """Written from the definitions, token by token, in float64."""
    z = [v / temperature for v in logits]
    keep = [True] * len(z)
    if min_p > 0:
        m = max(z)
        total = sum(math.exp(v - m) for v in z)
        keep = [math.exp(v - m) / total >= min_p * (1 / total) for v in z]
    if top_k > 0:
        kth = sorted((v for v, k in zip(z, keep, strict=True) if k), reverse=True)[min(top_k, sum(keep)) - 1]
        keep = [k and v >= kth for v, k in zip(z, keep, strict=True)]
    if top_p < 1:
        m = max(v for v, k in zip(z, keep, strict=True) if k)
        total = sum(math.exp(v - m) for v, k in zip(z, keep, strict=True) if k)
        above = 0.0
        order = sorted((i for i in range(len(z)) if keep[i]), key=lambda i: -z[i])
        for i in order:
            p = math.exp(z[i] - m) / total
            keep[i] = above < top_p
            above += p
    m = max(v for v, k in zip(z, keep, strict=True) if k)
    lse = m + math.log(sum(math.exp(v - m) for v, k in zip(z, keep, strict=True) if k))
    return [v - lse if k else -math.inf for v, k in zip(z, keep, strict=True)]


@pytest.mark.parametrize("candidates", [1024, 2])
@pytest.mark.parametrize("seed", range(6))
def test_rows_with_different_sampling_match_the_reference(
    seed: int, candidates: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With 2 candidates, every top-p nucleus reaches past them and is decided on a full sort."""
    monkeypatch.setattr(sampler, "TOP_P_CANDIDATES", candidates)
    generator = torch.Generator().manual_seed(seed)
    settings = [
        (1.0, 0, 1.0, 0.0),
        (0.7, 0, 0.9, 0.0),
        (1.3, 5, 1.0, 0.0),
        (0.5, 8, 0.8, 0.05),
        (0.9, 0, 1.0, 0.1),
    ]
    logits = torch.randn(len(settings), 3, 32, generator=generator) * 2
    out = processed_log_softmax(
        logits,
        torch.tensor([s[0] for s in settings]),
        torch.tensor([s[1] for s in settings]),
        torch.tensor([s[2] for s in settings]),
        torch.tensor([s[3] for s in settings]),
    )
    for row, (temperature, top_k, top_p, min_p) in enumerate(settings):
        for t in range(3):
            want = reference(logits[row, t].tolist(), temperature, top_k, top_p, min_p)
            got = out[row, t].tolist()
            assert [math.isinf(v) for v in got] == [math.isinf(v) for v in want], (row, t)
            assert [g for g in got if math.isfinite(g)] == pytest.approx(
                [w for w in want if math.isfinite(w)], abs=1e-5
            )


def test_greedy_segments_are_described_as_vllm_reports_them_and_never_trained() -> None:
    from schemas.sampling import untrainable_sampling

    assert Sampling.of(SamplingParams(temperature=0.0, top_p=0.5, top_k=3)) == Sampling()
    assert Sampling.of(SamplingParams(temperature=0.0, top_p=0.5, repetition_penalty=1.2)) == Sampling(
        repetition_penalty=1.2
    )  # penalties apply to greedy requests too
    assert Sampling.of(SamplingParams(temperature=0.7, top_p=0.9, top_k=-1, min_p=0.1)) == Sampling(
        0.7, 0.9, 0, 0.1
    )
    # A greedy token is the argmax, not a sample of the softmax vLLM reports: no gradient, no weight.
    assert untrainable_sampling(SamplingParams(temperature=0.0, logprobs_mode="processed")) == "greedy"
    assert untrainable_sampling(SamplingParams(temperature=0.05, logprobs_mode="processed")) == "near_greedy"
    assert untrainable_sampling(SamplingParams(temperature=0.7, top_p=0.8, logprobs_mode="processed")) is None


class Bigram(torch.nn.Module):
    """A causal LM small enough to reason about: next-token logits from the current token only,
    with the interface `token_logprobs` uses (a decoder, an output embedding, a config): the hidden
    state is the current token's one-hot vector and lm_head's weight is the transposed table."""

    def __init__(self, vocab: int = 6) -> None:
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab)
        self.head = torch.nn.Linear(vocab, vocab, bias=False)
        with torch.no_grad():
            self.head.weight.copy_(torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0, -2.0]] * vocab).T)

    def get_decoder(self) -> Any:
        vocab = self.config.vocab_size
        return lambda input_ids, attention_mask: (torch.nn.functional.one_hot(input_ids, vocab).float(),)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        return SimpleNamespace(logits=self.head(self.get_decoder()(input_ids, attention_mask)[0]))


def test_a_token_outside_the_truncation_is_impossible_and_carries_no_gradient() -> None:
    model = Bigram()
    # Completion tokens 0 (the most likely) and 4 (outside top-k 2) after a one-token prompt.
    row = Row(
        input_ids=[1, 0, 4],
        prompt_len=1,
        behaviour_logprobs=[-0.3, -0.3],
        advantage=1.0,
        sampling=Sampling(top_k=2),
    )
    mb = collate([row], pad_id=0)
    logprobs, possible, tempered = token_logprobs(model, mb)
    assert possible.tolist() == [[True, False]]
    assert logprobs[0, 0].item() == pytest.approx(math.log(1 / (1 + math.e**-1)))
    assert logprobs[0, 1].item() == 0.0
    # Untruncated, the same token has its plain softmax probability: finite, for the KL terms.
    assert tempered[0, 1].item() == pytest.approx(
        -1.0 - math.log(sum(math.exp(v) for v in (3, 2, 1, 0, -1, -2)))
    )
    (logprobs * mb.mask * possible).sum().backward()
    grad = model.head.weight.grad  # column j: the logits after token j
    assert grad is not None and torch.isfinite(grad).all()
    assert grad[:, 0].abs().sum() == 0  # the row predicting the impossible token got nothing
    assert grad[:, 1].abs().sum() > 0


def test_rows_carry_their_sampling_and_raw_logprobs_of_tempered_samples_are_left_out() -> None:
    from datetime import UTC, datetime

    from store import TrainingEpisode, TrainingSegment
    from trainer.batch import rows_of

    def segment(**sampling: Any) -> TrainingSegment:
        return TrainingSegment(
            prompt="p",
            prompt_token_ids=[1, 2],
            completion_token_ids=[3],
            completion_logprobs=[-0.5],
            trainable=True,
            role="policy",
            policy_version=1,
            sampling=SamplingParams(**sampling),
        )

    segments = [
        segment(temperature=0.7, top_p=0.9, logprobs_mode="processed"),
        segment(temperature=0.7, logprobs_mode="raw"),  # recorded before processed logprobs: not comparable
        segment(logprobs_mode="raw"),  # T = 1, nothing truncated: raw is processed
    ]
    episode = TrainingEpisode(
        episode_id="e", reward=1.0, policy_version=1, created_at=datetime.now(UTC), segments=segments
    )
    rows, left_out = rows_of([episode], [0.5])
    assert left_out == {"raw_logprobs": 1}
    assert [r.sampling for r in rows] == [Sampling(0.7, 0.9, 0, 0.0), Sampling()]


def test_penalties_by_hand_position_by_position() -> None:
    """Prompt [1, 2], completion [3, 3, 4]: vocabulary of 5, logits [1, -1, 2, 0.5, -0.5] everywhere.
    Position t predicts token t + 1; the output so far at the position predicting the k-th
    completion token is the k − 1 tokens before it."""
    row = Row(
        input_ids=[1, 2, 3, 3, 4],
        prompt_len=2,
        behaviour_logprobs=[-1.0] * 3,
        advantage=0.0,
        sampling=Sampling(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
    )
    mb = collate([row], pad_id=0)
    base = torch.tensor([1.0, -1.0, 2.0, 0.5, -0.5])
    out = apply_penalties(base.repeat(1, 4, 1), mb)[0]
    # Position 1 predicts the first completion token: nothing generated yet; prompt tokens 1, 2 get
    # the repetition penalty (−1 → −2, 2 → 1).
    assert out[1].tolist() == pytest.approx([1.0, -2.0, 1.0, 0.5, -0.5])
    # Position 2: token 3 generated once: 0.5 / 2 − 0.25 − 0.5.
    assert out[2].tolist() == pytest.approx([1.0, -2.0, 1.0, 0.25 - 0.75, -0.5])
    # Position 3: token 3 twice: 0.5 / 2 − 2 × 0.25 − 0.5.
    assert out[3].tolist() == pytest.approx([1.0, -2.0, 1.0, 0.25 - 1.0, -0.5])
    # Rows without penalties are untouched (and cost nothing).
    plain = collate([Row(input_ids=[1, 2, 3], prompt_len=2, behaviour_logprobs=[-1.0], advantage=0.0)], 0)
    logits = base.repeat(1, 2, 1)
    assert apply_penalties(logits, plain) is logits
