"""vLLM's sampler, reproduced in torch: the log-probabilities of tokens as vLLM drew them.

A *row* is one generated segment: prompt + completion token ids, the behaviour logprobs vLLM
reported for the completion tokens, an advantage (the trainer's; 0 where unused) and the sampling
parameters it was drawn with. `token_logprobs` gives log π(token) of a model under each row's
sampling (penalties, temperature, min-p, top-k, top-p, as vLLM applies them), so the result
compares with the behaviour logprobs: the trainer's π_old and π_θ (trainer/engine.py, losses) and
the eval gate's off-policy estimates (deployer/ope.py) use it. Imported only by processes that
load torch (never by the gateway).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from schemas.events import SamplingParams
from schemas.sampling import is_greedy


@dataclass(frozen=True)
class Sampling:
    """What vLLM did to the logits before drawing a segment's tokens (schemas/sampling.py): the
    trainer applies the same to compute π_old and π_θ, so they compare with the behaviour logprobs.
    Greedy segments are recorded as temperature 1 without truncation, as vLLM reports them."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @classmethod
    def of(cls, params: SamplingParams) -> Sampling:
        penalties = cls(repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
                        frequency_penalty=params.frequency_penalty)  # fmt: skip
        if is_greedy(params):  # vLLM applies the penalties to greedy requests too, nothing else
            return penalties
        return replace(penalties, temperature=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0),
                       min_p=params.min_p)  # fmt: skip

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True)
class Row:
    """One trainable segment as the trainer feeds it to the model."""

    input_ids: list[int]  # prompt + completion
    prompt_len: int
    behaviour_logprobs: list[float]  # one per completion token
    advantage: float
    sampling: Sampling = Sampling()


@dataclass(frozen=True)
class MicroBatch:
    """Padded tensors of a few rows, aligned to next-token targets (position t predicts t + 1)."""

    input_ids: torch.Tensor  # (B, L) right-padded
    attention_mask: torch.Tensor  # (B, L)
    targets: torch.Tensor  # (B, L−1) input_ids[:, 1:]
    mask: torch.Tensor  # (B, L−1) 1.0 on completion-token targets
    behaviour_logprobs: torch.Tensor  # (B, L−1) log μ at completion targets, 0 elsewhere
    advantages: torch.Tensor  # (B,)
    temperature: torch.Tensor  # (B,) per row, as `Sampling`
    top_p: torch.Tensor  # (B,)
    top_k: torch.Tensor  # (B,) long, 0 = none
    min_p: torch.Tensor  # (B,)
    repetition_penalty: torch.Tensor  # (B,)
    presence_penalty: torch.Tensor  # (B,)
    frequency_penalty: torch.Tensor  # (B,)
    prompt_len: torch.Tensor  # (B,) long

    @property
    def tokens(self) -> int:
        return int(self.mask.sum())

    def to(self, device: Any) -> MicroBatch:
        """The same micro-batch on `device` (the engine's)."""
        return MicroBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def collate(rows: list[Row], pad_id: int) -> MicroBatch:
    """Right-pad rows into one micro-batch."""
    width = max(len(r.input_ids) for r in rows)
    n = len(rows)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width - 1))
    behaviour = torch.zeros((n, width - 1))
    for i, row in enumerate(rows):
        length = len(row.input_ids)
        completion = length - row.prompt_len
        if row.prompt_len < 1 or completion != len(row.behaviour_logprobs):
            raise ValueError(f"row {i}: prompt {row.prompt_len}, completion {completion}, "
                             f"{len(row.behaviour_logprobs)} behaviour logprobs")
        input_ids[i, :length] = torch.tensor(row.input_ids)
        attention[i, :length] = 1
        # Completion token k sits at position prompt_len + k and is predicted from position − 1.
        start = row.prompt_len - 1
        mask[i, start : start + completion] = 1.0
        behaviour[i, start : start + completion] = torch.tensor(row.behaviour_logprobs)
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attention,
        targets=input_ids[:, 1:],
        mask=mask,
        behaviour_logprobs=behaviour,
        advantages=torch.tensor([r.advantage for r in rows], dtype=torch.float32),
        temperature=torch.tensor([r.sampling.temperature for r in rows], dtype=torch.float32),
        top_p=torch.tensor([r.sampling.top_p for r in rows], dtype=torch.float32),
        top_k=torch.tensor([r.sampling.top_k for r in rows], dtype=torch.long),
        min_p=torch.tensor([r.sampling.min_p for r in rows], dtype=torch.float32),
        repetition_penalty=torch.tensor([r.sampling.repetition_penalty for r in rows], dtype=torch.float32),
        presence_penalty=torch.tensor([r.sampling.presence_penalty for r in rows], dtype=torch.float32),
        frequency_penalty=torch.tensor([r.sampling.frequency_penalty for r in rows], dtype=torch.float32),
        prompt_len=torch.tensor([r.prompt_len for r in rows], dtype=torch.long),
    )


