"""What every simulated client of the gateway shares: the connection, the calls, feedback, the pool.

The one-call users (simulation/users.py) and the agents (simulation/agents.py) talk to the gateway
as an application would: model calls with the official ``openai`` client and a tenant API key,
feedback as JSON lists posted to ``/v1/feedback`` with the same key. `open_gateway` opens both
clients for one run and closes them after it; `Gateway.complete`, `Gateway.chat` and (with tools)
`Gateway.converse` make one call
and read what the gateway adds to it (the ``x-rtrl-request-id`` header, the serving policy version),
raising `CallFailed` for a call that failed or an answer that is no completion, so that one failure
fails one request or one episode, never the run; `fan_out` runs a run's requests or episodes on a
thread pool. `simulation_key` makes the tenant key of a simulation (``rtrl simulate``, the demo).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

import httpx

from schemas.clock import wait_until
from schemas.events import FeedbackSignal, new_id
from schemas.settings import Settings

if TYPE_CHECKING:
    from openai import OpenAI

    from store import Store

TENANT = "sim"  # the tenant of the keys `rtrl simulate` and the demo make for their users
MAX_ERRORS_KEPT = 20  # failures a report keeps, for the operator

T = TypeVar("T")
Item = TypeVar("Item")


class CallFailed(Exception):
    """A model call failed, or its answer was no completion of an rtrl gateway: the message says how."""


@dataclass(frozen=True)
class Reply:
    """One answered call: the completion's text, the gateway's request id and the policy version that served it."""

    prompt: str
    text: str
    request_id: str
    version: str | None
    # The tool calls of a chat answer, as the client got them (OpenAI's shape: id, type, function
    # with name and its arguments as a JSON string); () for an answer without.
    tool_calls: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class Gateway:
    """One run's connection to the gateway: `openai` for the model calls, `http` for feedback, both
    with the run's key; `model` is the served model's name."""

    base: str
    model: str
    openai: OpenAI
    http: httpx.Client

    def complete(
        self, prompt: str, *, max_tokens: int, stop: Sequence[str], seed: int, headers: dict[str, str]
    ) -> Reply:
        """A /v1/completions call of `prompt`, sampled at temperature 1.0 with `seed`."""
        return self._call(
            prompt,
            lambda: self.openai.completions.with_raw_response.create(
                model=self.model,
                prompt=prompt,
                max_tokens=max_tokens,
                stop=list(stop),
                temperature=1.0,
                seed=seed,
                extra_headers=headers,
            ),
            chat=False,
        )

    def chat(
        self,
        prompt: str,
        question: str,
        *,
        max_tokens: int,
        stop: Sequence[str],
        seed: int,
        headers: dict[str, str],
    ) -> Reply:
        """A /v1/chat/completions call of `question` as one user message, under the model's chat template
        and sampling defaults; `prompt` is what the reply is judged against."""
        return self._call(
            prompt,
            lambda: self.openai.chat.completions.with_raw_response.create(
                model=self.model,
                messages=[{"role": "user", "content": question}],
                max_tokens=max_tokens,
                stop=list(stop),
                seed=seed,
                extra_headers=headers,
            ),
            chat=True,
        )

    def converse(
        self,
        prompt: str,
        messages: list[dict[str, Any]],
        tools: Sequence[dict[str, Any]],
        *,
        max_tokens: int,
        seed: int,
        headers: dict[str, str],
    ) -> Reply:
        """A /v1/chat/completions call of a whole conversation with `tools` (tool_choice auto: the model
        decides to call one, so the call stays trainable), under the model's chat template and sampling
        defaults; the reply carries the tool calls vLLM parsed out of the model's text."""
        return self._call(
            prompt,
            lambda: self.openai.chat.completions.with_raw_response.create(
                model=self.model,
                messages=cast(Any, messages),  # OpenAI's TypedDicts; these are plain dicts of that shape
                tools=cast(Any, list(tools)),
                tool_choice="auto",
                max_tokens=max_tokens,
                seed=seed,
                extra_headers=headers,
            ),
            chat=True,
        )

    def _call(self, prompt: str, create: Callable[[], Any], chat: bool) -> Reply:
        from openai import OpenAIError

        try:
            raw = create()
            completion = raw.parse()
        except OpenAIError as exc:
            raise CallFailed(repr(exc)) from exc
        request_id = raw.headers.get("x-rtrl-request-id")
        if not request_id:
            raise CallFailed("no x-rtrl-request-id header (not an rtrl gateway?)")
        try:  # the client parses leniently: an answer without the fields a completion has fails here
            choice = completion.choices[0]
            text = (choice.message.content or "") if chat else choice.text
            calls = (
                tuple(c.model_dump(mode="json") for c in (choice.message.tool_calls or ())) if chat else ()
            )
            version = ((completion.model_extra or {}).get("rtrl") or {}).get("policy_version")
        except (AttributeError, IndexError, TypeError) as exc:
            raise CallFailed(f"not a completion ({exc!r}): {raw.http_response.text[:200]!r}") from exc
        return Reply(prompt=prompt, text=text, request_id=request_id, version=version, tool_calls=calls)

    def send_feedback(self, events: list[dict[str, Any]]) -> None:
        """POST `events` (each with its event_id) as one list; an httpx.HTTPError when it is refused."""
        response = self.http.post(
            f"{self.base}/v1/feedback",
            content=json.dumps(events),
            headers={"content-type": "application/json"},
        )
        response.raise_for_status()


