"""What of a tenant's request reaches vLLM (ingest/forwarding.py): the allow-list of forwarded
fields, text-only messages, the token budget, the served model and the tenant's prefix-cache salt;
and the settings behind them (schemas/settings/gateway.py)."""

from __future__ import annotations

import hashlib
import hmac
import http.server
import json
import threading
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from starlette.testclient import TestClient

from ingest.app import create_app
from ingest.forwarding import RequestPolicy
from ingest.gateway import Gateway
from ingest.shaping import RequestError, prepare_chat_request, prepare_completion_request, sampling_params
from schemas.clock import wait_until
from schemas.settings import GatewaySettings, ServicesSettings, Settings, StoreSettings, VllmSettings
from schemas.settings.gateway import FORWARDED_FIELDS
from store import Store

pytestmark = pytest.mark.unit

SECRET = b"0123456789abcdef0123456789abcdef"
MODEL = "rtrl-tiny"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
COMPLETION = {"model": MODEL, "prompt": "Q: 1+1?\nA:", "max_tokens": 8}


def policy(max_model_len: int = 512, **gateway: Any) -> RequestPolicy:
    settings = Settings(
        gateway=GatewaySettings(**gateway),
        vllm=VllmSettings(served_model_name=MODEL, max_model_len=max_model_len),
    )
    return RequestPolicy.from_settings(settings, SECRET)


POLICY = policy()


def refused(body: Any, chat: bool, rules: RequestPolicy = POLICY) -> RequestError:
    with pytest.raises(RequestError) as info:
        rules.apply(body, chat, "acme")
    return info.value


# ---- the allow-list ---------------------------------------------------------------------------


def test_what_an_openai_client_sends_is_forwarded_with_the_tenants_salt() -> None:
    chat = {
        **CHAT,
        "temperature": 0.7,
        "top_p": 0.9,
        "n": 1,
        "stop": ["\n"],
        "seed": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": True,
        "top_logprobs": 5,
        "user": "u-1",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "max_completion_tokens": 8,
        "rtrl": {"episode_id": "ep"},
        "return_token_ids": True,
        "return_prompt_text": True,
    }
    forward = POLICY.apply(chat, True, "acme")
    assert forward == {**chat, "cache_salt": POLICY.cache_salt("acme")}
    assert "cache_salt" not in chat  # the client's dict is not changed
    completion = {**COMPLETION, "logprobs": 5, "temperature": 1.0, "stream": False}
    assert POLICY.apply(completion, False, "acme") == {**completion, "cache_salt": POLICY.cache_salt("acme")}


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("prompt_logprobs", 20, ": prompt logprobs are not served"),
        ("ignore_eos", True, ": generations end where the model ends them"),
        ("min_tokens", 100_000, ": generations end where the model ends them"),
        ("guided_json", {"type": "object"}, ""),
        ("structured_outputs", {"regex": "a+"}, ""),
        ("response_format", {"type": "json_object"}, ""),
        ("chat_template", "{{ 7 * 7 }}", ""),
        ("logit_bias", {"5": 100}, ""),
        ("top_k", 5, ""),
        ("presence_penalty", 0.5, ": penalties other than 0 are not served"),
        ("frequency_penalty", -2, ": penalties other than 0 are not served"),
        ("repetition_penalty", 1.2, ": penalties other than 1 are not served"),
        ("priority", -100, ""),
        ("kv_transfer_params", {"do_remote_prefill": True}, ""),
    ],
)
def test_any_other_field_is_a_400_naming_it_and_the_setting(field: str, value: Any, why: str) -> None:
    for chat, body in ((True, CHAT), (False, COMPLETION)):
        error = refused({**body, field: value}, chat)
        assert error.status_code == 400
        assert (
            str(error) == f"field {field!r} is not accepted by this gateway (gateway.forwarded_fields){why}"
        )


def test_penalties_at_their_neutral_value_and_null_fields_pass() -> None:
    """OpenAI clients send presence_penalty 0 and some send every field they know as null: neither
    changes what vLLM does. A null field is dropped, on the list or not, and a neutral penalty
    forwarded (so the model's own default does not replace a value the client chose)."""
    neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
    forward = POLICY.apply(
        {**CHAT, **neutral, "logit_bias": None, "seed": None, "cache_salt": None}, True, "acme"
    )
    assert forward == {**CHAT, **neutral, "cache_salt": POLICY.cache_salt("acme")}
    assert refused({**CHAT, "presence_penalty": False}, True).status_code == 400  # a bool is not 0


