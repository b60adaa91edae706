"""Exceptions of the deployer. `DeployError` is the root: callers that want "the deploy step failed,
keep the loop running" catch that one; everything else propagates."""

from __future__ import annotations


class DeployError(RuntimeError):
    """Root of every error the deployer raises on purpose."""


class RegistryError(DeployError):
    """The MLflow registry is missing something the deployer needs (a version, an alias, artifacts)."""


class FleetError(DeployError):
    """A vLLM server answered an error or something the deployer does not understand."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url


class VerifyError(DeployError):
    """A server's weights after a reload do not match the checkpoint (probe logprobs or digests)."""


class GateError(DeployError):
    """The eval gate could not be run (not: the challenger failed it; that is a GateDecision)."""


class RolloutBusy(DeployError):
    """Another rollout or gate run holds the lock; one at a time."""
