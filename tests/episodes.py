"""Training data for the trainer's and the gate's tests (not a test module): episodes sampled from a
model the way vLLM samples them, fed through the labeler's own store code, and copies of the tiny
model tuned to answer in given shapes (simulation/planted.py, re-exported here)."""

from __future__ import annotations

from factories import HOLDOUT_KEY

from schemas.events import FeedbackEvent, InteractionEvent
from simulation import planted
from simulation.planted import RAMBLING_PRUNE as RAMBLING_PRUNE
from simulation.planted import rambling_prune_copy as rambling_prune_copy
from simulation.planted import sample_episodes as sample_episodes
from simulation.planted import tuned_copy as tuned_copy
from store import Store


def feed(store: Store, pairs: list[tuple[InteractionEvent, FeedbackEvent]]) -> None:
    """Store and settle the events with the labeler's own write/join/settle code (no Kafka), in the
    tests' held-out buckets (`HOLDOUT_KEY`)."""
    planted.feed(store, pairs, HOLDOUT_KEY)
