"""Exceptions of the trainer package. ``TrainerError`` is the root; catch it, not its children."""

from __future__ import annotations


class TrainerError(RuntimeError):
    """Root of every error the trainer raises on purpose."""


class AfterRegistration(TrainerError):
    """The gate or the deploy failed after the cycle registered its challenger. Not retried: a
    retry would train and register another version; the cycle is failed and its episodes freed."""


class InsufficientData(TrainerError):
    """The claimed batch turned out too small (or without trainable tokens) to train on."""


class Abandoned(TrainerError):
    """The worker is stopping (SIGTERM): the cycle stops at its next step boundary, before it
    registers anything, and fails cleanly so that its episodes are trainable again at once."""
