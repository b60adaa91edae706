"""Exceptions of the deployer. `DeployError` is the root. A vLLM server's own errors arrive as
`serving.ServingError` (or httpx transport errors); the swap catches those per server and turns
them into a failed, restored step, so what escapes `promote` is a bug or a server that could not
even be restored (`serving.ServerError`)."""

from __future__ import annotations

from schemas.errors import OperatorError


class DeployError(RuntimeError):
    """Root of every error the deployer raises on purpose."""


class GateError(DeployError, OperatorError):
    """The eval gate could not be run: no staging server, or the champion does not load on it (not:
    the challenger failed the gate; that is a GateDecision)."""


class RolloutBusy(DeployError, OperatorError):
    """Another rollout or gate run holds the lock; one at a time."""


class NothingToRollBack(DeployError, OperatorError):
    """A rollback was asked for, but no previous champion is recorded."""
