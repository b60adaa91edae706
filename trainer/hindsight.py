"""Hindsight distillation from written corrections (docs/algorithms.md, Hindsight distillation).

A user who corrects an answer ("the answer is 12") says what the model should have written. The
reward spec's ``hindsight`` term (schemas/rewards.py `HindsightTerm`) turns that text into a per-token
advantage on the model's *own* completion, as OpenClaw-RL's hindsight-hint on-policy distillation
does (https://github.com/Gen-Verse/OpenClaw-RL; on-policy distillation: Agarwal et al., GKD,
https://arxiv.org/abs/2306.13649):

* teacher: the policy this cycle trains, at the start of the cycle (the champion's weights, no
  gradient), given the hindsight prompt: the segment's prompt tokens, then the hint (the spec's
  template with the correction, tokenised), then the student's sampled completion tokens;
* student: the same weights on the same completion *without* the hint, in the same no-grad pass.
  Not the behaviour logprobs vLLM recorded: those differ from the trainer's by kernel numerics and
  bf16, and by policy lag when ``trainer.max_policy_lag`` > 0, and that difference would be
  distilled as if the hint had caused it; with both sides from one model and one code path the gap
  is the hint's alone (and 0 on a token the hint does not change);
* per completion token, term = weight · clip(log π_teacher − log π_student, ±clip), added to the
  row's RL advantage (`serving.sampler.Row.token_advantages`); rows of episodes without a
  correction keep their one advantage.

Both log-probabilities are the *tempered* ones under the row's own sampling (penalties and
temperature, no truncation; `serving.sampler.TokenLogprobs`): finite for every token, so a token the
hint pushes out of the nucleus gets a large negative gap (clipped), not −inf.

The hint goes after the prompt's tokens, before the completion. For a chat request the prompt ends
with the assistant turn's header, so the hint sits at the start of the assistant's turn, not in the
user's: re-rendering the chat template would need the request's messages, which the store does not
keep (only the rendered prompt). The default template reads as an aside there.

Which corrections: every text of the episode (`store.TrainingEpisode.corrections`: ``correction``
and an ``edited`` that carries the edited text) whose request id is the segment's, oldest first, one
per line. Called by trainer/cycle.py after the objective chose its rows and before the engine starts,
in the worker process: the rows are built there, before a multi-rank cycle shards them
(trainer/ranks.py), so the ranks see the per-token advantages inside their micro-batches.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from schemas.rewards import HindsightTerm
from schemas.settings import DpoLoss, TrainerSettings
from serving.sampler import Row
from store import TrainingEpisode
from trainer.batch import rows_of

log = logging.getLogger(__name__)

Source = tuple[str, int]  # (episode id, segment index): `Row.source`
# Rows in, the tempered logprobs of each row's completion tokens out (`Teacher.score`).
Scorer = Callable[[list[Row]], list[list[float]]]


@dataclass(frozen=True)
class Distilled:
    """The rows with the hindsight term in their token advantages, and what was distilled: counts
    and the mean teacher−student gap, logged with the cycle (`CycleResult.hindsight`)."""

    rows: list[Row]
    metrics: dict[str, float] = field(default_factory=dict)


def hints(term: HindsightTerm, episodes: Sequence[TrainingEpisode]) -> dict[Source, str]:
    """The hint of every segment a correction names, by (episode id, segment index)."""
    out: dict[Source, str] = {}
    for episode in episodes:
        for index, seg in enumerate(episode.segments):
            texts = [c.text for c in episode.corrections if c.request_id == seg.request_id and c.text]
            if texts and seg.request_id:
                out[(episode.episode_id, index)] = term.hint(texts)
    return out


def teacher_row(row: Row, hint_ids: Sequence[int]) -> Row:
    """The teacher's view of `row`: its prompt, the hint's tokens, then the same completion tokens
    (scored, never trained: the loss sees `row` only)."""
    prompt, completion = row.input_ids[: row.prompt_len], row.input_ids[row.prompt_len :]
    return Row(
        input_ids=[*prompt, *hint_ids, *completion],
        prompt_len=row.prompt_len + len(hint_ids),
        behaviour_logprobs=list(row.behaviour_logprobs),
        advantage=0.0,
        sampling=row.sampling,
    )


def token_terms(
    teacher: Sequence[float], student: Sequence[float], weight: float, clip: float
) -> tuple[tuple[float, ...], float]:
    """Per token, weight · clip(teacher − student, ±clip), and the sum of the unclipped gaps."""
    gaps = [t - s for t, s in zip(teacher, student, strict=True)]
    return tuple(weight * min(max(g, -clip), clip) for g in gaps), sum(gaps)


def distil(
    term: HindsightTerm,
    episodes: Sequence[TrainingEpisode],
    rows: list[Row],
    *,
    tokenize: Callable[[str], list[int]],
    score: Scorer,
    add_missing: bool,
) -> Distilled:
    """`rows` with the hindsight term added to the token advantages of every row a correction names.

    `add_missing`: a corrected segment whose row the objective left out (rft keeps only accepted
    episodes) joins the batch with RL advantage 0, so the term alone trains it; the policy-gradient
    losses have every row already. `score` gives the teacher's and the student's logprobs (`Teacher`)."""
    wanted = hints(term, episodes)
    if not wanted or term.weight == 0.0:  # at weight 0 the term is 0 on every token: nothing to score
        return Distilled(rows, _empty())
    rows = list(rows)
    present = {row.source for row in rows}
    added = 0
    if add_missing:
        by_id = {e.episode_id: e for e in episodes}
        for episode_id in sorted({source[0] for source in wanted if source not in present}):
            extra = [r for r in rows_of([by_id[episode_id]], [0.0])[0] if r.source in wanted]
            extra = [r for r in extra if r.source not in present]
            rows += extra
            added += len(extra)
    chosen = [i for i, row in enumerate(rows) if row.source in wanted]
    if not chosen:
        return Distilled(rows, _empty())
    hint_ids = {source: tokenize(text) for source, text in wanted.items()}
    scored = score(
        [rows[i] for i in chosen] + [teacher_row(rows[i], hint_ids[_source(rows[i])]) for i in chosen]
    )
    student, teacher = scored[: len(chosen)], scored[len(chosen) :]
    gap_sum, tokens = 0.0, 0
    for i, t, s in zip(chosen, teacher, student, strict=True):
        terms, gaps = token_terms(t, s, term.weight, term.clip)
        row = rows[i]
        base = row.token_advantages or (row.advantage,) * len(terms)
        rows[i] = replace(row, token_advantages=tuple(a + d for a, d in zip(base, terms, strict=True)))
        gap_sum, tokens = gap_sum + gaps, tokens + len(terms)
    return Distilled(
        rows,
        {
            "hindsight_episodes": float(len({_source(rows[i])[0] for i in chosen})),
            "hindsight_rows": float(len(chosen)),
            "hindsight_added_rows": float(added),
            "hindsight_tokens": float(tokens),
            "hindsight_gap_mean": gap_sum / max(tokens, 1),
        },
    )


def _source(row: Row) -> Source:
    assert row.source is not None  # every row `distil` picks has one
    return row.source


def _empty() -> dict[str, float]:
    return {"hindsight_episodes": 0.0}


class Teacher:
    """The champion's weights, without gradient, scoring rows for `distil` (`Scorer`): loaded once
    per cycle that has a correction to distil, freed (`close`) before the engine loads the same
    weights to train, so the two copies are never in memory together."""

    def __init__(self, champion_dir: Path, base_dir: Path | None, micro_batch: int) -> None:
        import torch
        from transformers import AutoTokenizer

        from trainer.engine import load_model

        self.micro_batch = micro_batch
        # The engine's accelerator (trainer/engine.py: DS_ACCELERATOR, cpu unless a GPU is configured).
        cuda = os.environ.get("DS_ACCELERATOR") == "cuda" and torch.cuda.is_available()
        self.device = torch.device("cuda" if cuda else "cpu")
        self.tokenizer: Any = AutoTokenizer.from_pretrained(str(base_dir or champion_dir))
        model = load_model(champion_dir, base_dir, trainable=False)
        self.model: Any = model.to(self.device).eval()

    def tokenize(self, text: str) -> list[int]:
        """The hint's token ids, no special tokens (it goes inside an existing context)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def score(self, rows: list[Row]) -> list[list[float]]:
        """Each row's completion tokens' tempered logprobs (`completion_logprobs`)."""
        return completion_logprobs(self.model, rows, self.micro_batch, self.device)

    def close(self) -> None:
        import torch

        del self.model
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def completion_logprobs(
    model: Any, rows: list[Row], micro_batch: int, device: Any = "cpu"
) -> list[list[float]]:
    """log π of each row's completion tokens under `model`, tempered under the row's sampling
    (penalties and temperature, no truncation: `serving.sampler.TokenLogprobs.tempered`), no gradient,
    `micro_batch` rows at a time."""
    import torch

    from serving.sampler import collate, token_logprobs

    out: list[list[float]] = []
    with torch.no_grad():
        for start in range(0, len(rows), max(micro_batch, 1)):
            chunk = rows[start : start + max(micro_batch, 1)]
            tempered = token_logprobs(model, collate(chunk, pad_id=0).to(device)).tempered.cpu()  # (B, L−1)
            for i, row in enumerate(chunk):
                first = row.prompt_len - 1  # completion token k is predicted at prompt_len − 1 + k
                out.append(tempered[i, first : first + len(row.behaviour_logprobs)].tolist())
    return out


def run(
    term: HindsightTerm | None,
    cfg: TrainerSettings,
    episodes: Sequence[TrainingEpisode],
    rows: list[Row],
    champion_dir: Path,
    base_dir: Path | None,
) -> Distilled:
    """The cycle's hindsight step (trainer/cycle.py): `rows` unchanged without a term, at weight 0,
    without a correction to distil, or under dpo (whose loss reads only the sign of a row's
    advantage: a per-token term is no part of it); else the champion loaded as the teacher, `distil`,
    and the teacher freed."""
    if term is None:
        return Distilled(rows)
    if term.weight == 0.0 or not hints(term, episodes):
        return Distilled(rows, _empty())
    if isinstance(cfg.loss, DpoLoss):
        log.warning("the reward spec's hindsight term is no part of dpo's loss: corrections not distilled")
        return Distilled(rows, _empty())
    teacher = Teacher(champion_dir, base_dir, cfg.micro_batch)
    try:
        return distil(
            term,
            episodes,
            rows,
            tokenize=teacher.tokenize,
            score=teacher.score,
            add_missing=True,  # rft's left-out episodes; the policy-gradient losses have every row
        )
    finally:
        teacher.close()
