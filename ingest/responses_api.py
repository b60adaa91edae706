"""OpenAI's Responses API (``POST /v1/responses``) over vLLM's chat completions: pure translation.

The gateway does not serve the Responses API natively: `to_chat` turns a Responses request into
the chat-completions request it amounts to, which then takes exactly the chat path
(`ingest.completions`: the forwarding policy, the sampling defaults, token ids and behaviour
logprobs asked of vLLM, the capture), so a Responses call is captured as the equivalent chat
completion would be: the same `InteractionEvent`, the prompt token ids as vLLM rendered the
translated messages. `response_body` turns vLLM's chat answer back into a Response object;
`ingest.responses_stream.ResponsesStream` does the same for a stream, event by event.

rtrl keeps no server-side state, so what needs it is refused with a 400 naming the field
(`previous_response_id`, `conversation`, ``background: true``, item references), as are what
vLLM cannot do through a chat request (built-in tools, image/file/audio inputs, reasoning options)
and values rtrl cannot honour. ``store`` is accepted and ignored (OpenAI defaults it to true): the
response is never stored, only captured. docs/runbooks/gateway.md, The Responses API.

Translation, field by field (Responses -> chat):

* ``instructions`` -> a system message first; ``input`` (a string: one user message; a list of
  items) -> ``messages``: messages of role user/system/developer (developer becomes system, as
  OpenAI does for models without a developer role)/assistant with a string or text parts
  (``input_text``, ``output_text``, ``refusal``); ``function_call`` items join the assistant
  message before them (or make one) as ``tool_calls``; ``function_call_output`` items become
  ``tool`` messages;
* ``tools`` (``{type: function, name, description, parameters, strict}``) -> chat's nested
  ``{type: function, function: {...}}``; ``tool_choice`` (``auto``/``none``/``required`` or
  ``{type: function, name}``), ``parallel_tool_calls``, ``max_output_tokens`` -> ``max_tokens``,
  ``temperature``, ``top_p``, ``user``, ``stream``, ``rtrl`` as they are;
* ``metadata`` is echoed in the response, not sent to vLLM.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ingest.shaping import RequestError

MAX_INPUT_ITEMS = 4096  # past it, a 400 before any translation work (a body is also bounded in bytes)
MAX_TOOLS = 256
# Accepted and passed to the chat request under the same name (`seed`: an rtrl extension, as on chat).
_SAME = ("model", "temperature", "top_p", "user", "stream", "parallel_tool_calls", "rtrl", "seed")
# Accepted; nothing to do with them (docs/runbooks/gateway.md says why).
_IGNORED = frozenset(
    {
        "store",
        "include",
        "truncation",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "stream_options",
    }
)
# Refused whenever set (not null), with the reason.
_REFUSED: Mapping[str, str] = {
    "previous_response_id": "rtrl keeps no server-side state: send the whole conversation in `input`",
    "conversation": "rtrl keeps no server-side state: send the whole conversation in `input`",
    "prompt": "stored prompt templates are not served: send the prompt in `input`",
    "reasoning": "reasoning options are not served through the chat completions of vLLM",
    "max_tool_calls": "the number of tool calls is not limited by rtrl: leave it out",
    "top_logprobs": "logprobs are not returned through the Responses API of rtrl",
    "background": "background responses need server-side state, which rtrl does not keep",
}
_KNOWN = frozenset(
    {*_SAME, *_IGNORED, *_REFUSED, "input", "instructions", "tools", "tool_choice", "max_output_tokens"}
    | {"metadata", "text"}
)
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


@dataclass(frozen=True)
class Echo:
    """What the Response object repeats of its request (OpenAI's responses echo their parameters)."""

    model: str | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None


def to_chat(body: Any) -> tuple[dict[str, Any], Echo]:
    """(the chat-completions request `body` amounts to, what its response repeats), or RequestError
    (400) naming the field rtrl cannot honour."""
    if not isinstance(body, dict):
        raise RequestError(f"request body must be a JSON object, got {type(body).__name__}")
    _refuse_unserved(body)
    chat: dict[str, Any] = {name: body[name] for name in _SAME if body.get(name) is not None}
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError("instructions must be a string")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    messages.extend(input_messages(body.get("input")))
    chat["messages"] = messages
    tools = [_tool(i, tool) for i, tool in enumerate(_list(body, "tools", MAX_TOOLS))]
    if tools:
        chat["tools"] = tools
    tool_choice = body.get("tool_choice")
    if tool_choice is not None:
        chat["tool_choice"] = _tool_choice(tool_choice)
    limit = body.get("max_output_tokens")
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise RequestError(f"max_output_tokens must be a positive integer, got {limit!r:.50}")
        chat["max_tokens"] = limit  # its budget is checked as chat's (ingest/forwarding.py)
    metadata = body.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise RequestError("metadata must be an object of strings")
    echo = Echo(
        model=body.get("model") if isinstance(body.get("model"), str) else None,
        instructions=instructions,
        tools=list(body.get("tools") or []),
        tool_choice="auto" if tool_choice is None else tool_choice,
        parallel_tool_calls=body.get("parallel_tool_calls") is not False,
        temperature=_number_or_none(body.get("temperature")),
        top_p=_number_or_none(body.get("top_p")),
        max_output_tokens=limit,
        metadata=metadata,
        user=body.get("user") if isinstance(body.get("user"), str) else None,
    )
    return chat, echo


def _refuse_unserved(body: dict[str, Any]) -> None:
    for name, value in body.items():
        if name not in _KNOWN:
            raise RequestError(f"field {name!r} is not a field of /v1/responses that rtrl serves")
        if value is None or (name == "background" and value is False):
            continue
        why = _REFUSED.get(name)
        if why is not None:
            raise RequestError(f"field {name!r} is not accepted: {why}")
    text = body.get("text")
    if text is not None:
        form = text.get("format") if isinstance(text, dict) else None
        kind = (form or {}).get("type", "text") if isinstance(form, dict | None) else form
        if not isinstance(text, dict) or kind != "text" or set(text) - {"format", "verbosity"}:
            raise RequestError(
                f"field 'text' is not accepted with format {kind!r}: structured outputs are not served "
                "through /v1/responses (plain text only)"
            )


def _list(body: Mapping[str, Any], name: str, most: int) -> list[Any]:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list):
        raise RequestError(f"{name} must be a list, got {type(value).__name__}")
    if len(value) > most:
        raise RequestError(f"{name} has {len(value)} entries; at most {most} are accepted")
    return value


