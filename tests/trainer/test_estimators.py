"""The learning signal under the sampling real traffic uses (issue 35): each test failed on the code
before the fix it names.

* masked positions never reach an exp: no NaN with top-k at T = 0.2 (losses);
* the trust region and the KL penalty count tokens that left the nucleus, and stay finite;
* GSPO's trust region reads the policy's token-level KL, not its sequence ratio;
* a cycle is decided on feedback, not on advantages a running baseline makes non-zero;
* π_old vs μ measured token by token before clipping (`Mismatch`);
* the selective, chunked logprobs equal a full forward pass, values and gradients.
(Greedy and near-greedy requests: tests/schemas/test_schemas_sampling.py.)
"""

from __future__ import annotations

import math
from datetime import UTC, datetime

import pytest
import torch

from schemas.settings import CispoLoss, DapoLoss, DpoLoss, DrGrpoLoss, GrpoLoss, GspoLoss, PpoLoss, RftLoss
from serving import sampler
from serving.sampler import Row, Sampling, apply_penalties, collate, processed_log_softmax, token_logprobs
from trainer.losses import LOSSES, Normaliser, TokenBatch, beyond_trust_region, cispo, gspo

pytestmark = pytest.mark.unit

CONFIGS = {
    "cispo": CispoLoss(kl_coef=0.5),
    "ppo": PpoLoss(kl_coef=0.5),
    "grpo": GrpoLoss(),
    "dapo": DapoLoss(kl_coef=0.5),
    "dr_grpo": DrGrpoLoss(kl_coef=0.5),
    "gspo": GspoLoss(kl_coef=0.5),
    "rft": RftLoss(kl_coef=0.5),
    "dpo": DpoLoss(kl_coef=0.5),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_masked_positions_never_give_nan(name: str, advantage: float) -> None:
    """Top-k at T = 0.2: logprobs of −150 are ordinary. The second token left π_θ's nucleus (its
    processed logprob is 0 and masked), so log π_θ − log π_old there is +150 and exp overflows
    float32: before the fix inf · 0 made the loss (PPO-clip, negative advantage) or the sums NaN."""
    lp = torch.tensor([[-0.1, 0.0]], requires_grad=True)
    old = torch.tensor([[-0.1, -150.0]])
    b = TokenBatch(
        logprobs=lp,
        old_logprobs=old,
        behaviour_logprobs=torch.tensor([[-0.1, 0.0]]),
        advantages=torch.tensor([advantage]),
        mask=torch.tensor([[1.0, 0.0]]),
        pairs=torch.tensor([0]),  # DPO's; the other losses ignore it
    )
    out = LOSSES[name](b, CONFIGS[name], Normaliser(tokens=2, sequences=1))
    out.loss.backward()
    assert math.isfinite(out.loss.item())
    assert lp.grad is not None and torch.isfinite(lp.grad).all()
    assert all(math.isfinite(v) for v in out.sums.values()), out.sums


def test_the_trust_region_and_the_penalty_count_a_token_that_left_the_nucleus() -> None:
    """Token 2 was sampled (π_old gave it log 0.3 after truncation) but the update pushed it out of
    π_θ's nucleus: it has no ratio and leaves the policy term, yet it is the largest move of the
    batch. The tempered logprobs (no truncation) measure it: log 0.2 → log 0.002."""
    cfg = CispoLoss(kl_coef=1.0)
    norm = Normaliser(tokens=2, sequences=1)
    tempered = torch.tensor([[math.log(0.5), math.log(0.002)]], requires_grad=True)
    b = TokenBatch(
        logprobs=torch.tensor([[math.log(0.6), 0.0]], requires_grad=True),
        old_logprobs=torch.tensor([[math.log(0.6), math.log(0.3)]]),
        behaviour_logprobs=torch.tensor([[math.log(0.6), math.log(0.3)]]),
        advantages=torch.tensor([1.0]),
        mask=torch.tensor([[1.0, 0.0]]),  # token 2 is impossible under π_θ
        tempered=tempered,
        old_tempered=torch.tensor([[math.log(0.5), math.log(0.2)]]),
        scored=torch.tensor([[1.0, 1.0]]),
    )
    out = cispo(b, cfg, norm)
    r = 0.002 / 0.2  # π_θ/π_old of the token that left
    assert out.sums["kl_tokens"] == 2.0
    assert out.sums["kl_k3"] == pytest.approx(r - 1 - math.log(r))  # token 1 did not move: 0
    assert beyond_trust_region(out.sums, max_kl=1.0)
    out.loss.backward()
    assert tempered.grad is not None and tempered.grad[0, 1] != 0  # the penalty pulls it back
    assert all(math.isfinite(v) for v in out.sums.values())


def test_gspo_trust_region_reads_the_policys_token_kl() -> None:
    """Two tokens moved by +0.5 and −0.5 nats: the sequence ratio s = 1, but the policy moved. Before
    the fix GSPO's kl_k3 mixed s with token log-ratios; now it is CISPO's on the same batch."""
    lp = [[math.log(0.5) + 0.5, math.log(0.5) - 0.5]]

    def make() -> TokenBatch:
        return TokenBatch(
            logprobs=torch.tensor(lp, requires_grad=True),
            old_logprobs=torch.tensor([[math.log(0.5)] * 2]),
            behaviour_logprobs=torch.tensor([[math.log(0.5)] * 2]),
            advantages=torch.tensor([1.0]),
            mask=torch.ones(1, 2),
        )

    norm = Normaliser(tokens=2, sequences=1)
    g, c = gspo(make(), GspoLoss(), norm), cispo(make(), CispoLoss(), norm)
    expected = sum(math.exp(d) - 1 - d for d in (0.5, -0.5))
    assert g.sums["kl_k3"] == pytest.approx(expected) == c.sums["kl_k3"]
    assert g.sums["ratio"] == pytest.approx(2.0)  # s = 1 on both tokens: the loss's own ratio
    assert beyond_trust_region(g.sums, max_kl=0.1)


def test_a_cycle_is_decided_on_feedback_not_on_advantages() -> None:
    """41 episodes without any feedback (reward 0) against a running baseline of 0.3: every
    advantage is −0.3, so the old guard (rows with a non-zero advantage) trained a cycle on them."""
    from store import TrainingEpisode
    from trainer.advantages import BaselineState, compute_advantages
    from trainer.batch import carries_signal, signal_count

    def episode(i: int, **kw: object) -> TrainingEpisode:
        return TrainingEpisode(
            episode_id=f"e{i}", reward=0.0, policy_version=1, created_at=datetime.now(UTC), segments=[], **kw
        )  # type: ignore[arg-type]

    silent = [episode(i, no_feedback=True, components={"no_feedback": 0.0}) for i in range(41)]
    adv, _ = compute_advantages([f"p{i}" for i in range(41)], [0.0] * 41, BaselineState(global_mean=0.3))
    assert all(abs(a) > 0.1 for a in adv.values)  # what the old guard counted
    assert signal_count(silent) == 0
    judged = episode(99, no_feedback=True, components={"no_feedback": 0.0, "judge": 0.25})
    answered = episode(98, components={"rejected": -0.25})
    assert carries_signal(judged) and carries_signal(answered)
    assert signal_count([*silent, judged, answered]) == 2


def test_mismatch_reports_the_raw_ratio_distribution() -> None:
    from trainer.steps import Mismatch, StepMetrics, mlflow_metrics

    m = Mismatch()
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5, 0.5]]))
    mu = torch.log(
        torch.tensor([[0.5, 0.25, 0.5 / 1.05, 0.5 / 0.85, 0.1]])
    )  # ratios 1, 2, 1.05, 0.85, (masked)
    m.add(old, mu, torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]]))
    got = m.metrics()
    assert got["tokens"] == 4 and got["outside_0.9_1.1"] == pytest.approx(0.5)
    assert got["ratio_max"] == pytest.approx(2.0) and got["ratio_min"] == pytest.approx(0.85)
    assert got["bin_0.99_1.01"] == 0.25 and got["bin_2_inf"] == 0.25 and got["bin_0.8_0.9"] == 0.25
    assert sum(v for k, v in got.items() if k.startswith("bin_")) == pytest.approx(1.0)
    flat = mlflow_metrics(
        StepMetrics(
            step=0,
            loss=0,
            mean_ratio=1,
            clip_fraction=0,
            kl_k1=0,
            is_weight=1,
            grad_norm=None,
            mean_advantage=0,
            tokens=4,
            mismatch=got,
        )
    )
    assert flat["mismatch_outside_0.9_1.1"] == pytest.approx(0.5) and "mismatch" not in flat


