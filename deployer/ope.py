"""Log-probabilities of logged episodes under a registered version: the eval gate's off-policy input.

For each held-out episode (store `select_heldout`), the sequence log-probability of what its
trainable segments generated, under the version's weights and each segment's own sampling
(`serving.sampler.token_logprobs`: penalties, temperature, truncation, as vLLM applied them when the
behaviour logprobs were recorded). The two are then directly comparable: the importance weight of
an episode is exp(log π − log μ) (evals/stats.py `off_policy`).

Computed with transformers in float32 (a GPU when the process has one), never on a serving or
staging vLLM server: a LoRA server must not be asked for prompt logprobs (docs/platform.md), and
vLLM's prompt logprobs are raw, not processed by each request's sampling. Segments the recorded
logprobs cannot be compared on (misaligned, or raw logprobs under non-neutral sampling:
schemas/sampling.py `trainer_can_reproduce`) make their episode unusable; the gate counts those.
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schemas.events import SamplingParams
from schemas.sampling import trainer_can_reproduce
from store import TrainingEpisode


@dataclass(frozen=True)
class Weights:
    """A version's weights as the off-policy estimate loads them: full weights at `path`, or a LoRA
    adapter at `path` on the base model at `base`."""

    path: Path
    base: Path | None = None


@dataclass(frozen=True)
class Logged:
    """One usable held-out episode: reward, behaviour sequence logprob, tokens, and its rows' inputs."""

    episode_id: str
    reward: float
    no_feedback: bool
    behaviour: float  # Σ log μ over its trainable segments' tokens
    tokens: int
    segments: tuple[
        tuple[tuple[int, ...], tuple[int, ...], tuple[float, ...], object], ...
    ]  # ids, ids, μ, Sampling
    # The reward's components (schemas/rewards.py): where the gate's ope_primary reads the spec's primary term.
    components: dict[str, float] = field(default_factory=dict)
    # The direct method's inputs (docs/gate.md, Suites: ope): the prompt as logged and how it was
    # sampled, for an episode with one trainable segment only (None for one with several).
    prompt: str | None = None
    sampling: SamplingParams | None = None


def usable(episodes: list[TrainingEpisode]) -> tuple[list[Logged], int]:
    """The episodes whose every trainable segment can be rescored, and how many could not."""
    from serving.sampler import Sampling

    kept: list[Logged] = []
    skipped = 0
    for episode in episodes:
        trainable = [s for s in episode.segments if s.trainable]
        if not trainable or any(
            not s.completion_token_ids
            or not s.prompt_token_ids
            or len(s.completion_logprobs) != len(s.completion_token_ids)
            or not all(math.isfinite(lp) for lp in s.completion_logprobs)
            or not trainer_can_reproduce(s.sampling)
            for s in trainable
        ):
            skipped += 1
            continue
        kept.append(
            Logged(
                episode_id=episode.episode_id,
                reward=episode.reward,
                no_feedback=episode.no_feedback,
                behaviour=sum(sum(s.completion_logprobs) for s in trainable),
                tokens=sum(len(s.completion_token_ids) for s in trainable),
                segments=tuple(
                    (
                        tuple(s.prompt_token_ids),
                        tuple(s.completion_token_ids),
                        tuple(s.completion_logprobs),
                        Sampling.of(s.sampling),
                    )
                    for s in trainable
                ),
                components=dict(episode.components),
                prompt=trainable[0].prompt if len(trainable) == 1 else None,
                sampling=trainable[0].sampling if len(trainable) == 1 else None,
            )
        )
    return kept, skipped


