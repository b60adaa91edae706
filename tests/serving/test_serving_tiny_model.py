"""The tiny model in the session's real vLLM CPU server: it answers completions and chat in the
task's shape, and its prompt logprobs agree with transformers on the same checkpoint (what the
deployer's swap probe relies on)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from evals import get_task
from schemas.settings import Settings
from serving import VllmClient

pytestmark = pytest.mark.integration


@pytest.fixture
def server(vllm_service: Settings) -> str:
    return vllm_service.vllm.servers[0]


@pytest.fixture
def tiny(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


def test_completion_with_logprobs(server: str) -> None:
    task = get_task("exclaim")
    body = {
        "model": "rtrl-tiny",
        "prompt": task.heldout_prompts(1)[0],
        "max_tokens": task.max_tokens,
        "stop": list(task.stop),
        "temperature": 0.0,
        "logprobs": 1,
        "return_token_ids": True,
    }
    response = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    text = choice["text"]
    assert text.startswith(" ") and text.strip()[-1] in ".!" and len(text) <= 48, text
    assert choice["finish_reason"] == "stop"
    token_logprobs = choice["logprobs"]["token_logprobs"]
    assert len(token_logprobs) == len(choice["token_ids"]) >= 2
    assert all(lp <= 0 for lp in token_logprobs)


def test_chat_completion_uses_the_task_format(server: str) -> None:
    body = {
        "model": "rtrl-tiny",
        "messages": [{"role": "user", "content": "What is 2 plus 2?"}],
        "max_tokens": 16,
        "temperature": 0.0,
    }
    response = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["message"]["content"].strip()
    assert content and content[-1] in ".!", content


def test_prompt_logprobs_match_transformers(server: str, tiny: Path) -> None:
    """Raw HTTP here on purpose: the client's own `prompt_logprobs` is checked against the same numbers below."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = "Q: What is 3 plus 4?\nA: It is 7!"
    body = {"model": "rtrl-tiny", "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0.0}
    response = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    entries = response.json()["choices"][0]["prompt_logprobs"]  # [None, {id: {logprob, ...}}, ...]

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]  # (1, T)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1], dim=-1)  # (T-1, V)
    expected = logprobs.gather(-1, ids[0, 1:, None])[:, 0].tolist()
    assert entries[0] is None and len(entries) == ids.shape[1]
    for position, (entry, want) in enumerate(zip(entries[1:], expected, strict=True), start=1):
        got = entry[str(ids[0, position].item())]["logprob"]
        assert abs(got - want) < 0.05, (position, got, want)


def test_client_prompt_logprobs_are_the_servers(server: str, tiny: Path) -> None:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny)("Q: What is 3 plus 4?\nA: It is 7!")["input_ids"]
    body = {"model": "rtrl-tiny", "prompt": ids, "max_tokens": 1, "prompt_logprobs": 1, "temperature": 0.0}
    entries = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()["choices"][0][
        "prompt_logprobs"
    ]
    with VllmClient(server, model="rtrl-tiny") as client:
        expected = [e[str(t)]["logprob"] for t, e in zip(ids[1:], entries[1:], strict=True)]
        assert client.prompt_logprobs(ids) == pytest.approx(expected, abs=1e-6)
