"""A cycle's batch, episode by episode: which episodes carry signal, the rows they train, and how
they are grouped and shaped for their advantages. Pure functions of the selected episodes
(`store.TrainingEpisode`), used by trainer/cycle.py.
"""

from __future__ import annotations

from schemas.rewards import carries_signal as signal_of
from schemas.sampling import untrainable_sampling
from serving.sampler import Row, Sampling
from store import TrainingEpisode
from trainer.advantages import overlong_penalty, prompt_key

NO_SIGNAL = 1e-9  # |advantage| at or below this carries no signal (DAPO's dynamic sampling)


def carries_signal(episode: TrainingEpisode) -> bool:
    """Whether the episode's reward says anything: user feedback, or a judge's grade. An episode
    settled by the window with neither has reward 0 and learns nothing, whatever its advantage:
    once a running baseline exists every reward differs from it (trainer/advantages.py). The
    definition is schemas/rewards.py `carries_signal`, which the gate's ope suite shares."""
    return signal_of(episode.no_feedback, episode.components)


def signal_count(episodes: list[TrainingEpisode]) -> int:
    """How many of a batch's episodes carry signal (`carries_signal`): what decides whether a cycle
    trains (``trainer.min_signal``), never the advantages."""
    return sum(carries_signal(e) for e in episodes)


def has_rows(episode: TrainingEpisode) -> bool:
    """Whether the episode contributes a row (`rows_of`): a trainable segment with a completion
    whose sampling the trainer may learn from. A greedy episode with feedback trains nothing, so
    its feedback cannot carry a batch of other episodes' noise."""
    return any(
        seg.trainable and seg.completion_token_ids and untrainable_sampling(seg.sampling) is None
        for seg in episode.segments
    )


def rows_of(episodes: list[TrainingEpisode], advantages: list[float]) -> tuple[list[Row], dict[str, int]]:
    """Every trainable segment with a completion becomes a row carrying its episode's advantage, how
    it was sampled and where it came from (`Row.source`: the episode, the segment's index); also the segments left out for their sampling, by reason
    (`schemas.sampling.untrainable_sampling`: greedy or near-greedy, or raw logprobs of non-neutral
    sampling)."""
    rows = []
    left_out: dict[str, int] = {}
    for episode, advantage in zip(episodes, advantages, strict=True):
        for index, seg in enumerate(episode.segments):
            if not (seg.trainable and seg.completion_token_ids):
                continue
            reason = untrainable_sampling(seg.sampling)
            if reason is not None:
                left_out[reason] = left_out.get(reason, 0) + 1
                continue
            rows.append(
                Row(
                    input_ids=[*seg.prompt_token_ids, *seg.completion_token_ids],
                    prompt_len=len(seg.prompt_token_ids),
                    behaviour_logprobs=list(seg.completion_logprobs),
                    advantage=advantage,
                    sampling=Sampling.of(seg.sampling),
                    source=(episode.episode_id, index),
                )
            )
    return rows, left_out


def carries_advantage(row: Row) -> bool:
    """Whether a row moves the policy: an advantage above `NO_SIGNAL`, its own or one of its tokens'
    (hindsight distillation's term, `Row.token_advantages`). DAPO's dynamic sampling drops the others."""
    values = row.token_advantages or (row.advantage,)
    return any(abs(value) > NO_SIGNAL for value in values)


def episode_overlong_penalty(episode: TrainingEpisode, buffer: float) -> float:
    """DAPO's overlong penalty of an episode: that of its most overlong trainable segment."""
    return min(
        (
            overlong_penalty(len(seg.completion_token_ids), seg.sampling.max_tokens, buffer)
            for seg in episode.segments
            if seg.trainable
        ),
        default=0.0,
    )


def episode_prompt_key(episode: TrainingEpisode) -> str:
    """Episodes are grouped by the prompt of their first segment (what the user asked)."""
    if not episode.segments:
        raise ValueError(f"episode {episode.episode_id} has no segments")
    return prompt_key(episode.segments[0].prompt_token_ids)
