"""Exceptions of the vLLM client. `ServingError` is the root; catch it, not its children."""

from __future__ import annotations


class ServingError(RuntimeError):
    """Root of every error the vLLM client raises on purpose."""


class ServerError(ServingError):
    """A vLLM server answered an error, or something the client does not understand."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url


class VersionUnknown(ServingError):
    """A server's ``/weight_info`` did not name an rtrl policy version."""
