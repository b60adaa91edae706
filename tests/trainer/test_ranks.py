"""Multi-rank cycles (``trainer.ranks`` = 2): two DeepSpeed data-parallel rank processes on CPU train
the same update as one rank on the same batch, rank 0's checkpoint is registered, and the version
serves (the verified swap onto the session's vLLM server)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from episodes import feed, sample_episodes

from deployer.rollout import promote
from registry import CHAMPION, Registry
from schemas.settings import Settings, StoreSettings
from store import Store

pytestmark = pytest.mark.integration


def test_two_ranks_train_what_one_rank_trains_and_the_version_serves(
    settings: Settings,
    store: Store,
    registry: Registry,
    champion: int,
    tiny_model_dir: Path,
    tmp_path: Path,
    vllm_service: Settings,
) -> None:
    from safetensors.torch import load_file

    from trainer.cycle import run_cycle

    episodes = sample_episodes(tiny_model_dir, 16, seed=31, alternate=True)
    # Four micro-batches: two per rank.
    one = settings.model_copy(update={"trainer": settings.trainer.model_copy(update={"micro_batch": 4})})
    feed(store, episodes)
    single = run_cycle(one, store, registry, owner="test")
    assert single.status == "registered", single

    # The same episodes in a store and registry of their own, trained by two ranks.
    two_store = Store(f"sqlite:///{tmp_path / 'two.db'}")
    two_store.migrate()
    two = one.model_copy(
        update={
            "store": StoreSettings(url=f"sqlite:///{tmp_path / 'two.db'}"),
            "mlflow": one.mlflow.model_copy(update={"model_name": one.mlflow.model_name + "-2r"}),
            "trainer": one.trainer.model_copy(
                update={"ranks": 2, "checkpoint_dir": tmp_path / "two-checkpoints"}
            ),
        }
    )
    two_registry = Registry.from_settings(two)
    two_registry.set_alias(
        CHAMPION, two_registry.register_checkpoint(tiny_model_dir, tags={"rtrl.base": "true"})
    )
    feed(two_store, episodes)
    double = run_cycle(two, two_store, two_registry, owner="test")
    two_store.close()

    assert double.status == "registered", double
    assert [s.tokens for s in double.steps] == [
        s.tokens for s in single.steps
    ]  # the whole batch, summed over ranks
    for a, b in zip(single.steps, double.steps, strict=True):
        assert b.loss == pytest.approx(a.loss, abs=1e-5) and b.kl_k3 == pytest.approx(a.kl_k3, abs=1e-6)
        assert b.applied == a.applied  # both stop at the same step when the trust region is reached
        if a.applied:
            assert a.grad_norm is not None and b.grad_norm == pytest.approx(a.grad_norm, rel=1e-4)
    base = load_file(tiny_model_dir / "model.safetensors")
    w1 = load_file(Path(single.checkpoint_dir or "") / "model.safetensors")
    w2 = load_file(Path(double.checkpoint_dir or "") / "model.safetensors")
    assert any(not torch.equal(w2[k], base[k]) for k in base)
    assert max(float((w1[k] - w2[k]).abs().max()) for k in base) < 1e-5  # data parallel = the same update
    assert two_registry.version_tags(double.challenger_version or 0)["rtrl.parent_version"] == "1"

    # The version two ranks trained loads and verifies on the session's serving server.
    serving = two.model_copy(update={"vllm": vllm_service.vllm, "services": two.services})
    Store(serving.store.url).migrate()
    swapped = promote(serving, two_registry, double.challenger_version or 0, force_reason="by hand in a test")
    assert swapped.ok and swapped.servers[0].verified, swapped.error
    assert promote(serving, two_registry, 1).ok  # the session's server back on the base model


def test_each_rank_scores_the_kl_reference_of_its_own_micro_batches(
    settings: Settings, store: Store, registry: Registry, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """trainer.loss.ref_kl_coef > 0 with the base v1 a version other than the champion (v2, the same
    weights registered again): each rank loads the reference's checkpoint and scores its own
    micro-batches (trainer/reference.py), and the two ranks' step metrics, the KL to the reference
    included, are one rank's. The reference is the policy at the start: KL 0 at the first step."""
    from schemas.settings import CispoLoss
    from trainer.cycle import run_cycle

    base = registry.register_checkpoint(tiny_model_dir, tags={"rtrl.base": "true"})
    registry.set_alias(CHAMPION, registry.register_checkpoint(tiny_model_dir))
    episodes = sample_episodes(tiny_model_dir, 16, seed=32, version="v2", alternate=True)
    anchored = settings.trainer.model_copy(
        update={"micro_batch": 4, "loss": CispoLoss(ref_kl_coef=0.5), "warmup_steps": 0, "max_kl": None}
    )
    one = settings.model_copy(update={"trainer": anchored})
    feed(store, episodes)
    single = run_cycle(one, store, registry, owner="test")
    assert single.status == "registered", single

    two_store = Store(f"sqlite:///{tmp_path / 'two.db'}")
    two_store.migrate()
    two = one.model_copy(
        update={
            "store": StoreSettings(url=f"sqlite:///{tmp_path / 'two.db'}"),
            "mlflow": one.mlflow.model_copy(update={"model_name": one.mlflow.model_name + "-2r"}),
            "trainer": anchored.model_copy(
                update={"ranks": 2, "checkpoint_dir": tmp_path / "two-checkpoints"}
            ),
        }
    )
    two_registry = Registry.from_settings(two)
    assert two_registry.register_checkpoint(tiny_model_dir, tags={"rtrl.base": "true"}) == base
    two_registry.set_alias(CHAMPION, two_registry.register_checkpoint(tiny_model_dir))
    feed(two_store, episodes)
    double = run_cycle(two, two_store, two_registry, owner="test")
    two_store.close()

    assert double.status == "registered", double
    assert single.steps[0].ref_kl_k3 == pytest.approx(0.0, abs=1e-6)
    assert (single.steps[-1].ref_kl_k3 or 0.0) > 0
    for a, b in zip(single.steps, double.steps, strict=True):
        assert b.loss == pytest.approx(a.loss, abs=1e-5)
        assert b.ref_kl_k1 == pytest.approx(a.ref_kl_k1, abs=1e-6)
        assert b.ref_kl_k3 == pytest.approx(a.ref_kl_k3, abs=1e-6)
