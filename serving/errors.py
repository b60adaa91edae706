"""Exceptions of the vLLM client. `ServingError` is the root; catch it, not its children."""

from __future__ import annotations

import httpx

from schemas.errors import OperatorError

# What `VllmClient` lets through from its HTTP library unchanged: callers name these, so that no
# stage imports httpx itself (docs/architecture.md, third-party contracts).
Unreachable = httpx.TransportError  # the server never answered: refused, reset, timed out
CallFailed = httpx.HTTPError  # any failed call below ServerError: transport or protocol


class ServingError(RuntimeError):
    """Root of every error the vLLM client raises on purpose."""


class ServerError(ServingError):
    """A vLLM server answered an error, or something the client does not understand."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url


class UnsupportedModel(ServingError, OperatorError):
    """A model whose forward does something to lm_head's output that the trainer's selective
    logprobs do not reproduce (serving/sampler.py `_final_logits`)."""


class VersionUnknown(ServingError):
    """A server's ``/weight_info`` did not name an rtrl policy version."""


class AdapterError(ServingError, OperatorError):
    """A directory that is not a loadable LoRA adapter, or one the fleet cannot serve (its message
    says what to change)."""