@contextmanager
def open_gateway(settings: Settings, gateway_url: str, api_key: str) -> Iterator[Gateway]:
    """The gateway at `gateway_url` with `api_key` (any string when its auth is open), no retries, a
    timeout 10 s past vLLM's; both clients closed when the block ends."""
    from openai import OpenAI

    base = gateway_url.rstrip("/")
    timeout = settings.vllm.request_timeout_s + 10
    client = OpenAI(base_url=f"{base}/v1", api_key=api_key, max_retries=0, timeout=timeout)
    http = httpx.Client(timeout=timeout, headers={"authorization": f"Bearer {api_key}"})
    try:
        yield Gateway(base=base, model=settings.vllm.served_model_name, openai=client, http=http)
    finally:
        client.close()
        http.close()


def fan_out(work: Callable[[int, Item], T], items: Sequence[Item], concurrency: int, name: str) -> list[T]:
    """`work(index, item)` for every item, `concurrency` at a time on threads named `name`-N, in order."""
    with ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix=name) as pool:
        return list(pool.map(work, range(len(items)), items))


@contextmanager
def simulation_key(store: Store, gateway_url: str, timeout_s: float = 60.0) -> Iterator[str]:
    """A key of tenant `TENANT` for one simulation, revoked when the block ends. Waits until the
    gateway has loaded it (it reloads its keys every ``gateway.keys_refresh_s``)."""
    # Unlimited: the key stands for a crowd of simulated users, not one client a rate limit is for.
    record, key = store.create_api_key(role="tenant", tenant=TENANT, name="simulated users", rate_per_s=0)
    try:

        def known() -> bool:
            try:
                response = httpx.get(
                    f"{gateway_url.rstrip('/')}/v1/whoami",
                    headers={"authorization": f"Bearer {key}"},
                    timeout=5,
                )
            except httpx.HTTPError:
                return False
            return response.status_code == 200

        wait_until(
            known, timeout_s=timeout_s, interval_s=0.5, what="the gateway has not loaded the new API key"
        )
        yield key
    finally:
        store.revoke_api_key(record.id)


def feedback_body(request_id: str, signal: FeedbackSignal) -> dict[str, Any]:
    """One feedback event as a client posts it to /v1/feedback: its kind, value and any text."""
    body: dict[str, Any] = {
        "event_id": new_id(),
        "request_id": request_id,
        "kind": signal.kind.value,
        "value": signal.value,
    }
    if signal.text is not None:
        body["text"] = signal.text
    return body
