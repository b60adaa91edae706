"""LoRA cycles (``trainer.adapter=lora``) on real services: DeepSpeed trains only the adapter on the
frozen base model, the cycle saves and registers an adapter with its base lineage, the next
cycle continues it (and its optimizer), and a registry's versions never mix adapters and full
weights. Serving the adapter is the ``qwen2-lora`` case of tests/e2e/test_checkpoints.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from episodes import feed, sample_episodes

from registry import CHAMPION, Registry
from schemas.settings import Settings
from serving.adapters import write_identity_adapter
from store import Store
from trainer.checkpoint import CheckpointError

pytestmark = pytest.mark.integration


@pytest.fixture
def lora_settings(settings: Settings, tiny_model_dir: Path) -> Settings:
    return settings.model_copy(
        update={
            "trainer": settings.trainer.model_copy(update={"adapter": "lora"}),
            "vllm": settings.vllm.model_copy(update={"model_dir": tiny_model_dir}),
        }
    )


@pytest.fixture
def lora_champion(lora_settings: Settings, registry: Registry, tiny_model_dir: Path, tmp_path: Path) -> int:
    """The identity adapter on the tiny model as v1 @champion, as `rtrl deploy bootstrap` registers it."""
    lora = lora_settings.trainer.lora
    first = write_identity_adapter(
        tiny_model_dir,
        tmp_path / "v1",
        rank=lora.rank,
        alpha=lora.alpha,
        dropout=lora.dropout,
        target_modules=lora.target_modules,
    )
    version = registry.register_checkpoint(first, tags={"rtrl.base": "true", "rtrl.adapter": "lora"})
    registry.set_alias(CHAMPION, version)
    return version


def test_a_lora_cycle_trains_the_adapter_only_and_registers_it_with_its_base(
    lora_settings: Settings, store: Store, registry: Registry, lora_champion: int, tiny_model_dir: Path
) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from trainer.cycle import end_cycle, run_cycle

    # The identity adapter is the base model: the base model's samples are on-policy.
    feed(store, sample_episodes(tiny_model_dir, 16, seed=21, alternate=True))
    first = run_cycle(lora_settings, store, registry, owner="test")

    assert first.status == "registered", first
    assert first.steps[0].mean_ratio == pytest.approx(1.0, abs=1e-5)
    assert first.steps[0].grad_norm is not None and first.steps[0].grad_norm > 0
    out = Path(first.checkpoint_dir or "")
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "rtrl_checkpoint.json",
    ]
    before = load_file(registry.download_checkpoint(lora_champion) / "adapter_model.safetensors")
    after = load_file(out / "adapter_model.safetensors")
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before if ".lora_B." in k)
    tags = registry.version_tags(first.challenger_version or 0)
    assert tags["rtrl.adapter"] == "lora" and tags["rtrl.base_model"] == str(tiny_model_dir.resolve())

    # vLLM's and transformers' loader both read it; the base weights did not move.
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(out))
    ids = torch.tensor([[1, 5, 9, 20]])
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.allclose(model(input_ids=ids).logits, base(input_ids=ids).logits)
    assert torch.equal(load_file(tiny_model_dir / "model.safetensors")["lm_head.weight"], base.lm_head.weight)

    # The next cycle trains the promoted adapter further, with its optimizer state.
    end_cycle(lora_settings, store, first.cycle_id or 0, "promoted")
    registry.set_alias(CHAMPION, first.challenger_version or 0)
    store.record_promotion(registry.model_name, first.challenger_version or 0, "force", "test", "by hand")
    feed(
        store,
        sample_episodes(tiny_model_dir, 16, seed=22, version=f"v{first.challenger_version}", alternate=True),
    )
    second = run_cycle(lora_settings, store, registry, owner="test")
    assert second.status == "registered" and second.optimizer_from_cycle == first.cycle_id
    assert registry.version_tags(second.challenger_version or 0)["rtrl.parent_version"] == str(
        first.challenger_version
    )


def test_a_lora_cycle_measures_its_distance_from_the_base_with_the_adapter_disabled(
    lora_settings: Settings, store: Store, registry: Registry, lora_champion: int, tiny_model_dir: Path
) -> None:
    """trainer.loss.ref_kl_coef > 0 on adapters: from v1 (the identity adapter) the reference is the
    champion's own passes; after a promotion the base is the engine with its adapter disabled
    (trainer/reference.py), no checkpoint loaded, and the first step measures the adapter's drift."""
    from schemas.settings import CispoLoss
    from trainer.cycle import end_cycle, run_cycle

    anchored = lora_settings.model_copy(
        update={
            "trainer": lora_settings.trainer.model_copy(
                update={"loss": CispoLoss(ref_kl_coef=0.5), "warmup_steps": 0, "max_kl": None}
            )
        }
    )
    feed(store, sample_episodes(tiny_model_dir, 16, seed=24, alternate=True))
    first = run_cycle(anchored, store, registry, owner="test")
    assert first.status == "registered", first
    assert first.steps[0].ref_kl_k3 == pytest.approx(0.0, abs=1e-6)
    assert (first.steps[-1].ref_kl_k3 or 0.0) > 0

    end_cycle(anchored, store, first.cycle_id or 0, "promoted")
    registry.set_alias(CHAMPION, first.challenger_version or 0)
    store.record_promotion(registry.model_name, first.challenger_version or 0, "force", "test", "by hand")
    feed(
        store,
        sample_episodes(tiny_model_dir, 16, seed=25, version=f"v{first.challenger_version}", alternate=True),
    )
    second = run_cycle(anchored, store, registry, owner="test")
    assert second.status == "registered", second
    assert (second.steps[0].ref_kl_k3 or 0.0) > 1e-5, "the promoted adapter's distance from the base"


def test_zero_stage_2_trains_a_lora_cycle(
    lora_settings: Settings, store: Store, registry: Registry, lora_champion: int, tiny_model_dir: Path
) -> None:
    from trainer.cycle import run_cycle

    feed(store, sample_episodes(tiny_model_dir, 16, seed=23, alternate=True))
    staged = lora_settings.model_copy(
        update={"trainer": lora_settings.trainer.model_copy(update={"zero_stage": 2})}
    )
    result = run_cycle(staged, store, registry, owner="test")
    assert result.status == "registered", result
    assert (Path(result.checkpoint_dir or "") / "adapter_model.safetensors").is_file()


def test_a_registry_never_mixes_adapters_and_full_weights(
    settings: Settings,
    lora_settings: Settings,
    store: Store,
    registry: Registry,
    champion: int,
    tiny_model_dir: Path,
) -> None:
    """A full-weight champion (the `champion` fixture) under trainer.adapter=lora is one line, and the
    cycle fails without registering anything."""
    from trainer.cycle import run_cycle

    feed(store, sample_episodes(tiny_model_dir, 16, seed=24, alternate=True))
    with pytest.raises(CheckpointError, match="is full weights, but trainer.adapter=lora"):
        run_cycle(lora_settings, store, registry, owner="test")
    assert registry.versions() == [champion]