def completion_texts(weights: Weights, logged: list[Logged]) -> list[tuple[str, str]]:
    """(text, finish_reason) of each single-segment episode's logged completion ("" and "" for one with
    several), for the doubly robust estimate's reward model. The store keeps token ids, not text: they
    are decoded with the tokenizer of `weights` (its base's for an adapter), special tokens skipped as
    vLLM's detokenizer does. The finish reason is inferred: "length" when the completion used its
    request's whole `max_tokens`, else "stop"."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(weights.base or weights.path))
    out: list[tuple[str, str]] = []
    for episode in logged:
        if episode.prompt is None or episode.sampling is None:
            out.append(("", ""))
            continue
        ids = episode.segments[0][1]
        limit = episode.sampling.max_tokens
        finish = "length" if limit is not None and len(ids) >= limit else "stop"
        out.append((str(tokenizer.decode(list(ids), skip_special_tokens=True)), finish))
    return out


@dataclass(frozen=True)
class Scored:
    """Σ log π over each logged episode's trainable tokens under one version's weights."""

    processed: list[
        float
    ]  # under each segment's sampling, as vLLM drew: −inf where a token is outside the nucleus
    tempered: list[float]  # penalties and temperature, no truncation: always finite (for KL estimates)


def sequence_logprobs(weights: Weights, logged: list[Logged], micro_batch: int = 16) -> Scored:
    """Each logged episode's sequence logprobs under `weights` (`Scored`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from serving.sampler import Row, Sampling, collate, token_logprobs

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model: Any
    if weights.base is None:
        model = AutoModelForCausalLM.from_pretrained(str(weights.path), dtype=torch.float32)
    else:
        from peft import PeftModel

        model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(str(weights.base), dtype=torch.float32), str(weights.path)
        )
    model.to(device).eval()
    pad_id = int(
        getattr(model.config, "pad_token_id", None) or getattr(model.config, "eos_token_id", None) or 0
    )
    rows: list[tuple[int, Row]] = []
    for index, episode in enumerate(logged):
        for prompt_ids, completion_ids, behaviour, sampling in episode.segments:
            assert isinstance(sampling, Sampling)
            rows.append(
                (
                    index,
                    Row(
                        input_ids=[*prompt_ids, *completion_ids],
                        prompt_len=len(prompt_ids),
                        behaviour_logprobs=list(behaviour),
                        advantage=0.0,
                        sampling=sampling,
                    ),
                )
            )
    totals = [0.0] * len(logged)
    tempered = [0.0] * len(logged)
    rows.sort(key=lambda item: len(item[1].input_ids))  # similar lengths together: less padding
    try:
        with torch.no_grad():
            for start in range(0, len(rows), micro_batch):
                chunk = rows[start : start + micro_batch]
                batch = collate([row for _, row in chunk], pad_id).to(device)
                logp, possible, temp = token_logprobs(model, batch)
                impossible = ((~possible) & (batch.mask > 0)).any(dim=1)
                sums = (logp * batch.mask).sum(dim=1)
                temp_sums = (temp * batch.mask).sum(dim=1)
                for (index, _), total, t, bad in zip(
                    chunk, sums.tolist(), temp_sums.tolist(), impossible.tolist(), strict=True
                ):
                    totals[index] = -math.inf if bad or totals[index] == -math.inf else totals[index] + total
                    tempered[index] += t
    finally:
        del model
        gc.collect()
    return Scored(totals, tempered)


def challenger_logprobs(challenger: Scored, champion: Scored) -> list[float]:
    """The challenger's sequence logprobs for its importance weights: the champion's processed
    logprob plus the challenger's change in tempered logprobs, log π₀(y) + log π̃₁(y) − log π̃₀(y)
    (π̃: temperature and penalties, no truncation).

    Without truncation this is exactly the challenger's own processed logprob. Under top-p/top-k
    the exact weight π₁(y)/μ(y) is 0 whenever one logged token falls outside the challenger's
    nucleus (3 tokens of 2,048 at a change of 0.0005 nats per token), and the tokens the
    challenger's nucleus gained were never logged: the comparison stops being paired, for the
    challenger only. This estimate keeps the champion's nucleus and tilts it by the challenger's
    change, continuous in the weights (docs/gate.md, Off-policy evaluation under truncated
    sampling). An episode the champion itself cannot produce stays −inf."""
    return [
        p0 + (t1 - t0) if math.isfinite(p0) else -math.inf
        for p0, t0, t1 in zip(champion.processed, champion.tempered, challenger.tempered, strict=True)
    ]