# ---- selective, chunked logprobs ------------------------------------------------------------------


def tiny(arch: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(
        vocab_size=97,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=96,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True))
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False))
    with torch.no_grad():  # sharp logits, so that truncation bites
        model.get_output_embeddings().weight.mul_(40)
    return model


def full_forward(model: torch.nn.Module, batch: sampler.MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: every position's (B, L−1, V) logits, penalties, then vLLM's processing."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    penalised = apply_penalties(logits, batch)
    logp = processed_log_softmax(penalised, batch.temperature, batch.top_k, batch.top_p, batch.min_p)
    tempered = torch.log_softmax(penalised / batch.temperature[:, None, None], dim=-1)
    chosen = logp.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1) * batch.mask
    return chosen, tempered.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1) * batch.mask


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_chunked_logprobs_equal_a_full_forward(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampler, "CHUNK_ELEMENTS", 97 * 3)  # three positions per chunk: many chunks
    model = tiny(arch)
    g = torch.Generator().manual_seed(1)
    samplings = [
        Sampling(),
        Sampling(temperature=0.2, top_k=3),
        Sampling(temperature=0.7, top_p=0.8, top_k=20),
        Sampling(
            temperature=0.9, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2
        ),
    ]
    rows = []
    for i, s in enumerate(samplings):
        ids = torch.randint(3, 97, (6 + 3 * i,), generator=g).tolist()
        rows.append(
            Row(
                input_ids=ids,
                prompt_len=3 + i,
                behaviour_logprobs=[-1.0] * (3 + 2 * i),
                advantage=1.0,
                sampling=s,
            )
        )
    batch = collate(rows, pad_id=0)
    want, want_tempered = full_forward(model, batch)
    got = token_logprobs(model, batch)
    possible = got.possible & (batch.mask > 0)
    assert bool((~got.possible & (batch.mask > 0)).any()), "the case should have tokens outside the nucleus"
    assert torch.allclose(got.logprobs[possible], want[possible], atol=1e-5)
    assert torch.isinf(want[~got.possible & (batch.mask > 0)]).all()
    assert torch.allclose(got.tempered * batch.mask, want_tempered, atol=1e-5)
    # Gradients: the same through both paths (impossible tokens masked out of both).
    (got.logprobs * possible).sum().backward()
    chunked = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    ref, _ = full_forward(model, batch)
    torch.where(possible, ref, torch.zeros_like(ref)).sum().backward()
    reference = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert len(chunked) == len(reference)
    for a, b in zip(chunked, reference, strict=True):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-3)


