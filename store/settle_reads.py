"""What settling reads of the episodes it closes (store/settle.py): their joined, non-late feedback
(`read_signals`), their non-late segments (`read_segments`), and those segments as schemas/episodes.py
measures them (`segment_shapes`). Read in the transaction that settles the episodes, once they are
locked (store/settle.py, Concurrency).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from schemas.episodes import SegmentShape
from store.bulk import among
from store.models import Feedback, Interaction


def read_signals(session: Session, episode_ids: list[str]) -> dict[str, list[Any]]:
    """Each episode's joined, non-late feedback (kind, value, and the episode id the sender named),
    oldest first."""
    signals: dict[str, list[Any]] = defaultdict(list)
    if not episode_ids:
        return signals
    rows = session.execute(
        select(Feedback.joined_episode_id, Feedback.kind, Feedback.value, Feedback.episode_id)
        .where(among(session, Feedback.joined_episode_id, episode_ids), Feedback.late.is_(False))
        .order_by(Feedback.created_at, Feedback.event_id)
    )
    for row in rows:
        signals[row.joined_episode_id].append(row)
    return signals


def read_segments(session: Session, episode_ids: list[str]) -> dict[str, list[Any]]:
    """Each episode's non-late segments in order, without their text: index, role, agent, finish
    reason, trainable, the version that served it, and token counts counted by the database
    (``json_array_length``, on SQLite and PostgreSQL alike)."""
    segments: dict[str, list[Any]] = defaultdict(list)
    if not episode_ids:
        return segments
    rows = session.execute(
        select(
            Interaction.episode_id,
            Interaction.segment_index,
            Interaction.role,
            Interaction.agent,
            Interaction.finish_reason,
            Interaction.trainable,
            Interaction.policy_version,
            func.json_array_length(Interaction.prompt_token_ids).label("prompt_len"),
            func.json_array_length(Interaction.completion_token_ids).label("completion_len"),
        )
        .where(among(session, Interaction.episode_id, episode_ids), Interaction.late.is_(False))
        .order_by(Interaction.episode_id, Interaction.segment_index)
    )
    for row in rows:
        segments[row.episode_id].append(row)
    return segments


def segment_shapes(
    session: Session, episode_ids: list[str], segments_of: dict[str, list[Any]]
) -> dict[str, list[SegmentShape]]:
    """The segments of `episode_ids` (from `segments_of`, `read_segments`) as schemas/episodes.py
    measures them. The text is read only for episodes of several segments (one segment's lengths
    suffice)."""
    per_episode = {e: segments_of[e] for e in episode_ids if segments_of.get(e)}
    several = sorted(e for e, segs in per_episode.items() if len(segs) > 1)
    text: dict[tuple[str, int], tuple[str, str]] = {}
    if several:
        for row in session.execute(
            select(
                Interaction.episode_id, Interaction.segment_index, Interaction.prompt, Interaction.completion
            ).where(among(session, Interaction.episode_id, several), Interaction.late.is_(False))
        ):
            text[(row.episode_id, row.segment_index)] = (row.prompt, row.completion)
    return {
        episode_id: [
            SegmentShape(
                role=r.role,
                agent=r.agent,
                prompt_len=int(r.prompt_len or 0),
                completion_len=int(r.completion_len or 0),
                finish_reason=r.finish_reason,
                trainable=bool(r.trainable),
                prompt=text.get((episode_id, r.segment_index), ("", ""))[0],
                completion=text.get((episode_id, r.segment_index), ("", ""))[1],
                version=r.policy_version,
            )
            for r in segs
        ]
        for episode_id, segs in per_episode.items()
    }
