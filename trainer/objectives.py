"""Which of a cycle's episodes the two objectives that are not RL learn from, and how their rows
are batched (docs/algorithms.md, Objectives: RL, rejection-sampling fine-tuning, DPO).

The policy-gradient losses train on every row of the batch with its advantage (trainer/batch.py).
Two objectives choose instead; `select` is called by trainer/cycle.py after the advantages:

* ``rft`` (rejection-sampling fine-tuning, https://arxiv.org/abs/2308.01825): the rows of the
  episodes that carry signal (feedback or a judge's grade) and whose reward is strictly above
  ``min_reward``, each with weight 1 as its advantage; every other episode adds nothing, to the
  loss or to its normaliser.
* ``dpo`` (https://arxiv.org/abs/2305.18290): disjoint pairs of episodes that carry signal, share
  the prompt of their first trainable segment, and whose rewards differ by at least ``margin``
  (`pair_indices`); the winner's rows get advantage +1, the loser's −1, both the pair's id
  (`serving.sampler.Row.pair`). An episode with no partner adds nothing and is counted.

DPO's loss is not a sum over rows: it needs both sides of a pair in one forward pass, so its
micro-batches are cut by pair, never through one (`batches`), and its normaliser counts pairs.
Pure functions of the selected episodes (`store.TrainingEpisode`) and rows.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from schemas.sampling import untrainable_sampling
from schemas.settings import DpoLoss, LossSettings, RftLoss
from serving.sampler import MicroBatch, Row, collate, micro_batches
from store import TrainingEpisode
from trainer.advantages import prompt_key
from trainer.batch import carries_signal, has_rows, rows_of
from trainer.losses import Normaliser


@dataclass(frozen=True)
class Selection:
    """The rows an objective trains on, what it kept and left of the batch (logged with the
    cycle), and, when it kept nothing, why (the cycle is skipped with that reason)."""

    rows: list[Row]
    counts: dict[str, int]
    empty_reason: str = ""


def select(loss: LossSettings, episodes: list[TrainingEpisode]) -> Selection | None:
    """The rows of the configured objective, or None for a policy-gradient loss (every row)."""
    if isinstance(loss, RftLoss):
        return _rft(episodes, loss.min_reward)
    if isinstance(loss, DpoLoss):
        return _dpo(episodes, loss.margin)
    return None


def _rft(episodes: list[TrainingEpisode], min_reward: float) -> Selection:
    """The rows of the accepted episodes (`rft_accepts`), weight 1 each."""
    accepted = [e for e in episodes if rft_accepts(e, min_reward)]
    rows, _ = rows_of(accepted, [1.0] * len(accepted))
    return Selection(
        rows,
        {"rft_accepted": len(accepted), "rft_left_out": len(episodes) - len(accepted)},
        "" if rows else f"no episode with feedback has a reward above rft's min_reward {min_reward:g}",
    )


def rft_accepts(episode: TrainingEpisode, min_reward: float) -> bool:
    """Whether RFT fine-tunes on the episode: it has a trainable row, carries signal (an episode
    no one rated has reward 0 and says nothing, whatever ``min_reward``), and its reward is
    strictly above ``min_reward``."""
    return has_rows(episode) and carries_signal(episode) and episode.reward > min_reward


def _dpo(episodes: list[TrainingEpisode], margin: float) -> Selection:
    """The rows of every pair (`pair_indices`), the winner's with advantage +1, the loser's −1."""
    eligible = [e for e in episodes if has_rows(e) and carries_signal(e)]
    pairs = pair_indices([first_row_prompt_key(e) for e in eligible], [e.reward for e in eligible], margin)
    rows: list[Row] = []
    for p, (winner, loser) in enumerate(pairs):
        for index, side in ((winner, 1.0), (loser, -1.0)):
            side_rows, _ = rows_of([eligible[index]], [side])
            rows += [replace(row, pair=p) for row in side_rows]
    return Selection(
        rows,
        {"dpo_pairs": len(pairs), "dpo_unpaired": len(eligible) - 2 * len(pairs)},
        "" if rows else f"no two episodes of one prompt have rewards {margin:g} (dpo's margin) apart",
    )


def first_row_prompt_key(episode: TrainingEpisode) -> str:
    """`prompt_key` of the episode's first segment that becomes a row: the request both sides of
    a DPO pair answered."""
    for seg in episode.segments:
        if seg.trainable and seg.completion_token_ids and untrainable_sampling(seg.sampling) is None:
            return prompt_key(seg.prompt_token_ids)
    raise ValueError(f"episode {episode.episode_id} has no trainable row")


def pair_indices(keys: Sequence[str], rewards: Sequence[float], margin: float) -> list[tuple[int, int]]:
    """Disjoint (winner, loser) index pairs of samples with the same key whose rewards differ by at
    least `margin` (> 0: equal rewards never pair), as many as the margin allows in each group.

    In a group sorted by reward, the most pairs is the largest k for which the k lowest, in order,
    are each `margin` below the k highest, in order (pairing the lowest with the highest can use
    up a sample that two closer pairs needed: 0, 1, 2, 3 with margin 2 pairs 0–2 and 1–3).
    Ties are broken by input order, so the pairing is deterministic.
    """
    if margin <= 0:
        raise ValueError(f"margin {margin} must be > 0")
    groups: dict[str, list[int]] = defaultdict(list)
    for i, key in enumerate(keys):
        groups[key].append(i)
    pairs: list[tuple[int, int]] = []
    for members in groups.values():
        ordered = sorted(members, key=lambda i: (rewards[i], i))  # ascending reward
        n = len(ordered)
        for k in range(n // 2, 0, -1):
            if all(rewards[ordered[n - k + j]] - rewards[ordered[j]] >= margin for j in range(k)):
                pairs += [(ordered[n - k + j], ordered[j]) for j in range(k)]
                break
    return sorted(pairs)


def batches(
    loss: LossSettings, rows: list[Row], size: int, pad_id: int
) -> tuple[list[MicroBatch], Normaliser]:
    """The cycle's micro-batches and their normaliser: rows sorted by length and cut every `size`
    rows (`serving.sampler.micro_batches`), and under DPO whole pairs (`dpo_micro_batches`), the
    normaliser counting pairs instead of sequences."""
    if isinstance(loss, DpoLoss):
        cut = dpo_micro_batches(rows, size, pad_id)
        sequences = len({row.pair for row in rows})
    else:
        cut, sequences = micro_batches(rows, size, pad_id), len(rows)
    return cut, Normaliser(tokens=sum(b.tokens for b in cut), sequences=sequences)


def dpo_micro_batches(rows: list[Row], size: int, pad_id: int) -> list[MicroBatch]:
    """Micro-batches of whole pairs: pairs in order of their longest row (less padding), added to
    a micro-batch while it stays within `size` rows; a pair larger than `size` rows (episodes of
    several segments) gets a micro-batch of its own."""
    by_pair: dict[int, list[Row]] = defaultdict(list)
    for row in rows:
        by_pair[row.pair].append(row)
    ordered = sorted(by_pair.values(), key=lambda group: max(len(r.input_ids) for r in group))
    cut: list[list[Row]] = []
    for group in ordered:
        if cut and len(cut[-1]) + len(group) <= size:
            cut[-1] += group
        else:
            cut.append(list(group))
    return [collate(group, pad_id) for group in cut]