def micro_batches(rows: list[Row], size: int, pad_id: int) -> list[MicroBatch]:
    """Rows sorted by length (less padding) and cut into micro-batches of at most ``size``."""
    ordered = sorted(rows, key=lambda r: len(r.input_ids))
    return [collate(ordered[i : i + size], pad_id) for i in range(0, len(ordered), size)]


def apply_penalties(logits: torch.Tensor, batch: MicroBatch) -> torch.Tensor:
    """(B, L−1, V) logits with each row's penalties applied as vLLM applies them before sampling
    (vllm/model_executor/layers/utils.py `apply_penalties`): position t predicts token t + 1, and
    the tokens generated so far are the completion tokens at positions prompt_len..t. Repetition
    penalty p on every token seen in the prompt or generated so far (a positive logit divided by
    p, a negative one multiplied); then minus frequency x its count in the output so far and minus
    presence where that count is > 0. Rows without penalties are left as they are; the scaling
    factors are taken on detached values, the gradient flows through the logits."""
    if not bool((batch.repetition_penalty != 1).any() | (batch.presence_penalty != 0).any()
                | (batch.frequency_penalty != 0).any()):  # fmt: skip
        return logits
    rows, positions, vocab = logits.shape
    with torch.no_grad():
        index = torch.arange(batch.input_ids.shape[1], device=logits.device)[None, :]  # (1, L)
        generated = (index >= batch.prompt_len[:, None]) & (batch.attention_mask > 0)  # (B, L)
        one_hot = logits.new_zeros(rows, batch.input_ids.shape[1], vocab)
        one_hot.scatter_(-1, batch.input_ids.unsqueeze(-1).clamp(max=vocab - 1), generated.unsqueeze(-1).float())
        counts = one_hot.cumsum(dim=1)[:, :positions]  # (B, L−1, V) output tokens up to position t
        prompt = one_hot.new_zeros(rows, vocab)
        in_prompt = (index < batch.prompt_len[:, None]) & (batch.attention_mask > 0)
        prompt.scatter_add_(-1, batch.input_ids.clamp(max=vocab - 1), in_prompt.float())
        seen = (counts > 0) | (prompt[:, None, :] > 0)  # (B, L−1, V)
        p = batch.repetition_penalty[:, None, None]
        scale = torch.where(seen, torch.where(logits > 0, 1 / p, p), torch.ones_like(logits))
        shift = batch.frequency_penalty[:, None, None] * counts + batch.presence_penalty[:, None, None] * (counts > 0)
    return logits * scale - shift


def processed_log_softmax(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Log-probabilities of (B, T, V) logits as vLLM's sampler draws from them, per row: divided by
    the temperature, then min-p, top-k and top-p truncation (a truncated token gets −inf), then
    log-softmax. The same steps and tie rules as vllm/v1/sample (sampler.py, topk_topp_sampler.py,
    logits_processor/builtin.py MinP): top-k keeps every logit ≥ the k-th largest; top-p drops the
    least likely tokens while their cumulative probability stays ≤ 1 − p, always keeping the
    most likely. The truncation masks are taken on detached values; the gradient flows through
    the logits of the kept tokens."""
    logits = logits.float() / temperature[:, None, None]
    vocab = logits.shape[-1]
    if bool((min_p > 0).any()):
        with torch.no_grad():
            probs = logits.softmax(dim=-1)
            drop = probs < probs.amax(dim=-1, keepdim=True) * min_p[:, None, None]
        logits = logits.masked_fill(drop, float("-inf"))
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        with torch.no_grad():
            ascending, order = logits.sort(dim=-1)
            k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)  # (B,)
            kth = ascending.gather(-1, (vocab - k)[:, None, None].expand(*ascending.shape[:2], 1))
            drop = ascending < kth
            if bool((top_p < 1).any()):
                cumulative = ascending.masked_fill(drop, float("-inf")).softmax(dim=-1).cumsum(dim=-1)
                tail = cumulative <= (1 - top_p)[:, None, None]
                tail[..., -1] = False  # the most likely token always stays
                drop |= tail
            drop = torch.zeros_like(drop).scatter(-1, order, drop)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def token_logprobs(model: Any, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π_θ(target_t | tokens ≤ t) under each row's sampling (`apply_penalties`, then
    `processed_log_softmax`), and
    where that is possible), both (B, L−1). A target the row's truncation excludes has
    probability 0: its logprob is returned as 0 with `possible` False, so that it can be masked
    out of a loss without producing NaN. The logprobs carry the gradient."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # (B, L, V)
    penalised = apply_penalties(logits[:, :-1].float(), batch)
    logp = processed_log_softmax(penalised, batch.temperature, batch.top_k, batch.top_p, batch.min_p)
    chosen = logp.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)  # (B, L−1)
    possible = torch.isfinite(chosen.detach())
    return torch.where(possible, chosen, torch.zeros_like(chosen)), possible