def test_a_fully_masked_micro_batch_still_reaches_every_parameter() -> None:
    """A rank's padding micro-batch (trainer/steps.py rank_batches) has no scored token; its loss
    is 0 but must still be a function of the weights (DeepSpeed's backward)."""
    model = tiny("qwen2")
    row = Row(input_ids=[5, 6, 7], prompt_len=1, behaviour_logprobs=[-1.0, -1.0], advantage=1.0)
    batch = collate([row], pad_id=0)
    batch = sampler.replace(batch, mask=torch.zeros_like(batch.mask))
    got = token_logprobs(model, batch)
    (got.logprobs * batch.mask).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_a_family_whose_forward_rescales_lm_head_is_refused_not_mistrained() -> None:
    """A forward that transforms lm_head's output in a way `_final_logits` does not know (here a
    multiplier on the model, like Falcon-H1's lm_head_multiplier) would make every logprob, and so
    every ratio, silently wrong: the first call compares with the model's own forward and refuses."""
    from serving.errors import UnsupportedModel

    model = tiny("llama")
    original = type(model).forward

    def scaled(self: torch.nn.Module, *args: object, **kwargs: object) -> object:
        out = original(self, *args, **kwargs)
        out.logits = out.logits * 4.0
        return out

    row = Row(input_ids=[5, 6, 7, 8], prompt_len=2, behaviour_logprobs=[-1.0, -1.0], advantage=1.0)
    batch = collate([row], pad_id=0)
    token_logprobs(model, batch)  # the plain family passes, once
    other = tiny("llama")
    other.forward = scaled.__get__(other)  # type: ignore[method-assign]
    with pytest.raises(UnsupportedModel, match="LlamaForCausalLM"):
        token_logprobs(other, batch)


