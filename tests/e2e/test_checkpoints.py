"""Checkpoints rtrl did not build, end to end (issue 35): `rtrl demo --cycles 2 --api chat` on two
checkpoints generated here, each on a serving and a staging vLLM server of its own, with the
session's Kafka, Redis and MLflow.

* ``qwen2``: Qwen2ForCausalLM, bf16 safetensors, tied embeddings, attention biases, GQA, a
  byte-level BPE tokenizer with ChatML special tokens, the ChatML template, and Qwen's sampling
  defaults in generation_config.json (T 0.7, top-p 0.8, top-k 20);
* ``llama``: LlamaForCausalLM, fp32, untied, a SentencePiece-style tokenizer (byte fallback, BOS)
  with the ``[INST]`` template, sampling defaults T 0.6, top-p 0.9.

Simulated users send chat messages without sampling parameters, so the model's own template and
defaults apply (the gateway writes them into each request); each cycle trains on exactly those
tokens under that truncation, the staging server and the serving server load the new weights and
verify them against transformers, and the gate promotes; a rollback puts v2 back, verified. The
``qwen2-lora`` case runs the same loop in LoRA mode (``trainer.adapter=lora``): an adapter per
version on the generated base, registered with its base lineage, loaded in place and probed by
greedy continuation (docs/lora.md), and rolled back the same way. The weights (random, from
simulation/checkpoints.py) learn nothing worth gating, so the gate's judgement is switched off
(`gate_without_judgement`): the subject is the loop on a foreign checkpoint, not the gate.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from helpers import REPO, demo_settings, own_fleet, run_rtrl

from deployer.probe import (
    ADAPTER_PROBE_TOKENS,
    adapter_reference,
    build_probe,
    max_abs_diff,
    reference_logprobs,
)
from registry import Registry
from schemas.settings import Settings
from services.launch import child_env, rtrl_command
from serving import VllmClient
from serving.adapters import base_model_name, is_adapter
from simulation.checkpoints import build

pytestmark = pytest.mark.e2e

REQUESTS_PER_CYCLE = 48
TEMPLATE_MARK = {"qwen2": "<|im_start|>assistant\n", "llama": "[/INST]"}
DEFAULTS = {
    "qwen2": {"temperature": 0.7, "top_p": 0.8, "top_k": 20},
    "llama": {"temperature": 0.6, "top_p": 0.9},
}


@pytest.fixture(params=["qwen2", "llama", "qwen2-lora"])
def foreign_fleet(request: pytest.FixtureRequest, services: Settings) -> Iterator[tuple[str, Settings]]:
    """A generated checkpoint of one family, served by a serving and a staging server of its own
    (started with LoRA enabled in LoRA mode)."""
    case = str(request.param)
    arch, lora = case.removesuffix("-lora"), case.endswith("-lora")
    adapter = "lora" if lora else "full"
    with own_fleet(
        services, lambda run_dir: build(run_dir / "model", arch), adapter, prefix=f"rtrl-{arch}-"
    ) as fleet:
        yield case, fleet


def test_two_chat_cycles_on_a_checkpoint_rtrl_did_not_build(
    foreign_fleet: tuple[str, Settings], tmp_path: Path
) -> None:
    case, fleet = foreign_fleet
    arch, lora = case.removesuffix("-lora"), case.endswith("-lora")
    settings = demo_settings(fleet, tmp_path, case)
    out = tmp_path / "cycles.json"
    proc = subprocess.run(
        rtrl_command(
            "demo",
            "--cycles",
            "2",
            "--requests",
            str(REQUESTS_PER_CYCLE),
            "--api",
            "chat",
            "--json",
            str(out),
        ),
        cwd=REPO,
        env=child_env(settings),
        capture_output=True,
        text=True,
        timeout=1500,
    )
    logs = Path(settings.services.run_dir) / "logs"
    assert proc.returncode == 0, f"demo failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}\nlogs in {logs}"
    rows = json.loads(out.read_text())
    print(json.dumps(rows, indent=1))
    assert [(r["version_before"], r["version_after"], r["gate"]) for r in rows] == [
        ("v1", "v2", "pass"),
        ("v2", "v3", "pass"),
    ]
    assert all(r["swap_ms"] is not None for r in rows), "every promotion swapped the serving server"

    # Users were served by v1 and then v2, through the chat template, under the model's own defaults.
    engine = sa.create_engine(settings.store.url)
    with engine.connect() as conn:
        served = conn.execute(sa.text("SELECT policy_version, prompt, sampling FROM interactions")).all()
        cycles = conn.execute(sa.text("SELECT status, metrics FROM cycles ORDER BY id")).all()
    engine.dispose()
    per_version: dict[str, int] = {}
    for version, prompt, sampling in served:
        per_version[version] = per_version.get(version, 0) + 1
        assert prompt.endswith(TEMPLATE_MARK[arch]), prompt
        recorded = json.loads(sampling) if isinstance(sampling, str) else sampling
        assert {key: recorded[key] for key in DEFAULTS[arch]} == pytest.approx(DEFAULTS[arch]), recorded
        assert recorded["logprobs_mode"] == "processed"
    assert per_version == {"v1": REQUESTS_PER_CYCLE, "v2": REQUESTS_PER_CYCLE}

    # The trainer reproduced vLLM's truncated sampling: π_old matches μ token by token.
    assert [status for status, _ in cycles] == ["promoted", "promoted"]
    for _, metrics in cycles:
        data = json.loads(metrics) if isinstance(metrics, str) else metrics
        mismatch = data["steps"][0]["mismatch"]
        print(arch, "mismatch", mismatch)
        assert mismatch["tokens"] > 0 and mismatch["outside_0.9_1.1"] <= 0.02, mismatch
        assert data["unreproducible_rows"] == 0

    # The serving server serves v3 exactly as transformers computes it.
    registry = Registry.from_settings(settings)
    assert registry.versions() == [1, 2, 3] and registry.champion() == 3
    v3 = registry.download_checkpoint(3)
    base = settings.vllm.model_dir
    probe = build_probe(base)
    with VllmClient(settings.vllm.servers[0], model=settings.vllm.served_model_name) as server:
        assert server.weight_version() == 3
        if lora:  # never prompt logprobs on a LoRA server (docs/platform.md): a greedy continuation
            assert is_adapter(v3)
            prompt = list(probe.token_ids[0])
            tokens, served_logprobs = server.greedy_logprobs(prompt, ADAPTER_PROBE_TOKENS)
            diff = max_abs_diff(adapter_reference(base, v3, [(prompt, tokens)]), [served_logprobs])
        else:
            observed = [server.prompt_logprobs(list(ids)) for ids in probe.token_ids]
            diff = max_abs_diff(reference_logprobs(v3, probe), observed)
    assert diff <= 1e-3, diff
    if lora:
        adapters_with_lineage(settings, registry, prompt, (tokens, served_logprobs))

    # A rollback puts v2 back on the serving server, verified.
    rolled = run_rtrl(settings, "deploy", "rollback", timeout_s=300)
    assert rolled.returncode == 0, rolled.stderr[-3000:]
    result = json.loads(rolled.stdout)
    assert result["ok"] and result["version"] == 2 and all(s["verified"] for s in result["servers"]), result
    with VllmClient(settings.vllm.servers[0], model=settings.vllm.served_model_name) as server:
        assert server.weight_version() == 2 and server.health()


def adapters_with_lineage(
    settings: Settings, registry: Registry, prompt: list[int], served: tuple[list[int], list[float]]
) -> None:
    """LoRA mode: every version is an adapter on the base model (no full weights), with its lineage
    in MLflow, and v3's adapter changes what the base alone would answer on the same server."""
    base = settings.vllm.model_dir.resolve()
    for version in (1, 2, 3):
        path = registry.download_checkpoint(version)
        assert is_adapter(path) and not (path / "model.safetensors").exists(), version
        tags = registry.version_tags(version)
        assert tags["rtrl.adapter"] == "lora" and tags["rtrl.base_model"] == str(base), tags
    assert registry.version_tags(3)["rtrl.parent_version"] == "2"
    with VllmClient(
        settings.vllm.servers[0], model=base_model_name(settings.vllm.served_model_name)
    ) as plain:
        alone = plain.greedy_logprobs(prompt, ADAPTER_PROBE_TOKENS)
    assert alone != served, "the adapter changed nothing"
