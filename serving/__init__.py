"""vLLM for every rtrl process: the one client of a vLLM OpenAI server.

`VllmClient` (sync: the deployer, the eval gate, ``rtrl services``) and `serving.aio.AsyncVllmClient`
(the gateway, on aiohttp; imported from there so that no other process loads aiohttp) share the
reading of weight versions; see serving/client.py for the endpoints. The deployer's client of the
weights agent on a vLLM host is serving/weights_agent.py.
"""

from serving.client import (
    EMPTY_DIGEST,
    Generation,
    PauseMode,
    ServerState,
    VllmClient,
    meaningful_digests,
    parse_weight_info,
)
from serving.errors import AdapterError, CallFailed, ServerError, ServingError, Unreachable, VersionUnknown

__all__ = [
    "AdapterError",
    "CallFailed",
    "EMPTY_DIGEST",
    "Generation",
    "PauseMode",
    "ServerError",
    "ServerState",
    "ServingError",
    "Unreachable",
    "VersionUnknown",
    "VllmClient",
    "meaningful_digests",
    "parse_weight_info",
]