def test_an_operator_can_forward_more_fields() -> None:
    rules = policy(forwarded_fields=(*FORWARDED_FIELDS, "ignore_eos", "presence_penalty"))
    body = {**COMPLETION, "ignore_eos": True, "presence_penalty": 0.5}
    assert rules.apply(body, False, "acme") == {**body, "cache_salt": rules.cache_salt("acme")}
    assert "'top_k'" in str(refused({**COMPLETION, "top_k": 5}, False, rules))


def test_fields_of_the_other_endpoint_are_refused() -> None:
    assert str(refused({**COMPLETION, "messages": []}, False)) == (
        "field 'messages' is not a field of /v1/completions"
    )
    for field, value in (("prompt", "p"), ("echo", True), ("best_of", 1), ("suffix", "s")):
        assert str(refused({**CHAT, field: value}, True)) == (
            f"field {field!r} is not a field of /v1/chat/completions"
        )
    assert "'return_prompt_text'" in str(refused({**COMPLETION, "return_prompt_text": True}, False))


def test_a_body_that_is_not_an_object_is_refused() -> None:
    assert str(refused([1], True)) == "request body must be a JSON object, got list"


# ---- messages ---------------------------------------------------------------------------------


def test_text_parts_are_forwarded_and_any_other_part_is_refused() -> None:
    text = [{"type": "text", "text": "Describe "}, {"type": "text", "text": "this."}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": text},
        {"role": "assistant", "content": None, "tool_calls": []},
    ]
    assert POLICY.apply({**CHAT, "messages": messages}, True, "acme")["messages"] == messages
    for part in (
        {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data/"}},
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
        {"type": "video_url", "video_url": {"url": "http://minio:9000/x"}},
        {"type": "file", "file": {"file_id": "f"}},
        {"text": "no type"},
    ):
        body = {**CHAT, "messages": [{"role": "user", "content": [*text, part]}]}
        error = refused(body, True)
        assert str(error) == (
            f"messages[0].content[2] is a {part.get('type')!r} part: this gateway forwards text parts only"
        )
    assert str(refused({**CHAT, "messages": ["hi"]}, True)) == "messages[0] must be an object, got str"
    assert "messages[0].content must be" in str(
        refused({**CHAT, "messages": [{"role": "user", "content": {"url": "x"}}]}, True)
    )
    assert "a 'str' part" in str(refused({**CHAT, "messages": [{"role": "user", "content": ["x"]}]}, True))


# ---- tokens -----------------------------------------------------------------------------------


def test_a_request_over_the_token_budget_is_a_400() -> None:
    rules = policy(max_tokens_per_request=64)
    assert rules.apply({**COMPLETION, "max_tokens": 64}, False, "acme")["max_tokens"] == 64
    for chat, body, field in (
        (False, COMPLETION, "max_tokens"),
        (True, CHAT, "max_tokens"),
        (True, CHAT, "max_completion_tokens"),
    ):
        error = refused({**body, field: 65}, chat, rules)
        assert str(error) == (
            f"{field}=65 is over this gateway's budget of 64 tokens a request (gateway.max_tokens_per_request)"
        )
    # vLLM would read these as 100000: the budget checks integers only.
    for value in ("100000", 1e5, True):
        assert str(refused({**COMPLETION, "max_tokens": value}, False)) == (
            f"max_tokens must be an integer, got {value!r}"
        )


def test_a_request_without_a_limit_gets_the_budget_or_the_context() -> None:
    """The budget is written into the request (the chat endpoint's own field there), or the context
    length when smaller: vLLM refuses a limit above it."""
    small = policy(max_tokens_per_request=64)
    completion = {k: v for k, v in COMPLETION.items() if k != "max_tokens"}
    chat = {k: v for k, v in CHAT.items() if k != "max_tokens"}
    assert small.apply(completion, False, "acme")["max_tokens"] == 64
    forward = small.apply({**chat, "max_tokens": None}, True, "acme")
    assert "max_tokens" not in forward and forward["max_completion_tokens"] == 64
    assert sampling_params(forward).max_tokens == 64  # what the event records
    assert POLICY.apply(completion, False, "acme")["max_tokens"] == 512  # 4096, but the context is 512
    assert policy(max_model_len=32_768).apply(completion, False, "acme")["max_tokens"] == 4096


def test_the_chat_limit_vllm_uses_is_the_one_recorded() -> None:
    """vLLM's chat endpoint takes max_completion_tokens over max_tokens; the event says the same."""
    assert sampling_params({"max_tokens": 8, "max_completion_tokens": 4}).max_tokens == 4
    assert sampling_params({"max_tokens": 8}).max_tokens == 8


def test_alternatives_per_token_are_capped() -> None:
    assert POLICY.apply({**CHAT, "logprobs": True, "top_logprobs": 5}, True, "acme")["top_logprobs"] == 5
    assert str(refused({**CHAT, "logprobs": True, "top_logprobs": 6}, True)) == (
        "top_logprobs must be an integer of at most 5, got 6 (gateway.max_top_logprobs)"
    )
    assert "logprobs must be an integer of at most 5, got 20" in str(
        refused({**COMPLETION, "logprobs": 20}, False)
    )
    assert "got '1'" in str(refused({**COMPLETION, "logprobs": "1"}, False))
    assert POLICY.apply({**COMPLETION, "logprobs": 0}, False, "acme")["logprobs"] == 0
    assert "got 1" in str(refused({**COMPLETION, "logprobs": 1}, False, policy(max_top_logprobs=0)))


# ---- model and salt ---------------------------------------------------------------------------


def test_the_model_is_the_served_one() -> None:
    without = {k: v for k, v in COMPLETION.items() if k != "model"}
    assert POLICY.apply(without, False, "acme")["model"] == MODEL
    for name in ("rtrl-tiny-base", "gpt-4o", 5):
        error = refused({**COMPLETION, "model": name}, False)
        assert error.status_code == 404
        assert str(error) == f"model {name!r} is not served here; this gateway serves 'rtrl-tiny'"


def test_a_tenant_with_an_adapter_is_served_by_it_and_never_by_anothers() -> None:
    # docs/lora.md, An adapter per tenant: the served name the client knows, or none, or its own
    # adapter's name all go to its adapter; another tenant's adapter is as unknown as any model.
    without = {k: v for k, v in COMPLETION.items() if k != "model"}
    for body in (without, COMPLETION, {**COMPLETION, "model": "rtrl-tiny--acme"}):
        assert POLICY.apply(body, False, "acme", "rtrl-tiny--acme")["model"] == "rtrl-tiny--acme"
    with pytest.raises(RequestError, match="'rtrl-tiny--bolt' is not served here") as info:
        POLICY.apply({**COMPLETION, "model": "rtrl-tiny--bolt"}, False, "acme", "rtrl-tiny--acme")
    assert info.value.status_code == 404
    with pytest.raises(RequestError, match="'rtrl-tiny--acme' is not served here"):
        POLICY.apply({**COMPLETION, "model": "rtrl-tiny--acme"}, False, "bolt")  # bolt has no adapter


def test_each_tenant_has_its_own_salt_and_a_clients_salt_is_refused() -> None:
    salts = {t: POLICY.cache_salt(t) for t in ("acme", "bolt")}
    assert salts["acme"] != salts["bolt"] and len(salts["acme"]) == 64
    assert policy().cache_salt("acme") == salts["acme"]  # the same on every replica (the same secret)
    other = RequestPolicy.from_settings(Settings(), b"another secret, another deployment")
    assert other.cache_salt("acme") != salts["acme"]
    # A keyed hash, never the request ids' secret itself, nor a hash anyone could compute.
    assert salts["acme"] != hmac.new(SECRET, b"acme", hashlib.sha256).hexdigest()
    assert salts["acme"] != hashlib.sha256(b"acme").hexdigest()
    for chat, body in ((True, CHAT), (False, COMPLETION)):
        error = refused({**body, "cache_salt": salts["acme"]}, chat)
        assert str(error) == (
            "field 'cache_salt' is not accepted: the gateway salts the prefix cache of each tenant itself"
        )


def test_the_forwarded_request_carries_the_policy_and_the_capture_fields() -> None:
    """The order in the gateway (ingest/completions.py): the policy on the client's body, then the
    fields the gateway asks vLLM for."""
    chat = {k: v for k, v in CHAT.items() if k not in ("model", "max_tokens")}
    forward, _, _ = prepare_chat_request(POLICY.apply({**chat, "rtrl": {"episode_id": "e"}}, True, "bolt"))
    assert forward == {
        **chat,
        "model": MODEL,
        "max_completion_tokens": 512,
        "cache_salt": POLICY.cache_salt("bolt"),
        "logprobs": True,
        "top_logprobs": 0,
        "return_token_ids": True,
        "return_prompt_text": True,
    }
    forward, _, _ = prepare_completion_request(POLICY.apply(COMPLETION, False, "bolt"), {"top_k": 20})
    assert forward["top_k"] == 20  # the model's defaults are the operator's, not the client's


# ---- settings ---------------------------------------------------------------------------------


def test_the_settings_refuse_forwarding_the_gateways_own_fields() -> None:
    with pytest.raises(ValidationError, match="cache_salt cannot be forwarded from clients"):
        GatewaySettings(forwarded_fields=(*FORWARDED_FIELDS, "cache_salt"))
    with pytest.raises(ValidationError, match="must be request field names"):
        GatewaySettings(forwarded_fields=("model", "max tokens"))
    with pytest.raises(ValidationError):
        GatewaySettings(max_top_logprobs=21)
    with pytest.raises(ValidationError):
        GatewaySettings(max_tokens_per_request=0)


# ---- in the gateway ---------------------------------------------------------------------------


class RecordingVllm(http.server.ThreadingHTTPServer):
    """A stand-in for vLLM that records each body it is sent and refuses it (418), so the gateway
    relays that refusal and nothing is captured."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        recorded = self.bodies

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                recorded.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
                answer = b'{"error": {"message": "recorded", "type": "Teapot", "code": 418}}'
                self.send_response(418)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def test_the_gateway_refuses_before_vllm_and_forwards_the_salted_budgeted_body(
    tmp_path: Path, store: Store
) -> None:
    vllm = RecordingVllm()
    threading.Thread(target=vllm.serve_forever, daemon=True).start()
    store.set_serving_version(vllm.url, 1, "test: announced, so no version read is made")
    _, acme = store.create_api_key(role="tenant", tenant="acme", name="t")
    _, bolt = store.create_api_key(role="tenant", tenant="bolt", name="t")
    settings = Settings(
        store=StoreSettings(url=f"sqlite:///{tmp_path}/rtrl.db"),
        gateway=GatewaySettings(spool_dir=tmp_path / "spool", rate_limit_per_s=0, max_tokens_per_request=64),
        services=ServicesSettings(run_dir=tmp_path / "run"),
        vllm=VllmSettings(servers=(vllm.url,), sampling_defaults={}, served_model_name=MODEL),
    )
    try:
        with TestClient(create_app(settings, connect=lambda: None)) as client:
            gw: Gateway = client.app.state.gateway  # type: ignore[attr-defined]
            wait_until(
                lambda: gw.fleet.servers[0].announced is not None, timeout_s=10, what="the announcement"
            )

            def post(key: str, path: str, body: dict[str, Any]) -> Any:
                return client.post(path, json=body, headers={"authorization": f"Bearer {key}"})

            prompt = {"prompt": "Q: 1+1?\nA:"}
            answers = [
                post(acme, "/v1/completions", prompt | {"prompt_logprobs": 20}),
                post(acme, "/v1/completions", prompt | {"max_tokens": 65}),
                post(acme, "/v1/completions", prompt | {"model": "other"}),
                post(acme, "/v1/completions", prompt | {"cache_salt": "mine"}),
                post(
                    bolt,
                    "/v1/chat/completions",
                    CHAT
                    | {
                        "messages": [
                            {
                                "role": "user",
                                "content": [{"type": "image_url", "image_url": {"url": "http://10.0.0.1/"}}],
                            }
                        ]
                    },
                ),
            ]
            assert [a.status_code for a in answers] == [400, 400, 404, 400, 400]
            assert all(a.headers["x-rtrl-request-id"] and a.json()["error"]["message"] for a in answers)
            assert "'prompt_logprobs'" in answers[0].json()["error"]["message"]
            assert vllm.bodies == []  # none of them reached vLLM
            assert gw.slots.in_flight == 0

            relayed = [post(acme, "/v1/completions", prompt), post(bolt, "/v1/chat/completions", CHAT)]
            assert [a.status_code for a in relayed] == [418, 418]
    finally:
        vllm.shutdown()
        vllm.server_close()
    completion, chat = vllm.bodies
    assert completion["max_tokens"] == 64 and completion["model"] == MODEL
    assert completion["cache_salt"] == gw.policy.cache_salt("acme")
    assert chat["max_tokens"] == 8 and chat["cache_salt"] == gw.policy.cache_salt("bolt")
    assert "prompt_logprobs" not in completion
