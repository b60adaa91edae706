"""HTTP client of one vLLM OpenAI server: generation, health, weight versions and the hot-swap endpoints.

`VllmClient` (sync) is what the deployer, the eval gate and ``rtrl services`` use; the gateway's
`serving.aio.AsyncVllmClient` reads the weight version the same way (`weight_version_of`).

The hot-swap endpoints exist when the server runs with ``VLLM_SERVER_DEV_MODE=1``
(docs/platform.md, Hot-swap endpoints): ``/pause``, ``/resume``, ``/is_paused``,
``/collective_rpc`` (here only ``reload_weights`` from a local directory),
``/update_weight_version``, ``/weight_info``, ``/weight_checker`` and ``/reset_prefix_cache``; with
``--enable-lora``, ``/v1/load_lora_adapter`` (docs/lora.md).

Every non-2xx answer raises `ServerError` with the server's body; a ``/weight_info`` that names no
rtrl version raises `VersionUnknown`; transport errors (`httpx.TransportError`) propagate as they
are, because callers treat "never reached the server" differently from "the server said no".
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict

from schemas.versions import format_version, parse_version
from serving.errors import ServerError, VersionUnknown

PauseMode = Literal["wait", "abort", "keep"]
# Health and version reads that answer in milliseconds when the server is well; the gateway makes
# them on the request path, so they give up sooner than a generation would.
PROBE_TIMEOUT_S = 2.0
HEALTH_TIMEOUT_S = 5.0

# On the CPU backend vLLM repacks linear layers after loading and /weight_checker digests them as
# zero bytes whatever the weights (docs/platform.md, Weight digests on CPU); such digests say
# nothing and are left out.
EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()


def meaningful_digests(digests: dict[str, str]) -> dict[str, str]:
    """The digests that depend on the weights: drop the sha256-of-nothing ones."""
    return {name: digest for name, digest in digests.items() if digest != EMPTY_DIGEST}


def parse_weight_info(url: str, response: httpx.Response) -> int | None:
    """The policy version in a ``GET /weight_info`` answer: N for ``"vN"``, None when the server was
    never given one (vLLM answers ``"default"`` or null). Raises VersionUnknown otherwise."""
    return weight_version_of(url, response.status_code, response.text)


def adapter_version(path: str) -> int | None:
    """The version an adapter loaded from `path` is: its last component ``vN``; None for another."""
    try:
        return parse_version(PurePath(path).name)
    except ValueError:
        return None


def adapter_versions_of(models: Any) -> dict[str, int | None]:
    """The adapters in a ``GET /v1/models`` answer, by name, with their `adapter_version`; the base
    model's card (no ``parent``) is left out."""
    cards = models.get("data", []) if isinstance(models, dict) else []
    return {str(c["id"]): adapter_version(str(c.get("root") or "")) for c in cards if c.get("parent")}


def weight_version_of(url: str, status: int, text: str) -> int | None:
    """`parse_weight_info` of an answer given as its status and body."""
    if status != 200:
        raise VersionUnknown(
            f"{url}/weight_info answered {status} (is the server started with VLLM_SERVER_DEV_MODE=1?)"
        )
    try:
        version = json.loads(text).get("weight_version")
    except (ValueError, AttributeError):
        raise VersionUnknown(f"{url}/weight_info answered {text[:200]!r}") from None
    if version is None or version == "default":
        return None
    try:
        return parse_version(str(version))
    except ValueError as exc:
        raise VersionUnknown(f"{url}/weight_info: {exc}") from None


class ServerState(BaseModel):
    """What `rtrl deploy status` shows for one server."""

    model_config = ConfigDict(frozen=True)

    url: str
    healthy: bool
    weight_version: int | None = None
    paused: bool | None = None
    error: str | None = None


@dataclass(frozen=True)
class Generation:
    """One sampled completion: its text, the logprob of each of its tokens, why it stopped."""

    text: str
    logprobs: tuple[float, ...]
    finish_reason: str | None


