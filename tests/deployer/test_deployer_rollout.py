"""The deployer against the session's real vLLM CPU servers (serving + staging) and real MLflow.

Each test registers under its own MLflow model name, so the registry other tests use is
untouched, and every test that swaps the shared servers puts them back on the base weights with
weight version "v1" before it ends (the base model is v1 under every model name).
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deployer import gate, rollout
from registry import Registry
from rtrl.services.testing import free_ports
from schemas.settings import GateSettings, MlflowSettings, ServicesSettings, Settings, VllmSettings
from serving import VllmClient, meaningful_digests

pytestmark = pytest.mark.integration

PROMPT = "Q: What is 2 plus 3?\nA:"


def perturbed_copy(base: Path, out: Path, std: float, seed: int) -> Path:
    """The base checkpoint with Gaussian noise of `std` added to every weight (same shapes, same tokenizer)."""
    shutil.copytree(base, out)
    generator = torch.Generator().manual_seed(seed)
    for path in out.glob("*.safetensors"):
        tensors = load_file(path)
        noisy = {
            k: (v + std * torch.randn(v.shape, generator=generator, dtype=v.dtype)).contiguous()
            for k, v in tensors.items()
        }
        save_file(noisy, path, metadata={"format": "pt"})
    return out


def greedy(server: VllmClient) -> str:
    return server.complete([PROMPT], max_tokens=12, temperature=0.0, stop=["\n"])[0][0]


@pytest.fixture()
def deploy_settings(services: Settings, tmp_path: Path) -> Iterator[Settings]:
    """The session's services under a private model name and deploy dir; restores the fleet to v1 after."""
    settings = services.model_copy(
        update={
            "mlflow": MlflowSettings(
                **{**services.mlflow.model_dump(), "model_name": f"deployer-{uuid.uuid4().hex[:8]}"}
            ),
            "services": ServicesSettings(**{**services.services.model_dump(), "run_dir": tmp_path / "run"}),
            "gate": GateSettings(eval_prompts=16, samples_per_prompt=2, tolerance=0.05),
        }
    )
    registry = Registry.from_settings(settings)
    yield settings
    # Leave the shared servers as other tests expect them: base weights, version v1, resumed.
    if registry.versions() and registry.champion() != 1:
        rollout.promote(settings, registry, 1)
    for url in (*settings.vllm.servers, settings.vllm.staging_server):
        assert url is not None
        with VllmClient(url, model=settings.vllm.served_model_name) as server:
            if server.is_paused():
                server.resume()
            assert server.weight_version() == 1


def serving(settings: Settings) -> VllmClient:
    return VllmClient(settings.vllm.servers[0], model=settings.vllm.served_model_name)


def test_bootstrap_promote_and_rollback(
    deploy_settings: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    settings = deploy_settings
    registry = Registry.from_settings(settings)
    assert rollout.bootstrap(settings, registry, tiny_model_dir) == 1
    assert rollout.bootstrap(settings, registry, tiny_model_dir) == 1  # idempotent
    assert registry.versions() == [1]
    with serving(settings) as server:
        assert server.weight_version() == 1
        base_text = greedy(server)

    v2 = registry.register_checkpoint(perturbed_copy(tiny_model_dir, tmp_path / "v2", std=0.05, seed=2))
    assert v2 == 2
    result = rollout.promote(settings, registry, v2)
    print("promote v2:", result.model_dump_json())
    assert result.ok, result.error
    assert result.previous_version == 1 and not result.rolled_back
    step = result.servers[0]
    assert step.verified and step.max_abs_logprob_diff is not None
    assert step.max_abs_logprob_diff <= settings.deployer.probe_tolerance
    assert registry.champion() == 2
    assert registry.previous_champion() == 1
    with serving(settings) as server:
        assert server.weight_version() == 2
        assert not server.is_paused()
        assert greedy(server) != base_text

    back = rollout.rollback(settings, registry)
    print("rollback:", back.model_dump_json())
    assert back.ok and back.version == 1
    assert registry.champion() == 1
    with serving(settings) as server:
        assert server.weight_version() == 1
        assert greedy(server) == base_text


def test_failed_verification_restores_previous_weights(
    deploy_settings: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    settings = deploy_settings
    registry = Registry.from_settings(settings)
    rollout.bootstrap(settings, registry, tiny_model_dir)
    with serving(settings) as server:
        base_text = greedy(server)
        digests = server.weight_digests()
    v2 = registry.register_checkpoint(perturbed_copy(tiny_model_dir, tmp_path / "v2", std=0.05, seed=3))
    # Digests recorded for v2 that the checkpoint on disk does not match: what the deployer sees
    # when a checkpoint changed between the gate and the deploy.
    rollout.save_digests(settings, v2, {name: "0" * 64 for name in meaningful_digests(digests)})

    result = rollout.promote(settings, registry, v2)
    print("tampered promote:", result.model_dump_json())
    assert not result.ok and result.rolled_back
    step = result.servers[0]
    assert step.digest_match is False and step.restored and not step.verified
    assert step.max_abs_logprob_diff is None  # caught in the pause window, before any generation
    assert registry.champion() == 1
    with serving(settings) as server:
        assert server.weight_version() == 1
        assert not server.is_paused()
        assert greedy(server) == base_text

    # A fleet whose second server is down: the canary is swapped, then swapped back.
    rollout.digests_path(settings, v2).unlink()
    (dead_port,) = free_ports(1)
    fleet = settings.model_copy(
        update={
            "vllm": VllmSettings(
                **{
                    **settings.vllm.model_dump(),
                    "servers": (*settings.vllm.servers, f"http://127.0.0.1:{dead_port}"),
                }
            )
        }
    )
    result = rollout.promote(fleet, registry, v2)
    print("dead second server:", result.model_dump_json())
    assert not result.ok and result.rolled_back
    assert [s.verified for s in result.servers] == [True, False, True]  # canary, dead server, canary back
    assert registry.champion() == 1
    with serving(settings) as server:
        assert server.weight_version() == 1
        assert not server.is_paused()
        assert greedy(server) == base_text


def test_gate_passes_an_equal_model_and_fails_a_broken_one(
    deploy_settings: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    settings = deploy_settings
    registry = Registry.from_settings(settings)
    rollout.bootstrap(settings, registry, tiny_model_dir)
    same = registry.register_checkpoint(perturbed_copy(tiny_model_dir, tmp_path / "same", std=0.0, seed=0))
    decision = gate.evaluate(settings, registry, same)
    print("gate equal:", decision.model_dump_json())
    assert decision.passed
    assert decision.challenger_score == decision.champion_score  # same weights, same seed, same samples
    assert decision.n_prompts == 16 and decision.n_samples == 32
    assert rollout.load_digests(settings, same)  # recorded on staging for the swap verification

    broken = registry.register_checkpoint(perturbed_copy(tiny_model_dir, tmp_path / "broken", std=1.0, seed=4))
    decision = gate.evaluate(settings, registry, broken)
    print("gate broken:", decision.model_dump_json())
    assert not decision.passed
    assert decision.challenger_score is not None and decision.champion_score is not None
    assert decision.challenger_score < decision.champion_score - settings.gate.tolerance
    assert registry.version_tags(broken)["gate"] == "fail"
    assert registry.champion() == 1
    assert settings.vllm.staging_server is not None
    with VllmClient(settings.vllm.staging_server, model=settings.vllm.served_model_name) as staging:
        assert staging.weight_version() == 1  # the gate leaves staging on the champion
