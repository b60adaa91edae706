"""vLLM for every rtrl process: the one client of a vLLM OpenAI server.

`VllmClient` (sync: the deployer, the eval gate, ``rtrl services``) and `AsyncVllmClient` (the
gateway) share the reading of weight versions; see serving/client.py for the endpoints.
"""

from serving.client import (
    EMPTY_DIGEST,
    AsyncVllmClient,
    PauseMode,
    ServerState,
    VllmClient,
    meaningful_digests,
    parse_weight_info,
)
from serving.errors import ServerError, ServingError, VersionUnknown

__all__ = [
    "EMPTY_DIGEST",
    "AsyncVllmClient",
    "PauseMode",
    "ServerError",
    "ServerState",
    "ServingError",
    "VersionUnknown",
    "VllmClient",
    "meaningful_digests",
    "parse_weight_info",
]
