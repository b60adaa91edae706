"""The deployer's client of the weights agent on a vLLM host (the agent itself: deployer/agent.py).

A vLLM server that cannot see the deployer's files is given a registered version by its host's
``rtrl agent``: `agent_for` finds the agent of a server (``vllm.weights_agents``), `fetch` asks it
for the version and answers with the path on that host, which the deployer then hands to vLLM.
`Fetched` is the agent's answer, shared by both sides. Every failure (the agent refuses, cannot be
reached, answers something else) is a `ServerError` for the server the version was meant for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict

from schemas.settings import Settings
from serving.errors import ServerError

# A download of a large checkpoint takes minutes; the deployer waits for it.
FETCH_TIMEOUT_S = 3600.0


class Fetched(BaseModel):
    """Where the agent put a version on its host."""

    model_config = ConfigDict(frozen=True)

    version: int
    path: str
    adapter: bool


def agent_for(settings: Settings, server_url: str) -> str | None:
    """The weights agent of `server_url` (``vllm.weights_agents``), None when the server reads the
    deployer's own files."""
    agents = {url.rstrip("/"): agent.rstrip("/") for url, agent in settings.vllm.weights_agents.items()}
    return agents.get(server_url.rstrip("/"))


def fetch(settings: Settings, server_url: str, agent_url: str, version: int) -> Path:
    """Have the agent of `server_url` put `version` on its host; the path there. Raises ServerError
    (for that server) when the agent refuses or cannot be reached: the swap then fails and restores
    as for a failed reload."""
    headers: dict[str, Any] = {}
    if settings.agent.token is not None:
        headers["authorization"] = f"Bearer {settings.agent.token.get_secret_value()}"
    try:
        response = httpx.post(f"{agent_url}/v1/versions/{version}", headers=headers, timeout=FETCH_TIMEOUT_S)
    except httpx.HTTPError as exc:
        raise ServerError(server_url, f"weights agent {agent_url} not reachable: {exc}") from None
    if response.status_code != 200:
        raise ServerError(
            server_url, f"weights agent {agent_url} answered {response.status_code}: {response.text[:500]}"
        )
    try:
        return Path(Fetched.model_validate_json(response.content).path)
    except ValueError:
        raise ServerError(server_url, f"weights agent {agent_url} answered {response.text[:200]!r}") from None
