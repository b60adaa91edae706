"""Exceptions of the deployer. `DeployError` is the root. A vLLM server's own errors arrive as
`serving.ServingError` (or `serving.CallFailed`, what its HTTP library raised); `promote` and `rollback` catch those per server
and record a failed step (restoring what they can), so they return a result rather than raise.
`align_fleet` and `bootstrap` raise `serving.ServerError` when a server cannot be brought to the
champion."""

from __future__ import annotations

from schemas.errors import OperatorError


class DeployError(RuntimeError):
    """Root of every error the deployer raises on purpose."""


class GateError(DeployError, OperatorError):
    """The eval gate could not be run: no staging server, or the champion does not load on it (not:
    the challenger failed the gate; that is a GateDecision)."""


class RolloutBusy(DeployError, OperatorError):
    """Another rollout or gate run holds the lock; one at a time."""


class WaitStopped(RolloutBusy):
    """A caller waiting for a held deploy lock (the worker's chain, ``deployer.lock_wait_s``) was
    told to stop (SIGTERM) before the lock came free: handled like any RolloutBusy."""


class NothingToRollBack(DeployError, OperatorError):
    """A rollback was asked for, but no previous champion is recorded."""


class NotAuthorized(DeployError, OperatorError):
    """A promotion without grounds: the version has no passing gate decision in rtrl's store and
    never served (deployer/trust.py); ``--force --reason`` records an operator's own."""
