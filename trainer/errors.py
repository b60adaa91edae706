"""Exceptions of the trainer package. ``TrainerError`` is the root; catch it, not its children."""

from __future__ import annotations


class TrainerError(RuntimeError):
    """Root of every error the trainer raises on purpose."""


class InsufficientData(TrainerError):
    """The claimed batch turned out too small (or without trainable tokens) to train on."""
