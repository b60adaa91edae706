"""Replay of retention data in a training cycle (docs/algorithms.md, Keeping what the model knows).

With ``trainer.replay.path`` set, every cycle draws ``per_cycle`` examples of the replay file
(schemas/replay.py), seeded by ``trainer.seed`` and the cycle's id (`draw`), and trains them with a
supervised term beside the policy objective:

    loss = policy loss + weight · mean token NLL of the replay completions

(`replay_loss`, summed over the replay micro-batches of a step; trainer/steps.py runs them). The
replay rows are no episodes: they are not selected, claimed, counted in ``CycleResult.episodes``
or ``trainable_rows``, and have no reward, advantage or baseline; they are not in the policy
loss' normaliser, and the trust region (``trainer.max_kl``) does not measure them: it bounds how
far a cycle moves the policy on the traffic it served, while the replay term pulls toward answers
the model is meant to keep, which is the direction retention wants, not a move to bound.

A row's tokens are what the champion would see at serving time: the messages rendered with the
checkpoint's chat template with the generation prompt, then tokenised without special tokens (the
template writes them), as vLLM's chat endpoint does; the completion's tokens then follow, with the
end-of-sequence token, as the model generates them. The trainer has no tokeniser of its own for
episodes (their token ids come from vLLM, through the store), so this is the one place it renders
a conversation. Rows are scored at temperature 1 without truncation (`serving.sampler.Sampling`'s
default): the NLL of the model's own distribution.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from schemas.replay import ReplayExample, read_replay_file
from schemas.settings import ReplaySettings, TrainerSettings
from serving.sampler import MicroBatch, Row, micro_batches
from trainer.errors import TrainerError


@dataclass(frozen=True)
class ReplayBatches:
    """A cycle's replay rows cut into micro-batches, their completion tokens (the term's normaliser:
    the NLL is a mean over every replay token of the step) and the term's weight."""

    batches: list[MicroBatch]
    tokens: int
    weight: float
    rows: int


def load(cfg: ReplaySettings) -> list[ReplayExample] | None:
    """The replay file's examples (raises `schemas.replay.ReplayFileError` naming a bad line, or a
    file or line over ``max_bytes`` / ``max_line_bytes``), or None when replay is off."""
    if cfg.path is None:
        return None
    return read_replay_file(cfg.path, max_bytes=cfg.max_bytes, max_line_bytes=cfg.max_line_bytes)


def draw(examples: list[ReplayExample], per_cycle: int, seed: int, cycle_id: int) -> list[ReplayExample]:
    """`per_cycle` examples without replacement (every one when there are fewer), in file order, the
    same for the same seed and cycle in every process."""
    if per_cycle >= len(examples):
        return list(examples)
    rng = random.Random(f"rtrl replay\0{seed}\0{cycle_id}")
    return [examples[i] for i in sorted(rng.sample(range(len(examples)), per_cycle))]


def replay_row(tokenizer: Any, example: ReplayExample) -> Row:
    """One example as a trainer row: the chat-rendered prompt's tokens, then the completion's and
    the end-of-sequence token (see the module docstring); no behaviour logprobs or advantage."""
    messages = [m.model_dump() for m in example.messages]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = list(tokenizer.encode(text, add_special_tokens=False))
    completion = [*tokenizer.encode(example.completion, add_special_tokens=False), tokenizer.eos_token_id]
    return Row(
        input_ids=[*prompt, *completion],
        prompt_len=len(prompt),
        behaviour_logprobs=[0.0] * len(completion),
        advantage=0.0,
    )


class ReplayUnusable(TrainerError):
    """The replay rows cannot be built for this checkpoint: its tokenizer has no chat template or no
    end-of-sequence token, or a row is longer than the model's positions. The operator's file or
    model is at fault, not the cycle's episodes (trainer/cycle.py ``NOT_THE_DATAS``)."""


def batches(
    cfg: TrainerSettings, examples: list[ReplayExample] | None, cycle_id: int, *, tokenizer_dir: Path
) -> ReplayBatches | None:
    """Cycle `cycle_id`'s replay micro-batches (``trainer.replay``, ``trainer.micro_batch`` rows
    each), tokenised with the tokenizer in `tokenizer_dir` (the champion's checkpoint, or the base
    of an adapter); None when replay is off. Raises `ReplayUnusable` when the rows cannot be built
    or do not fit the model."""
    if examples is None:
        return None
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if tokenizer.eos_token_id is None:
        raise ReplayUnusable(f"trainer.replay: the tokenizer in {tokenizer_dir} has no end-of-sequence token")
    drawn = draw(examples, cfg.replay.per_cycle, cfg.seed, cycle_id)
    try:
        rows = [replay_row(tokenizer, e) for e in drawn]
    except ValueError as exc:  # transformers: no chat template, or one that refuses the messages
        raise ReplayUnusable(
            f"trainer.replay: cannot render an example with {tokenizer_dir}'s chat template ({exc})"
        ) from None
    positions = getattr(AutoConfig.from_pretrained(str(tokenizer_dir)), "max_position_embeddings", None)
    longest = max((len(r.input_ids) for r in rows), default=0)
    if positions is not None and longest > positions:
        raise ReplayUnusable(
            f"trainer.replay: a replay example is {longest} tokens, longer than the model's {positions} positions; "
            "shorten it or leave it out of the file"
        )
    cut = micro_batches(rows, cfg.micro_batch, pad_id=0)
    return ReplayBatches(cut, sum(b.tokens for b in cut), cfg.replay.weight, len(drawn))


def replay_loss(
    logprobs: torch.Tensor, mask: torch.Tensor, weight: float, tokens: int
) -> tuple[torch.Tensor, float]:
    """One replay micro-batch's share of the term, weight · Σ −log π / `tokens` (`tokens`: the whole
    step's replay tokens, so the shares of a step add up to weight · mean token NLL), and its NLL sum.

    logprobs: (B, T) log π_θ of the completion tokens (`serving.sampler.token_logprobs`); mask: (B, T)."""
    nll = -(logprobs * mask).sum()  # ()
    return weight * nll / max(tokens, 1), float(nll.detach())
