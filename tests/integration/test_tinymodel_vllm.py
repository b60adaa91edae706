"""The tiny model in a real vLLM CPU server: it loads, answers completions and chat in the task's
shape, and its prompt logprobs agree with transformers on the same checkpoint (what the deployer's
swap probe relies on).

Starts its own server on a free port in 18200-18299 and stops it afterwards, so it does not depend
on the shared services fixture.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rtrl import tinymodel
from rtrl.tasks import get_task

pytestmark = pytest.mark.integration

START_TIMEOUT_S = 420.0


def free_port(low: int = 18200, high: int = 18300) -> int:
    for port in range(low, high):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{high - 1}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tinymodel.build(tmp_path_factory.mktemp("tiny"), task="exclaim", seed=0)


@pytest.fixture(scope="module")
def server(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(tiny), "--served-model-name", "rtrl-tiny",
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "512",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            if time.monotonic() - started > START_TIMEOUT_S:
                pytest.fail(f"vLLM not up after {START_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(f"{base}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        print(f"\nvLLM answered after {time.monotonic() - started:.1f} s")
        yield base
    finally:
        # The server spawns an engine process; end the whole session we started.
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


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
