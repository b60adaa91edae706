"""What settling reads of the episodes it closes (store/settle.py): their joined, non-late feedback
(`read_signals`), their non-late segments (`read_segments`), and those segments as schemas/episodes.py
measures them (`segment_shapes`). Read in the transaction that settles the episodes, once they are
locked (store/settle.py, Concurrency).
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from schemas.episodes import SegmentShape
from store.bulk import among
from store.episode_rows import EPISODES, EpisodeRow
from store.models import Feedback, Interaction

# Settle at most this many expired episodes per pass, so one pass cannot make a huge transaction.
WINDOW_BATCH = 1000


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
    reason, trainable, the version that served it, and token counts and the text's characters
    counted by the database (``json_array_length``, ``length``, on SQLite and PostgreSQL alike)."""
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
            (func.length(Interaction.prompt) + func.length(Interaction.completion)).label("text_chars"),
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


def within_text_budget(
    episodes: list[EpisodeRow], segments_of: dict[str, list[Any]], budget: int
) -> list[EpisodeRow]:
    """The first of `episodes` (at least one) whose text `segment_shapes` would read (episodes of
    several segments) adds up to at most `budget` characters: what one settling pass holds in
    memory and compares, whatever the episodes hold (docs/security.md, Caps per episode)."""
    kept: list[EpisodeRow] = []
    total = 0
    for episode in episodes:
        segments = segments_of.get(episode.episode_id, [])
        chars = sum(int(s.text_chars or 0) for s in segments) if len(segments) > 1 else 0
        if kept and total + chars > budget:
            break
        kept.append(episode)
        total += chars
    return kept


def expired_ids(session: Session, now: datetime, window_s: float) -> list[str]:
    """The episodes `settle_expired` would look at now, oldest last event first (no lock)."""
    return list(
        session.scalars(
            select(EPISODES.c.episode_id)
            .where(EPISODES.c.status == "open", EPISODES.c.last_event_at < now - timedelta(seconds=window_s))
            .order_by(EPISODES.c.last_event_at)
            .limit(WINDOW_BATCH)
        )
    )
