"""Tenant adapters on real LoRA vLLM servers (docs/lora.md, An adapter per tenant): the reconciler
gives each adapter tenant's line its v1 on every server beside the global adapter; a promotion of
one tenant's version loads its adapter only, verified, leaving the server's label (the global
adapter's) and the other tenant's adapter as they were; its rollback likewise. Smaller and faster
than tests/e2e/test_tenant_adapters.py, which runs the whole loop: this is the deployer alone.

    PYTHONPATH=. .venv/bin/python -m pytest tests/deployer/test_tenant_lines.py -m integration
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import own_fleet
from safetensors.torch import load_file, save_file

from deployer import rollout
from deployer.probe import ADAPTER_PROBE_TOKENS, build_probe
from deployer.reconcile import reconcile_once
from registry import Registry
from schemas.lines import tenant_line
from schemas.settings import Settings, StoreSettings
from serving import VllmClient
from store import Store

pytestmark = pytest.mark.integration


@pytest.fixture
def fleet(services: Settings, tiny_model_dir: Path, tmp_path: Path) -> Iterator[Settings]:
    """A LoRA fleet of this test's own (``max_loras`` 3), a store and a registry model of its own."""
    with own_fleet(services, tiny_model_dir, max_loras=3, prefix="rtrl-lora-") as settings:
        yield settings.model_copy(
            update={
                "store": StoreSettings(url=f"sqlite:///{tmp_path / 'rtrl.db'}"),
                "mlflow": settings.mlflow.model_copy(
                    update={"model_name": f"tenants-{uuid.uuid4().hex[:8]}"}
                ),
            }
        )


def test_a_tenants_adapter_is_promoted_and_rolled_back_beside_the_others(
    fleet: Settings, tmp_path: Path
) -> None:
    with Store(fleet.store.url) as store:
        store.migrate()
        store.set_tenant("acme", adapter=True)
        store.set_tenant("bolt", adapter=True)
    registry = Registry.from_settings(fleet)
    assert rollout.bootstrap(fleet, registry, fleet.vllm.model_dir) == 1
    report = reconcile_once(fleet, registry)  # each tenant's line: its identity v1, on every server
    assert report is not None and report.lines == {"acme": 1, "bolt": 1} and not report.errors, report
    acme, bolt = tenant_line(fleet, "acme"), tenant_line(fleet, "bolt")
    acme_registry = Registry.for_line(acme)
    for url in (*fleet.vllm.servers, fleet.vllm.staging_server):
        assert url is not None
        with VllmClient(url, model=fleet.vllm.served_model_name) as server:
            loaded = server.adapter_versions()
            assert (loaded[acme.served_name], loaded[bolt.served_name]) == (1, 1), loaded
            assert server.weight_version() == 1
    again = reconcile_once(fleet, registry)  # aligned: nothing to do
    assert again is not None and not again.swaps and not again.errors, again

    prompt = list(build_probe(fleet.vllm.model_dir).token_ids[0])
    url = fleet.vllm.servers[0]
    before = {line.tenant: _answer(url, line.served_name, prompt) for line in (acme, bolt)}

    # acme's v2: its v1 with B drawn at random, so that its outputs move (any trained adapter would do).
    v2 = _perturbed(acme_registry.download_checkpoint(1), tmp_path / "acme-v2")
    version = acme_registry.register_checkpoint(
        v2, tags={"rtrl.adapter": "lora", "rtrl.base_model": str(fleet.vllm.model_dir.resolve())}
    )
    assert version == 2
    result = rollout.promote(
        acme.settings, acme_registry, 2, force_reason="test: a perturbed adapter", role="test"
    )
    assert result.ok and all(s.verified for s in result.servers), result
    with VllmClient(url, model=fleet.vllm.served_model_name) as server:
        loaded = server.adapter_versions()
        assert (loaded[acme.served_name], loaded[bolt.served_name]) == (2, 1), loaded
        assert server.weight_version() == 1  # the global adapter's label never moves for a tenant
    assert _answer(url, acme.served_name, prompt) != before["acme"]
    _same(_answer(url, bolt.served_name, prompt), before["bolt"])  # bolt untouched

    back = rollout.rollback(acme.settings, acme_registry, role="test")
    assert back.ok and back.version == 1, back
    assert acme_registry.champion() == 1 and Registry.for_line(bolt).champion() == 1
    with VllmClient(url, model=fleet.vllm.served_model_name) as server:
        loaded = server.adapter_versions()
        assert (loaded[acme.served_name], loaded[bolt.served_name]) == (1, 1), loaded
        assert server.weight_version() == 1
    _same(_answer(url, acme.served_name, prompt), before["acme"])
    _same(_answer(url, bolt.served_name, prompt), before["bolt"])


def _answer(url: str, adapter: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Adapter `adapter`'s greedy continuation of `prompt` on the server at `url`, with its logprobs."""
    with VllmClient(url, model=adapter) as server:
        return server.greedy_logprobs(prompt, ADAPTER_PROBE_TOKENS)


def _same(got: tuple[list[int], list[float]], want: tuple[list[int], list[float]]) -> None:
    assert got[0] == want[0] and got[1] == pytest.approx(want[1], abs=1e-5)


def _perturbed(adapter: Path, out: Path) -> Path:
    """A copy of `adapter` with every lora_B drawn from N(0, 0.05²) (seeded)."""
    shutil.copytree(adapter, out, ignore=shutil.ignore_patterns("rtrl_*", ".*"))
    weights = load_file(out / "adapter_model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name, tensor in weights.items():
        if ".lora_B." in name:
            weights[name] = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype) * 0.05
    save_file(weights, out / "adapter_model.safetensors", metadata={"format": "pt"})
    return out
