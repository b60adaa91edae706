"""HTTP client of one vLLM OpenAI server's hot-swap endpoints (the "fleet" is a list of these).

The endpoints exist when the server runs with ``VLLM_SERVER_DEV_MODE=1`` (PLATFORM.md lists the
ones verified on CPU): ``/pause``, ``/resume``, ``/is_paused``, ``/collective_rpc`` (here only
``reload_weights`` from a local directory), ``/update_weight_version``, ``/weight_info``,
``/weight_checker`` and ``/reset_prefix_cache``. Plus the OpenAI ``/v1/completions`` the eval
gate generates with and the probe reads prompt logprobs from.

Every non-2xx answer raises `FleetError` with the server's body; transport errors
(`httpx.TransportError`) propagate as they are. Used by `deployer.rollout` and `deployer.gate`;
``rtrl deploy status`` prints what `VllmServer.state` returns.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict

from deployer.errors import FleetError

PauseMode = Literal["wait", "abort", "keep"]

# On the CPU backend vLLM repacks linear layers after loading and /weight_checker digests them as
# zero bytes whatever the weights (PLATFORM.md); such digests say nothing and are left out.
EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()


def meaningful_digests(digests: dict[str, str]) -> dict[str, str]:
    """The digests that depend on the weights: drop the sha256-of-nothing ones."""
    return {name: digest for name, digest in digests.items() if digest != EMPTY_DIGEST}


class ServerState(BaseModel):
    """What `rtrl deploy status` shows for one server."""

    model_config = ConfigDict(frozen=True)

    url: str
    healthy: bool
    weight_version: str | None = None
    paused: bool | None = None
    error: str | None = None


class VllmServer:
    """One vLLM server. Cheap to create; use as a context manager or call `close()`."""

    def __init__(self, base_url: str, timeout: float = 120.0, model: str = "rtrl-tiny") -> None:
        self.url = base_url.rstrip("/")
        self.model = model
        self._http = httpx.Client(base_url=self.url, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"VllmServer({self.url!r})"

    # ---- plumbing ----------------------------------------------------------------------------

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        response = self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise FleetError(
                self.url, f"{method} {path} -> HTTP {response.status_code}: {response.text[:2000]}"
            )
        return response

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._request(method, path, **kwargs)
        try:
            return response.json()
        except ValueError as exc:
            raise FleetError(self.url, f"{method} {path} answered non-JSON: {response.text[:500]!r}") from exc

    # ---- health and state --------------------------------------------------------------------

    def health(self) -> bool:
        """True when the server answers ``/health`` with 200; False when it cannot be reached."""
        try:
            return self._http.get("/health").status_code == 200
        except httpx.TransportError:
            return False

    def is_paused(self) -> bool:
        return bool(self._json("GET", "/is_paused")["is_paused"])

    def weight_version(self) -> str | None:
        """The version set with `update_weight_version`; vLLM answers "default" until someone sets one."""
        version = self._json("GET", "/weight_info")["weight_version"]
        return None if version is None else str(version)

    def state(self) -> ServerState:
        """Health, weight version and pause state, for status displays; never raises."""
        if not self.health():
            return ServerState(url=self.url, healthy=False, error="not reachable or not healthy")
        try:
            return ServerState(
                url=self.url, healthy=True, weight_version=self.weight_version(), paused=self.is_paused()
            )
        except (FleetError, httpx.HTTPError) as exc:
            return ServerState(url=self.url, healthy=True, error=str(exc))

    # ---- the swap ----------------------------------------------------------------------------

    def pause(self, mode: PauseMode = "wait") -> None:
        """Stop scheduling. ``wait`` lets in-flight requests finish, ``abort`` aborts them, ``keep``
        freezes them in the queue; new requests wait either way until `resume`."""
        self._request("POST", "/pause", params={"mode": mode})

    def resume(self) -> None:
        self._request("POST", "/resume")

    def reload_weights(self, weights_path: Path) -> None:
        """Load the weights of a local HF-format checkpoint directory in place (same architecture)."""
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(weights_path)}}
        self._request("POST", "/collective_rpc", json=body)

    def update_weight_version(self, version: str) -> None:
        self._request("POST", "/update_weight_version", json={"new_version": version})

    def reset_prefix_cache(self) -> None:
        """Drop cached KV blocks computed with the old weights. vLLM refuses while blocks are held
        (running requests); the swap calls it paused, so a refusal is an error."""
        if not self._json("POST", "/reset_prefix_cache").get("success"):
            raise FleetError(
                self.url, "reset_prefix_cache refused (KV blocks still held by running requests)"
            )

    def weight_digests(self) -> dict[str, str]:
        """sha256 of every vLLM parameter (fused names such as ``qkv_proj``), keyed per worker rank."""
        checksums = self._json("POST", "/weight_checker", json={"action": "checksum"})["checksums"]
        return {str(name): str(digest) for name, digest in checksums.items()}

    # ---- generation --------------------------------------------------------------------------

    def prompt_logprobs(self, prompt_token_ids: list[int]) -> list[float]:
        """Logprob of each prompt token after the first, given the tokens before it.

        One greedy token is generated because the completions API needs ``max_tokens >= 1``;
        it is ignored. Token ids go in as ids, so no tokenizer or BOS handling is involved.
        """
        body = {
            "model": self.model,
            "prompt": prompt_token_ids,
            "max_tokens": 1,
            "temperature": 0,
            "prompt_logprobs": 1,
            "return_token_ids": True,
        }
        choice = self._json("POST", "/v1/completions", json=body)["choices"][0]
        entries = choice.get("prompt_logprobs")
        if not isinstance(entries, list) or len(entries) != len(prompt_token_ids):
            raise FleetError(self.url, f"prompt_logprobs missing or misaligned in {str(choice)[:500]}")
        # entries[i] maps token id (as a string) -> {"logprob", "rank", ...}; it holds the actual
        # token plus the top-1, and entries[0] is None (the first token has no context).
        logprobs: list[float] = []
        for token_id, entry in zip(prompt_token_ids[1:], entries[1:], strict=True):
            if entry is None or str(token_id) not in entry:
                raise FleetError(self.url, f"no prompt logprob for token {token_id} in {entry!r}")
            logprobs.append(float(entry[str(token_id)]["logprob"]))
        return logprobs

    def complete(
        self,
        prompts: list[str],
        *,
        max_tokens: int,
        n: int = 1,
        temperature: float = 1.0,
        seed: int | None = None,
        stop: list[str] | None = None,
    ) -> list[list[str]]:
        """``n`` sampled completions per prompt, in prompt order: ``result[i][j]``."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompts,
            "max_tokens": max_tokens,
            "n": n,
            "temperature": temperature,
            "stop": stop or [],
        }
        if seed is not None:
            body["seed"] = seed
        choices = self._json("POST", "/v1/completions", json=body)["choices"]
        if len(choices) != len(prompts) * n:
            raise FleetError(self.url, f"asked for {len(prompts)}x{n} completions, got {len(choices)}")
        result: list[list[str]] = [[] for _ in prompts]
        # Choices are numbered prompt-major: index = prompt_index * n + sample_index.
        for choice in sorted(choices, key=lambda c: int(c["index"])):
            result[int(choice["index"]) // n].append(str(choice["text"]))
        return result