def vllm_top_k_top_p(logits: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """vLLM's apply_top_k_top_p for one row, as written there: ascending sort, top-k keeps every
    logit ≥ the k-th largest, top-p drops while the cumulative probability stays ≤ 1 − p (never
    the last), then log-softmax."""
    ordered, index = logits.sort(descending=False)
    if k > 0:
        ordered = ordered.masked_fill(ordered < ordered[-k], float("-inf"))
    cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - p
    drop[-1] = False
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, index, ordered).log_softmax(dim=-1)


@pytest.mark.parametrize(("k", "p"), [(0, 0.5), (0, 0.9), (50, 0.8), (20, 0.95)])
def test_ties_at_the_nucleus_edge_count_as_vllm_keeps_them(k: int, p: float) -> None:
    """bf16 logits tie often; of tokens tied at the top-p edge vLLM keeps only as many as the
    cumulative mass allows, so its normaliser is smaller than one over every tied token."""
    g = torch.Generator().manual_seed(k + int(p * 100))
    logits = (torch.randn(6, 4000, generator=g) * 2).bfloat16().float()  # (rows, V), many exact ties
    got = processed_log_softmax(
        logits, torch.ones(6), torch.full((6,), k), torch.full((6,), p), torch.zeros(6)
    )
    ties = 0
    for row in range(6):
        want = vllm_top_k_top_p(logits[row], k, p)
        kept = torch.isfinite(want)
        assert torch.isfinite(got[row][kept]).all()
        assert torch.allclose(got[row][kept], want[kept], atol=1e-5), (
            row,
            (got[row][kept] - want[kept]).abs().max(),
        )
        ties += int(torch.isfinite(got[row]).sum() - kept.sum())  # tied tokens vLLM happened to drop
    assert ties > 0, "the case should have ties at the edge"


def test_feedback_on_greedy_episodes_does_not_carry_a_batch() -> None:
    """Greedy requests are never trained on: their feedback must not count as the batch's signal
    (the cycle would fail with no rows, its episodes released, again and again)."""
    from schemas.events import SamplingParams
    from store import TrainingEpisode, TrainingSegment
    from trainer.batch import has_rows, signal_count

    def episode(i: int, temperature: float, feedback: bool) -> TrainingEpisode:
        seg = TrainingSegment(
            prompt="p",
            prompt_token_ids=[1, 2],
            completion_token_ids=[3],
            completion_logprobs=[-0.5],
            trainable=True,
            role="policy",
            policy_version=1,
            sampling=SamplingParams(temperature=temperature, logprobs_mode="processed"),
        )
        return TrainingEpisode(
            episode_id=f"e{i}",
            reward=1.0 if feedback else 0.0,
            policy_version=1,
            created_at=datetime.now(UTC),
            segments=[seg],
            no_feedback=not feedback,
            components={"accepted": 1.0} if feedback else {"no_feedback": 0.0},
        )

    batch = [episode(i, 0.0, True) for i in range(10)] + [episode(10 + i, 0.7, False) for i in range(10)]
    learning = [e for e in batch if has_rows(e)]
    assert len(learning) == 10 and signal_count(learning) == 0  # the sampled half is silent: skip
    assert signal_count(batch) == 10  # what counting every episode would have said
