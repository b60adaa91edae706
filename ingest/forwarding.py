"""What of a tenant's completion request reaches vLLM: pure checks, no I/O.

vLLM's OpenAI server takes far more than OpenAI's API: prompt logprobs (an answer of prompt length
x 21 entries, read whole by the gateway), ``ignore_eos`` and ``min_tokens`` (a slot held for the
whole context), guided decoding (a grammar compiled per request), a client's own chat template,
image and audio parts (a multimodal server fetches their URLs), its own ``cache_salt``. The gateway
forwarded all of it (issue 37). `RequestPolicy.apply` runs on the client's body before
`ingest.shaping.prepare_*` adds the fields the gateway itself asks vLLM for, and lets through only:

* the fields of ``gateway.forwarded_fields`` that belong to the endpoint (`CHAT_ONLY`,
  `COMPLETIONS_ONLY`), the gateway's own (`GATEWAY_FIELDS`), and a penalty at its neutral value;
  any other field is a 400 naming it and the setting; a null field is dropped (vLLM reads null as
  unset, and some clients send every field they know);
* chat messages whose content is text: a string, or parts of type ``text``;
* at most ``gateway.max_tokens_per_request`` tokens to generate, written into a request that names
  no limit (the smaller of that and ``vllm.max_model_len``: vLLM refuses a limit above its
  context), and at most ``gateway.max_top_logprobs`` alternatives per token;
* the served model, ``vllm.served_model_name``: one left out is set to it, another is a 404 as for
  ``GET /v1/models/{id}`` (vLLM would answer with its first served name, or serve a name the event
  should not record); a tenant with an adapter of its own is sent to its adapter instead, whether
  it names the served model, its adapter or none (docs/lora.md, An adapter per tenant);

and adds the tenant's prefix-cache salt (`cache_salt`): vLLM hashes it into the first block of a
prompt, so two tenants never share cached blocks and one cannot time another's prompts. A client
that sends its own is refused, not overwritten: a client that salts for its own reasons should
learn that its salt is not the one used.

Penalties (presence, frequency, repetition) are refused unless the operator lists them: vLLM
applies them cheaply, but the trainer reproduces them (`serving.sampler`) on a path that builds
several (positions x vocabulary) tensors per chunk for every micro-batch holding one penalised row,
and a cycle that runs out of memory on it fails and is retried on the same batch. Their neutral
values change nothing and are accepted, because OpenAI clients send ``presence_penalty: 0``.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ingest.shaping import RequestError
from schemas.settings import Settings

CHAT_ONLY = frozenset(
    {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"}
)
COMPLETIONS_ONLY = frozenset({"prompt", "echo", "suffix", "best_of"})
# Read or set by the gateway itself (ingest/shaping.py): always accepted, whatever the setting says.
GATEWAY_FIELDS = {
    True: frozenset({"rtrl", "return_token_ids", "return_prompt_text"}),
    False: frozenset({"rtrl", "return_token_ids"}),
}
NEUTRAL_PENALTIES: Mapping[str, float] = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
}
# Why a field is refused, where one sentence helps the client more than the setting's name.
WHY_NOT: Mapping[str, str] = {
    **{name: f"penalties other than {value:g} are not served" for name, value in NEUTRAL_PENALTIES.items()},
    "prompt_logprobs": "prompt logprobs are not served",
    "ignore_eos": "generations end where the model ends them",
    "min_tokens": "generations end where the model ends them",
}
_SALT_CONTEXT = b"rtrl prefix-cache salt"


@dataclass(frozen=True)
class RequestPolicy:
    """The limits `apply` checks, from the gateway's settings (`from_settings`)."""

    fields: frozenset[str]  # gateway.forwarded_fields
    max_tokens: int  # gateway.max_tokens_per_request
    default_max_tokens: int  # written into a request without a limit
    max_top_logprobs: int
    model: str  # vllm.served_model_name
    salt_key: bytes

    @classmethod
    def from_settings(cls, settings: Settings, secret: bytes) -> RequestPolicy:
        """The policy of `settings`; `secret` is the gateway's (the same on every replica, so a
        tenant's salt is too, and its prefix cache is shared across replicas)."""
        gateway = settings.gateway
        return cls(
            fields=frozenset(gateway.forwarded_fields),
            max_tokens=gateway.max_tokens_per_request,
            default_max_tokens=min(gateway.max_tokens_per_request, settings.vllm.max_model_len),
            max_top_logprobs=gateway.max_top_logprobs,
            model=settings.vllm.served_model_name,
            # A key of its own: a salt seen in vLLM's logs says nothing of the request ids' secret.
            salt_key=hmac.new(secret, _SALT_CONTEXT, hashlib.sha256).digest(),
        )

    def cache_salt(self, tenant: str) -> str:
        """The tenant's prefix-cache salt: 64 hex digits, a keyed hash of the tenant."""
        return hmac.new(self.salt_key, tenant.encode(), hashlib.sha256).hexdigest()

    def apply(self, body: Any, chat: bool, tenant: str, served: str | None = None) -> dict[str, Any]:
        """The client's `body` as the gateway forwards it (a new dict), or RequestError. `served`: the
        tenant's own adapter (`Gateway.served_name`), which its requests go to whether they name it,
        the served model, or none; None: the served model."""
        if not isinstance(body, dict):
            raise RequestError(f"request body must be a JSON object, got {type(body).__name__}")
        forward = {name: value for name, value in body.items() if self._accepts(name, value, chat)}
        if chat:
            _text_only(forward.get("messages"))
        self._budget(forward, chat)
        forward["model"] = _model(forward.get("model", self.model), self.model, served or self.model)
        forward["cache_salt"] = self.cache_salt(tenant)
        return forward

    def _accepts(self, name: str, value: Any, chat: bool) -> bool:
        """Whether `name` is forwarded (False: dropped); raises RequestError when it is refused."""
        if name in GATEWAY_FIELDS[chat]:
            return True
        if value is None:
            return False  # vLLM reads null as unset; the model's defaults fill it (ingest/shaping.py)
        if name == "cache_salt":
            raise RequestError(
                "field 'cache_salt' is not accepted: the gateway salts the prefix cache of each tenant itself"
            )
        path = "/v1/chat/completions" if chat else "/v1/completions"
        if name in (COMPLETIONS_ONLY if chat else CHAT_ONLY):
            raise RequestError(f"field {name!r} is not a field of {path}")
        if name in self.fields:
            return True
        neutral = NEUTRAL_PENALTIES.get(name)
        if neutral is not None and _number(value) and value == neutral:
            return True
        why = WHY_NOT.get(name)
        raise RequestError(
            f"field {name!r} is not accepted by this gateway (gateway.forwarded_fields)"
            + (f": {why}" if why else "")
        )

    def _budget(self, forward: dict[str, Any], chat: bool) -> None:
        limits = ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",)
        for name in limits:
            value = forward.get(name)
            if value is None:
                continue
            if not _integer(value):
                raise RequestError(f"{name} must be an integer, got {value!r}")
            if value > self.max_tokens:
                raise RequestError(
                    f"{name}={value} is over this gateway's budget of {self.max_tokens} tokens a request "
                    "(gateway.max_tokens_per_request)"
                )
        if all(forward.get(name) is None for name in limits):
            # vLLM's default is the rest of the context; the chat field, since max_tokens is deprecated there.
            forward[limits[-1]] = self.default_max_tokens
        name = "top_logprobs" if chat else "logprobs"
        value = forward.get(name)
        if value is None or (not chat and value is False):
            return
        if not _integer(value) or value > self.max_top_logprobs:
            raise RequestError(
                f"{name} must be an integer of at most {self.max_top_logprobs}, got {value!r} "
                "(gateway.max_top_logprobs)"
            )


def _integer(value: Any) -> bool:
    # Strict: vLLM's validation would read "100000" or 1e5 as 100000, past any check made here.
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _text_only(messages: Any) -> None:
    """Refuse a chat message part that is not text (images, audio, video, files: a multimodal server
    fetches their URLs, from inside the cluster)."""
    if not isinstance(messages, list):
        return  # `ingest.shaping.prepare_chat_request` says what is wrong with it
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{i}] must be an object, got {type(message).__name__}")
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise RequestError(f"messages[{i}].content must be a string or a list of text parts")
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise RequestError(
                    f"messages[{i}].content[{j}] is a {kind!r} part: this gateway forwards text parts only"
                )


def _model(asked: Any, model: str, served: str) -> str:
    """The model a request goes to: `served` (the tenant's adapter, else `model`) when it asks for
    `model` or `served`; any other name, another tenant's adapter included, is a 404."""
    if asked not in (model, served):
        raise RequestError(f"model {asked!r} is not served here; this gateway serves {model!r}", 404)
    return served
