"""Exceptions of the gateway. `IngestError` is the root; catch it, not its children."""

from __future__ import annotations


class IngestError(Exception):
    """Root of the errors the gateway raises on purpose."""