def _number_or_none(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


# ---- input ---------------------------------------------------------------------------------------


def input_messages(value: Any) -> list[dict[str, Any]]:
    """The chat messages of a Responses ``input``: a string (one user message) or a list of items."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if value is None:
        raise RequestError("input is required: a string or a list of input items")
    items = _list({"input": value}, "input", MAX_INPUT_ITEMS)
    if not items:
        raise RequestError("input must not be empty")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise RequestError(f"input[{i}] must be an object, got {type(item).__name__}")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(i, item))
        elif kind == "function_call":
            _function_call(i, item, messages)
        elif kind == "function_call_output":
            messages.append(_function_call_output(i, item))
        elif kind == "item_reference":
            raise RequestError(
                f"input[{i}] is an item_reference: rtrl keeps no server-side state, send the item itself"
            )
        else:
            raise RequestError(
                f"input[{i}] is a {kind!r} item: rtrl serves message, function_call and "
                "function_call_output items only"
            )
    return messages


def _message(i: int, item: Mapping[str, Any]) -> dict[str, Any]:
    role = _ROLES.get(item["role"]) if isinstance(item.get("role"), str) else None
    if role is None:
        raise RequestError(f"input[{i}].role must be one of {sorted(_ROLES)}, got {item.get('role')!r}")
    return {"role": role, "content": _text(f"input[{i}].content", item.get("content"))}


def _text(where: str, content: Any) -> str:
    """A message's content as one string: text parts joined (chat templates render text parts so)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        part = part if isinstance(part, dict) else {"type": type(part).__name__}
        kind = part.get("type")
        text = part.get("refusal" if kind == "refusal" else "text")
        if (kind in _TEXT_PARTS or kind == "refusal") and isinstance(text, str):
            texts.append(text)
        else:
            raise RequestError(
                f"{where}[{j}] is a {kind!r} part: rtrl serves text only (input_text, output_text), "
                "not images, files or audio"
            )
    return "".join(texts)


def _string(where: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise RequestError(f"{where} must be a non-empty string")
    return value


def _function_call(i: int, item: Mapping[str, Any], messages: list[dict[str, Any]]) -> None:
    """A tool call the model made: joins the assistant message just before it, as vLLM answered
    them (content and tool calls in one message), so the prompt renders as the model saw it."""
    if not isinstance(item.get("arguments"), str):
        raise RequestError(f"input[{i}].arguments must be a string (the call's JSON arguments)")
    call = {
        "id": _string(f"input[{i}].call_id", item.get("call_id")),
        "type": "function",
        "function": {"name": _string(f"input[{i}].name", item.get("name")), "arguments": item["arguments"]},
    }
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
        if last["content"] == "":
            last["content"] = None
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _function_call_output(i: int, item: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "role": "tool",
        "tool_call_id": _string(f"input[{i}].call_id", item.get("call_id")),
        "content": _text(f"input[{i}].output", item.get("output")),
    }


# ---- tools ---------------------------------------------------------------------------------------


def _tool(i: int, tool: Any) -> dict[str, Any]:
    """A Responses function tool in chat's nested shape; built-in tools are refused."""
    kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
    if kind != "function":
        raise RequestError(
            f"tools[{i}] is a {kind!r} tool: rtrl serves function tools only (built-in tools such as "
            "web_search, file_search, code_interpreter or computer use run on OpenAI's servers)"
        )
    assert isinstance(tool, dict)
    function: dict[str, Any] = {"name": _string(f"tools[{i}].name", tool.get("name"))}
    for name in ("description", "parameters", "strict"):
        if tool.get(name) is not None:
            function[name] = tool[name]
    if "parameters" in function and not isinstance(function["parameters"], dict):
        raise RequestError(f"tools[{i}].parameters must be a JSON schema object")
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": _string("tool_choice.name", choice.get("name"))}}
    raise RequestError(
        f"tool_choice must be auto, none, required or {{type: function, name}}, got {choice!r:.100}"
    )


# ---- responses -----------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def response_id(request_id: str) -> str:
    """The Response's id: the gateway's request id behind ``resp_`` (feedback names the request id)."""
    return f"resp_{request_id}"


def skeleton(echo: Echo, rid: str, created_at: float, status: str, model: str) -> dict[str, Any]:
    """A Response object without output or usage, as `response.created` carries it."""
    return {
        "id": rid,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": echo.instructions,
        "max_output_tokens": echo.max_output_tokens,
        "metadata": echo.metadata or {},
        "model": model,
        "output": [],
        "parallel_tool_calls": echo.parallel_tool_calls,
        "previous_response_id": None,
        "store": False,  # never stored, whatever was asked (docs/runbooks/gateway.md)
        "temperature": echo.temperature,
        "text": {"format": {"type": "text"}},
        "tool_choice": echo.tool_choice,
        "tools": echo.tools,
        "top_p": echo.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": echo.user,
    }


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {
        "id": item_id or new_id("msg"),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def function_call_item(call: Mapping[str, Any], status: str = "completed") -> dict[str, Any]:
    function = call.get("function") or {}
    return {
        "id": new_id("fc"),
        "type": "function_call",
        "call_id": str(call.get("id") or new_id("call")),
        "name": str(function.get("name") or ""),
        "arguments": str(function.get("arguments") or ""),
        "status": status,
    }


def usage(chat_usage: Any) -> dict[str, Any] | None:
    """A chat ``usage`` object as the Responses API's."""
    if not isinstance(chat_usage, dict):
        return None
    prompt = int(chat_usage.get("prompt_tokens") or 0)
    completion = int(chat_usage.get("completion_tokens") or 0)
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": int(cached), "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def finished(body: dict[str, Any], finish_reason: Any) -> dict[str, Any]:
    """`body` with the status its chat finish reason means: ``length`` is incomplete, as OpenAI's
    responses cut by ``max_output_tokens`` are."""
    body["completed_at"] = time.time()
    if finish_reason == "length":
        body["status"] = "incomplete"
        body["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        body["status"] = "completed"
    return body


def response_body(
    payload: Mapping[str, Any], echo: Echo, request_id: str, policy_version: str, created_at: float
) -> dict[str, Any]:
    """vLLM's chat answer (one choice) as a Response object, with the gateway's ``rtrl`` object."""
    choices = payload.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    message = choice.get("message") or {}
    model = str(payload.get("model") or echo.model or "")
    body = skeleton(echo, response_id(request_id), created_at, "completed", model)
    content, calls = message.get("content"), message.get("tool_calls") or []
    status = "incomplete" if choice.get("finish_reason") == "length" else "completed"
    if content or not calls:
        body["output"].append(message_item(str(content or ""), status))
    body["output"].extend(function_call_item(call, status) for call in calls if isinstance(call, dict))
    body["usage"] = usage(payload.get("usage"))
    body["rtrl"] = {"request_id": request_id, "policy_version": policy_version}
    return finished(body, choice.get("finish_reason"))
