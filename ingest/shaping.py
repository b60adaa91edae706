"""Request and response shaping of the capture gateway: pure functions, no I/O.

The gateway asks vLLM for more than the client did (token ids, the sampled tokens' logprobs, the
rendered chat prompt) because the trainer needs exactly those tokens and the behaviour policy's
logprobs. The client must not notice: `shape_*_response` puts every extra field back to what vLLM
answers when it is not asked (``null``), so the client gets the upstream body it would have got
without the gateway, plus an ``rtrl`` object with the request id and policy version.

Capture metadata for multi-segment episodes comes from ``x-rtrl-*`` headers or an ``rtrl`` object
in the request body (removed before forwarding); `parse_capture` validates both. The tenant is not
among them: it comes from the caller's API key (ingest/auth.py), and a client that names one is
refused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from types import MappingProxyType
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError

from ingest.errors import IngestError
from schemas.events import (
    Id,
    InteractionEvent,
    Role,
    SamplingParams,
    new_id,
)
from schemas.sampling import apply_defaults
from schemas.versions import format_version

HEADER_REQUEST_ID = "x-rtrl-request-id"
CAPTURE_HEADERS = {
    "session_id": "x-rtrl-session-id",
    "episode_id": "x-rtrl-episode-id",
    "segment_index": "x-rtrl-segment-index",
    "role": "x-rtrl-role",
    "agent": "x-rtrl-agent",
    "trainable": "x-rtrl-trainable",
}
_ID = TypeAdapter(Id)
_NO_DEFAULTS: Mapping[str, Any] = MappingProxyType({})
_TRUE = {"true", "1", "yes"}
_FALSE = {"false", "0", "no"}


class RequestError(IngestError):
    """A client request the gateway refuses before calling vLLM (answered with `status_code`)."""

    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.status_code = status_code


@dataclass(frozen=True)
class Capture:
    """Episode metadata a client attached to a request (all optional)."""

    session_id: str | None = None
    episode_id: str | None = None  # as the client named it, before namespacing by tenant
    segment_index: int = 0
    role: Role = Role.policy
    agent: str | None = (
        None  # which agent of the episode made the call (a PARL sub-agent); None: the main one
    )
    trainable: bool | None = None  # None: the default for the role


@dataclass(frozen=True)
class Requested:
    """Which of the fields the gateway adds the client asked for itself (those are kept)."""

    logprobs: bool
    token_ids: bool
    prompt_text: bool = False


@dataclass(frozen=True)
class Generation:
    """What the model saw and produced in one upstream call."""

    prompt: str
    prompt_token_ids: list[int]
    completion: str
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    finish_reason: str | None


# ---- capture metadata -------------------------------------------------------------------------


def _parse_field(name: str, raw: Any) -> Any:
    if name == "tenant":
        raise RequestError("rtrl tenant is not accepted: the tenant comes from the API key", status_code=400)
    if name in ("session_id", "episode_id", "agent"):
        try:
            return _ID.validate_python(raw)
        except ValidationError as exc:
            raise RequestError(f"rtrl {name} {raw!r} is not a valid id: {exc.errors()[0]['msg']}") from None
    if name == "segment_index":
        try:
            value = int(raw)
        except (TypeError, ValueError):
            raise RequestError(f"rtrl segment_index must be an integer, got {raw!r}") from None
        if isinstance(raw, bool) or not 0 <= value <= 10_000:
            raise RequestError(f"rtrl segment_index must be an integer in [0, 10000], got {raw!r}")
        return value
    if name == "role":
        try:
            return Role(raw)
        except ValueError:
            raise RequestError(f"rtrl role must be one of {[r.value for r in Role]}, got {raw!r}") from None
    if name == "trainable":
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
            return raw.strip().lower() in _TRUE
        raise RequestError(f"rtrl trainable must be true or false, got {raw!r}")
    raise RequestError(f"unknown rtrl field {name!r}; known: {sorted(CAPTURE_HEADERS)}")


def parse_capture(headers: Mapping[str, str], body_rtrl: Any = None) -> Capture:
    """Capture metadata from ``x-rtrl-*`` headers and/or the body's ``rtrl`` object.

    A field given both ways must agree (a conflict is a client bug worth a 400, not a guess).
    """
    values: dict[str, Any] = {}
    lowered = {k.lower(): v for k, v in headers.items()}
    if "x-rtrl-tenant" in lowered:
        _parse_field("tenant", lowered["x-rtrl-tenant"])
    for name, header in CAPTURE_HEADERS.items():
        if header in lowered:
            values[name] = _parse_field(name, lowered[header])
    if body_rtrl is not None:
        if not isinstance(body_rtrl, dict):
            raise RequestError(f"the body's rtrl field must be an object, got {type(body_rtrl).__name__}")
        for name, raw in body_rtrl.items():
            value = _parse_field(name, raw)
            if name in values and values[name] != value:
                raise RequestError(
                    f"rtrl {name} is {values[name]!r} in the {CAPTURE_HEADERS[name]} header "
                    f"but {value!r} in the body"
                )
            values[name] = value
    capture = Capture(**values)
    if capture.role == Role.subagent and capture.trainable:
        raise RequestError("subagent segments are frozen observations: trainable must be false")
    return capture


def trainable_for(capture: Capture) -> bool:
    """The trainable flag of a segment: explicit, else everything but subagent segments."""
    if capture.trainable is not None:
        return capture.trainable
    return capture.role != Role.subagent


# ---- requests ---------------------------------------------------------------------------------


def _common_checks(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError(f"request body must be a JSON object, got {type(body).__name__}")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise RequestError(f"stream must be true or false, got {body['stream']!r}")
    for field in ("n", "best_of"):
        if body.get(field) not in (None, 1):
            # Feedback names a request, not a choice: with several choices it could not say which.
            raise RequestError(
                f"{field}={body[field]!r} is not supported: the gateway captures one choice per request"
            )
    return body


def lora_request(forward: dict[str, Any], served_model_name: str) -> None:
    """Make a forwarded body safe and attributable on a fleet serving LoRA adapters (docs/lora.md),
    or raise RequestError:

    * the model is the adapter under `served_model_name`: one left out is set to it (vLLM would
      answer with the base model, its first served name, while the event recorded the adapter's
      version), and another name is refused (the base model is not served through the gateway);
    * no prompt logprobs (`prompt_logprobs`, or `echo` with the logprobs the gateway always asks
      for): vLLM's CPU LoRA path kills its engine on them (docs/platform.md).
    """
    model = forward.setdefault("model", served_model_name)
    if model != served_model_name:
        raise RequestError(
            f"model {model!r} is not served here; this gateway serves {served_model_name!r}", status_code=404
        )
    if forward.get("prompt_logprobs") is not None or forward.get("echo"):
        raise RequestError(
            "prompt_logprobs and echo are not served while the fleet serves LoRA adapters "
            "(trainer.adapter=lora): vLLM's LoRA path on this backend cannot compute them"
        )


def prepare_completion_request(
    body: Any, defaults: Mapping[str, Any] = _NO_DEFAULTS
) -> tuple[dict[str, Any], Requested, Any]:
    """(body to forward to vLLM, what the client asked for, the body's rtrl object).

    `defaults` are the model's sampling defaults (`schemas.sampling.generation_defaults`): each
    one the client left out is written into the forwarded body, so the body records exactly
    what vLLM samples with."""
    body = _common_checks(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise RequestError("prompt must be one string: batched or token-id prompts are not captured yet")
    forward = {k: v for k, v in body.items() if k != "rtrl"}
    requested = Requested(
        logprobs=forward.get("logprobs") is not None,
        token_ids=bool(forward.get("return_token_ids")),
    )
    if not requested.logprobs:
        # 0: the sampled token's logprob and no alternatives, ~0.6 ms cheaper per 8-token completion
        # than 1 on vLLM's CPU backend (docs/platform.md).
        forward["logprobs"] = 0
    forward["return_token_ids"] = True
    apply_defaults(forward, defaults)
    return forward, requested, body.get("rtrl")


def prepare_chat_request(
    body: Any, defaults: Mapping[str, Any] = _NO_DEFAULTS
) -> tuple[dict[str, Any], Requested, Any]:
    """(body to forward to vLLM, what the client asked for, the body's rtrl object); `defaults`
    as in `prepare_completion_request`."""
    body = _common_checks(body)
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise RequestError("messages must be a non-empty list")
    forward = {k: v for k, v in body.items() if k != "rtrl"}
    requested = Requested(
        logprobs=bool(forward.get("logprobs")),
        token_ids=bool(forward.get("return_token_ids")),
        prompt_text=bool(forward.get("return_prompt_text")),
    )
    if not requested.logprobs:
        forward["logprobs"] = True
        forward["top_logprobs"] = 0
    forward["return_token_ids"] = True
    forward["return_prompt_text"] = True
    apply_defaults(forward, defaults)
    return forward, requested, body.get("rtrl")


def sampling_params(
    body: Mapping[str, Any], logprobs_mode: Literal["raw", "processed"] = "processed"
) -> SamplingParams:
    """The sampling parameters of a forwarded request (after `prepare_*` wrote the model's
    defaults into it; vLLM's neutral defaults where neither set one), and what kind of logprobs
    the server reports (`settings.vllm.logprobs_mode`)."""
    stop = body.get("stop")
    # vLLM's chat endpoint takes max_completion_tokens over max_tokens when both are set.
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    fields = {
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "top_k": body.get("top_k"),
        "min_p": body.get("min_p"),
        "repetition_penalty": body.get("repetition_penalty"),
        "presence_penalty": body.get("presence_penalty"),
        "frequency_penalty": body.get("frequency_penalty"),
        "max_tokens": max_tokens,
        "seed": body.get("seed"),
        "stop": [stop] if isinstance(stop, str) else stop,
        "logprobs_mode": logprobs_mode,
    }
    return SamplingParams.model_validate({k: v for k, v in fields.items() if v is not None})


# ---- responses --------------------------------------------------------------------------------


def _shallow(upstream: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a response deep enough to null top-level and per-choice fields without touching
    `upstream` (which the capture reads later): the body and each choice, not their contents."""
    body = dict(upstream)
    choices = body.get("choices")
    if isinstance(choices, list):
        body["choices"] = [dict(c) if isinstance(c, dict) else c for c in choices]
    return body


def _null(mapping: dict[str, Any], key: str) -> None:
    # vLLM answers these fields as null when they were not asked for: restore exactly that.
    if key in mapping:
        mapping[key] = None


def shape_completion_response(upstream: Mapping[str, Any], requested: Requested) -> dict[str, Any]:
    """The upstream /v1/completions body without the fields the gateway (not the client) asked for."""
    body = _shallow(upstream)
    for choice in body.get("choices", []):
        if not requested.logprobs:
            _null(choice, "logprobs")
        if not requested.token_ids:
            _null(choice, "token_ids")
            _null(choice, "prompt_token_ids")
    return body


def shape_chat_response(upstream: Mapping[str, Any], requested: Requested) -> dict[str, Any]:
    """The upstream /v1/chat/completions body without the fields the gateway asked for."""
    body = _shallow(upstream)
    for choice in body.get("choices", []):
        if not requested.logprobs:
            _null(choice, "logprobs")
        if not requested.token_ids:
            _null(choice, "token_ids")
    if not requested.token_ids:
        _null(body, "prompt_token_ids")
    if not requested.prompt_text:
        _null(body, "prompt_text")
    return body


def with_rtrl(body: dict[str, Any], request_id: str, policy_version: str) -> dict[str, Any]:
    """Add the gateway's ``rtrl`` object (the request id feedback must name, the serving version)."""
    body["rtrl"] = {"request_id": request_id, "policy_version": policy_version}
    return body


def _only_choice(upstream: Mapping[str, Any]) -> Mapping[str, Any]:
    choices = upstream.get("choices")
    if not isinstance(choices, list) or len(choices) != 1:
        raise ValueError(f"expected exactly one choice in the upstream response, got {choices!r:.200}")
    choice: Mapping[str, Any] = choices[0]
    return choice


def extract_completion(upstream: Mapping[str, Any], forward: Mapping[str, Any]) -> Generation:
    """Prompt/completion tokens and behaviour logprobs of a /v1/completions response.

    Raises ValueError when vLLM did not return what was asked (the caller dead-letters it).
    """
    choice = _only_choice(upstream)
    token_ids = list(choice.get("token_ids") or [])
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    if logprobs is None:
        raise ValueError("upstream returned no token_logprobs")
    # With echo=true vLLM prepends the prompt's tokens (the first with a null logprob); the
    # sampled tokens are always the last len(token_ids) entries.
    completion_logprobs = list(logprobs[len(logprobs) - len(token_ids) :]) if token_ids else []
    prompt = str(forward["prompt"] if isinstance(forward["prompt"], str) else forward["prompt"][0])
    text = str(choice.get("text") or "")
    if forward.get("echo") and text.startswith(prompt):
        text = text[len(prompt) :]
    return Generation(
        prompt=prompt,
        prompt_token_ids=list(choice.get("prompt_token_ids") or []),
        completion=text,
        completion_token_ids=token_ids,
        completion_logprobs=completion_logprobs,
        finish_reason=choice.get("finish_reason"),
    )


def extract_chat(upstream: Mapping[str, Any]) -> Generation:
    """Prompt/completion tokens and behaviour logprobs of a /v1/chat/completions response."""
    choice = _only_choice(upstream)
    content = (choice.get("logprobs") or {}).get("content")
    if content is None:
        raise ValueError("upstream returned no logprobs content")
    message = choice.get("message") or {}
    return Generation(
        prompt=str(upstream.get("prompt_text") or ""),
        prompt_token_ids=list(upstream.get("prompt_token_ids") or []),
        completion=_answer_text(message),
        completion_token_ids=list(choice.get("token_ids") or []),
        completion_logprobs=[entry["logprob"] for entry in content],
        finish_reason=choice.get("finish_reason"),
    )


def _answer_text(message: Mapping[str, Any]) -> str:
    """The answer's text; for an answer that is tool calls only (vLLM parsed the model's text into
    ``tool_calls`` and left ``content`` null), the calls as JSON (name and arguments of each), so the
    event says what the model did. The tokens trained on are the completion's ids either way."""
    content = message.get("content")
    calls = message.get("tool_calls")
    if content or not isinstance(calls, list) or not calls:
        return str(content or "")
    return json.dumps([c.get("function") for c in calls if isinstance(c, Mapping)], ensure_ascii=False)


def build_interaction(
    *,
    request_id: str,
    tenant: str,
    episode_id: str,
    capture: Capture,
    model: str,
    policy_version: int,
    generation: Generation,
    sampling: SamplingParams,
    straddled: bool,
    created_at: datetime,
    truncated: bool = False,
    untrainable_reason: str | None = None,
) -> InteractionEvent:
    """The InteractionEvent of one served call (`episode_id` already in the tenant's namespace).
    Raises pydantic's ValidationError on bad data."""
    return InteractionEvent(
        event_id=new_id(),
        request_id=request_id,
        session_id=capture.session_id,
        tenant=tenant,
        created_at=created_at,
        model=model,
        policy_version=format_version(policy_version),
        prompt=generation.prompt,
        prompt_token_ids=generation.prompt_token_ids,
        completion=generation.completion,
        completion_token_ids=generation.completion_token_ids,
        completion_logprobs=generation.completion_logprobs,
        finish_reason=generation.finish_reason,
        sampling=sampling,
        episode_id=episode_id,
        segment_index=capture.segment_index,
        role=capture.role,
        agent=capture.agent,
        # A call that straddled a weight swap may mix tokens of two policies, so its logprobs are
        # not the behaviour policy of any one version: keep it (stored, auditable), never train on it.
        # A truncated stream's completion is a prefix the policy did not choose to end there.
        # Sampling the trainer cannot reproduce (`schemas.sampling.unreproducible`): its behaviour
        # logprobs are not those of any policy the trainer can compute.
        trainable=trainable_for(capture) and not straddled and not truncated and untrainable_reason is None,
        untrainable_reason=untrainable_reason,
        truncated=truncated,
    )
