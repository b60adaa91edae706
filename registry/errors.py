"""Exceptions of the registry client. `RegistryError` is the root; catch it, not its children."""

from __future__ import annotations

from schemas.errors import OperatorError


class RegistryError(RuntimeError):
    """The MLflow registry is missing something rtrl needs (a version, an alias, artifacts)."""


class NoChampion(RegistryError, OperatorError):
    """The registered model has no @champion yet: the loop was never bootstrapped."""


class RegistryUnavailable(RegistryError, OperatorError):
    """The MLflow tracking server did not answer (unreachable or timing out)."""


class RegistryRefused(RegistryError, OperatorError):
    """The MLflow tracking server refused rtrl's credentials (401), or rtrl had none to give."""
