"""The vLLM client against the session's real vLLM servers: state, versions, errors, a full-weight hot
reload; and the reading of /weight_info answers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file

from schemas.settings import Settings
from services.testing import free_ports
from serving import ServerError, VersionUnknown, VllmClient, parse_weight_info

pytestmark = pytest.mark.integration

PROMPT = "Q: say hello\nA:"


def _complete(server: str, settings: Settings, **extra: object) -> dict:  # type: ignore[type-arg]
    body = {
        "model": settings.vllm.served_model_name,
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 0.0,
        "logprobs": 1,
        "return_token_ids": True,
        **extra,
    }
    response = httpx.post(f"{server}/v1/completions", json=body, timeout=settings.vllm.request_timeout_s)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]  # type: ignore[no-any-return]


def _reload(server: str, weights: Path) -> None:
    """The deployer's swap sequence: pause (drain), reload from disk, resume."""
    with httpx.Client(base_url=server, timeout=120) as client:
        client.post("/pause", params={"mode": "wait"}).raise_for_status()
        try:
            response = client.post(
                "/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": str(weights)}}
            )
            assert response.status_code == 200, response.text
        finally:
            client.post("/resume").raise_for_status()


def _swapped_checkpoint(src: Path, dst: Path, a: int, b: int) -> Path:
    """A copy of `src` with rows `a` and `b` of lm_head swapped: where `a` was the greedy token, `b` now is."""
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    head = tensors["lm_head.weight"].clone()  # (V, H); untied from the embeddings in the tiny model
    head[[a, b]] = head[[b, a]]
    tensors["lm_head.weight"] = head
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_completion_returns_token_ids_and_logprobs(vllm_service: Settings) -> None:
    choice = _complete(vllm_service.vllm.servers[0], vllm_service)
    logprobs = choice["logprobs"]
    assert choice["token_ids"], choice
    assert len(choice["token_ids"]) == len(logprobs["tokens"]) == len(logprobs["token_logprobs"])
    assert all(lp <= 0.0 for lp in logprobs["token_logprobs"])
    assert all(len(top) >= 1 for top in logprobs["top_logprobs"])


def test_reload_weights_changes_greedy_output_and_restores(vllm_service: Settings, tmp_path: Path) -> None:
    server = vllm_service.vllm.staging_server
    assert server is not None
    model_dir = vllm_service.vllm.model_dir
    before = _complete(server, vllm_service)

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    first = before["token_ids"][0]
    other = _swapped_checkpoint(model_dir, tmp_path / "other", first, 3 + (first - 3 + 1) % (vocab - 3))

    _reload(server, other)
    try:
        after = _complete(server, vllm_service)
        assert after["token_ids"] != before["token_ids"]
    finally:
        _reload(server, model_dir)  # the server is shared by the whole test session
    restored = _complete(server, vllm_service)
    assert restored["token_ids"] == before["token_ids"]
    assert restored["text"] == before["text"]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (200, {"weight_version": "v3"}, 3),
        (200, {"weight_version": "default"}, None),
        (200, {"weight_version": None}, None),
    ],
)
def test_weight_info_is_read_as_an_int(status: int, body: dict, expected: int | None) -> None:  # type: ignore[type-arg]
    assert parse_weight_info("http://s", httpx.Response(status, json=body)) == expected


@pytest.mark.unit
@pytest.mark.parametrize(
    ("status", "body", "message"),
    [
        (404, {"detail": "Not Found"}, "VLLM_SERVER_DEV_MODE=1"),
        (200, {"weight_version": "main"}, "not an rtrl policy version"),
        (200, [1, 2], "answered"),
    ],
)
def test_weight_info_that_names_no_rtrl_version(status: int, body: object, message: str) -> None:
    with pytest.raises(VersionUnknown, match=message):
        parse_weight_info("http://s", httpx.Response(status, json=body))


def test_client_state_version_and_errors(vllm_service: Settings) -> None:
    url = vllm_service.vllm.servers[0]
    with VllmClient(url, model=vllm_service.vllm.served_model_name) as client:
        state = client.state()
        assert state.healthy and state.paused is False and state.error is None
        assert state.weight_version == client.weight_version() == 1  # the session's servers serve v1
        with pytest.raises(ServerError, match="HTTP 4"):
            client.complete(["hi"], max_tokens=100_000)  # longer than the model's context: vLLM says 400
    (closed,) = free_ports(1)
    with VllmClient(f"http://127.0.0.1:{closed}", model="x") as down:
        assert not down.health()
        assert down.state().healthy is False  # never raises
        with pytest.raises(httpx.ConnectError):
            down.weight_version()
