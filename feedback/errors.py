"""Exceptions of the feedback package. ``FeedbackError`` is the root; catch it, not its children."""

from __future__ import annotations


class FeedbackError(Exception):
    """Root of every error the feedback package raises on purpose."""


class LeaseLost(FeedbackError):
    """The training cycle is no longer active (finished, or its lease expired and another took over)."""


class EpisodesUnavailable(FeedbackError):
    """Episodes asked for by a cycle are unknown, not settled, or already used by another cycle."""


class TransientSinkError(FeedbackError):
    """The database or the dead-letter topic failed; the labeler backs off and re-reads the batch."""