class VllmClient:
    """One vLLM server, synchronously. Use as a context manager or call `close()`."""

    def __init__(self, base_url: str, *, model: str, timeout_s: float = 120.0) -> None:
        self.url = base_url.rstrip("/")
        self.model = model
        self.timeout_s = timeout_s
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> VllmClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"VllmClient({self.url!r})"

    # ---- plumbing ----------------------------------------------------------------------------

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        response = self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise ServerError(
                self.url, f"{method} {path} -> HTTP {response.status_code}: {response.text[:2000]}"
            )
        return response

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._request(method, path, **kwargs)
        try:
            return response.json()
        except ValueError as exc:
            raise ServerError(
                self.url, f"{method} {path} answered non-JSON: {response.text[:500]!r}"
            ) from exc

    # ---- health and state --------------------------------------------------------------------

    def health(self) -> bool:
        """True when the server answers ``/health`` with 200; False when it cannot be reached."""
        try:
            return self._http.get("/health", timeout=min(HEALTH_TIMEOUT_S, self.timeout_s)).status_code == 200
        except httpx.TransportError:
            return False

    def is_paused(self) -> bool:
        return bool(self._json("GET", "/is_paused")["is_paused"])

    def weight_version(self) -> int | None:
        """The policy version the server was given (`update_weight_version`), None if never."""
        return parse_weight_info(self.url, self._http.get("/weight_info"))

    def state(self) -> ServerState:
        """Health, weight version and pause state, for status displays; never raises."""
        if not self.health():
            return ServerState(url=self.url, healthy=False, error="not reachable or not healthy")
        try:
            return ServerState(
                url=self.url, healthy=True, weight_version=self.weight_version(), paused=self.is_paused()
            )
        except (ServerError, VersionUnknown, httpx.HTTPError) as exc:
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

    def load_adapter(self, name: str, adapter_path: Path) -> None:
        """Load a LoRA adapter directory under `name`, replacing in place the adapter of that name
        (``POST /v1/load_lora_adapter`` with ``load_inplace``; the server runs with ``--enable-lora``
        and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``: docs/lora.md)."""
        body = {"lora_name": name, "lora_path": str(adapter_path), "load_inplace": True}
        self._request("POST", "/v1/load_lora_adapter", json=body)

    def adapter_versions(self) -> dict[str, int | None]:
        """The LoRA adapters the server holds, by name, with the version each was loaded from: the
        name of the folder it was loaded from, which for rtrl's loads is the version's ``vN`` (the
        registry's download, or a weights agent's copy); None for any other folder (the identity
        adapter a server starts with). A server has one weight-version label, the global adapter's;
        this is how a tenant adapter's version is read back (docs/lora.md, An adapter per tenant)."""
        return adapter_versions_of(self._json("GET", "/v1/models"))

    def update_weight_version(self, version: int) -> None:
        self._request("POST", "/update_weight_version", json={"new_version": format_version(version)})

    def reset_prefix_cache(self) -> None:
        """Drop cached KV blocks computed with the old weights. vLLM refuses while blocks are held
        (running requests); the swap calls it paused, so a refusal is an error."""
        if not self._json("POST", "/reset_prefix_cache").get("success"):
            raise ServerError(
                self.url, "reset_prefix_cache refused (KV blocks still held by running requests)"
            )

    def requests_in_flight(self) -> int:
        """Requests the engine is running or has scheduled as waiting (``vllm:num_requests_running``
        + ``vllm:num_requests_waiting`` of its Prometheus page, as of the engine's last step).
        Requests held by a pause are not counted: a paused engine does not step."""
        text = self._request("GET", "/metrics", timeout=PROBE_TIMEOUT_S).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")):
                total += float(line.rsplit(" ", 1)[1])
        return int(total)

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
            raise ServerError(self.url, f"prompt_logprobs missing or misaligned in {str(choice)[:500]}")
        # entries[i] maps token id (as a string) -> {"logprob", "rank", ...}; it holds the actual
        # token plus the top-1, and entries[0] is None (the first token has no context).
        logprobs: list[float] = []
        for token_id, entry in zip(prompt_token_ids[1:], entries[1:], strict=True):
            if entry is None or str(token_id) not in entry:
                raise ServerError(self.url, f"no prompt logprob for token {token_id} in {entry!r}")
            logprobs.append(float(entry[str(token_id)]["logprob"]))
        return logprobs

    def greedy_logprobs(self, prompt_token_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        """A greedy continuation of exactly `max_tokens` tokens (EOS ignored) and the logprob of
        each: the probe of a server that must never see ``prompt_logprobs`` (LoRA on CPU kills the
        engine on them: docs/platform.md)."""
        # ignore_eos, not min_tokens: min_tokens masks EOS out of the logits, and the processed
        # logprobs would then be renormalised without it.
        body = {
            "model": self.model,
            "prompt": prompt_token_ids,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        choice = self._json("POST", "/v1/completions", json=body)["choices"][0]
        token_ids = choice.get("token_ids")
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if (
            not isinstance(token_ids, list)
            or not isinstance(logprobs, list)
            or len(token_ids) != len(logprobs)
        ):
            raise ServerError(self.url, f"token ids or logprobs missing or misaligned in {str(choice)[:500]}")
        return [int(t) for t in token_ids], [float(lp) for lp in logprobs]

    def sampled_logprobs(self, prompt: str, max_tokens: int) -> list[float]:
        """The behaviour logprob of each token of a greedy completion (what the gateway records)."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": 1,
        }
        choice = self._json("POST", "/v1/completions", json=body)["choices"][0]
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if not isinstance(logprobs, list) or not logprobs:
            raise ServerError(self.url, f"no token logprobs in {str(choice)[:500]}")
        return [float(lp) for lp in logprobs]

    def sample(
        self,
        prompts: list[str],
        *,
        max_tokens: int,
        n: int,
        seed: int,
        stop: list[str],
        sampling: Mapping[str, Any],
    ) -> list[list[Generation]]:
        """``n`` completions per prompt with the logprob of each sampled token (the eval gate's
        generations: text for the scorers, tokens and logprobs for its behaviour alarms)."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompts,
            "max_tokens": max_tokens,
            "n": n,
            "stop": stop,
            "seed": seed,
            "logprobs": 0,
            **sampling,
        }
        choices = self._json("POST", "/v1/completions", json=body)["choices"]
        if len(choices) != len(prompts) * n:
            raise ServerError(self.url, f"asked for {len(prompts)}x{n} completions, got {len(choices)}")
        result: list[list[Generation]] = [[] for _ in prompts]
        for choice in sorted(choices, key=lambda c: int(c["index"])):
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
            if not isinstance(logprobs, list):
                raise ServerError(self.url, f"no token logprobs in {str(choice)[:500]}")
            result[int(choice["index"]) // n].append(
                Generation(
                    text=str(choice["text"]),
                    logprobs=tuple(float(lp) if lp is not None else float("nan") for lp in logprobs),
                    finish_reason=choice.get("finish_reason"),
                )
            )
        return result

    def complete(
        self,
        prompts: list[str],
        *,
        max_tokens: int,
        n: int = 1,
        temperature: float = 1.0,
        seed: int | None = None,
        stop: list[str] | None = None,
        sampling: Mapping[str, Any] | None = None,
    ) -> list[list[str]]:
        """``n`` sampled completions per prompt, in prompt order: ``result[i][j]``; `sampling` adds
        parameters (top_p, top_k, min_p, penalties; a temperature there wins)."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompts,
            "max_tokens": max_tokens,
            "n": n,
            "temperature": temperature,
            "stop": stop or [],
            **(sampling or {}),
        }
        if seed is not None:
            body["seed"] = seed
        choices = self._json("POST", "/v1/completions", json=body)["choices"]
        if len(choices) != len(prompts) * n:
            raise ServerError(self.url, f"asked for {len(prompts)}x{n} completions, got {len(choices)}")
        result: list[list[str]] = [[] for _ in prompts]
        # Choices are numbered prompt-major: index = prompt_index * n + sample_index.
        for choice in sorted(choices, key=lambda c: int(c["index"])):
            result[int(choice["index"]) // n].append(str(choice["text"]))
        return result
