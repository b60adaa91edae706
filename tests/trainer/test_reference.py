"""The fixed KL reference (trainer/reference.py): which version ``trainer.reference`` names and how the
ranks get its logprobs, and the steps' penalty to it on a real DeepSpeed engine (CPU, the untuned
tiny model; no services).

The registry here is a stand-in answering the three questions `resolve` asks (its versions, a
version's tags, a version's checkpoint); the real one is exercised by tests/trainer/test_cycle.py
and tests/trainer/test_lora_cycle.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from registry import Registry
from schemas.settings import CispoLoss, Settings, TrainerSettings
from serving.adapters import write_identity_adapter
from serving.sampler import MicroBatch, Row, collate, token_logprobs
from trainer import reference
from trainer.reference import Reference, ReferenceMissing

pytestmark = pytest.mark.unit


class Versions:
    """A registry of `dirs` (version → checkpoint directory) with `tags` per version."""

    model_name = "reference-test"

    def __init__(self, dirs: dict[int, Path], tags: dict[int, dict[str, str]] | None = None) -> None:
        self.dirs, self.tags = dirs, tags or {}
        self.downloads: list[int] = []

    def versions(self) -> list[int]:
        return sorted(self.dirs)

    def version_tags(self, version: int) -> dict[str, str]:
        return self.tags.get(version, {})

    def download_checkpoint(self, version: int) -> Path:
        self.downloads.append(version)
        return self.dirs[version]


def with_trainer(ref_kl_coef: float, named: str = "base", adapter: str = "full") -> Settings:
    base = Settings(_env_file=None)
    loss = CispoLoss(ref_kl_coef=ref_kl_coef)
    return base.model_copy(
        update={
            "trainer": base.trainer.model_copy(update={"loss": loss, "reference": named, "adapter": adapter})
        }
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from services.tinymodel import build

    return build(tmp_path_factory.mktemp("tiny"), task=None)  # untuned: the weights do not matter here


def registry(versions: Versions) -> Registry:
    return cast(Registry, versions)


# ---- which version, and how the ranks get it --------------------------------------------------------


def test_no_penalty_asks_the_registry_nothing() -> None:
    versions = Versions({})
    assert reference.resolve(with_trainer(0.0), registry(versions), champion=3) is None


@pytest.mark.parametrize(("named", "dirs"), [("base", {}), ("7", {1: Path("v1"), 2: Path("v2")})])
def test_a_reference_that_is_not_registered_fails_naming_the_setting(
    named: str, dirs: dict[int, Path]
) -> None:
    with pytest.raises(ReferenceMissing, match=f"trainer.reference={named} .*ref_kl_coef=0.1"):
        reference.resolve(with_trainer(0.1, named), registry(Versions(dirs)), champion=2)


def test_the_base_is_the_first_version_and_the_champion_itself_loads_nothing(model_dir: Path) -> None:
    versions = Versions({1: model_dir, 2: model_dir, 3: model_dir})
    assert reference.resolve(with_trainer(0.1), registry(versions), champion=1) == Reference(1, "champion")
    assert reference.resolve(with_trainer(0.1, "2"), registry(versions), champion=2) == Reference(
        2, "champion"
    )
    assert versions.downloads == []
    found = reference.resolve(with_trainer(0.1), registry(versions), champion=3)
    assert found == Reference(1, "weights", model_dir, None) and versions.downloads == [1]


def test_a_lora_cycle_disables_its_adapter_for_the_base_and_loads_any_other_version(
    model_dir: Path, tmp_path: Path
) -> None:
    adapter = write_identity_adapter(
        model_dir, tmp_path / "v2", rank=4, alpha=8, dropout=0.0, target_modules=("q_proj",)
    )
    versions = Versions({1: tmp_path / "v1", 2: adapter, 3: adapter}, tags={1: {"rtrl.base": "true"}})
    lora = with_trainer(0.1, adapter="lora")
    assert reference.resolve(lora, registry(versions), champion=3) == Reference(1, "adapter_off")
    assert versions.downloads == [], "the base adapter is never loaded: the engine's adapter is disabled"
    found = reference.resolve(with_trainer(0.1, "2", adapter="lora"), registry(versions), champion=3)
    assert found is not None and (found.source, found.directory) == ("weights", adapter)
    assert found.base_dir == lora.vllm.model_dir.expanduser().resolve()


def test_a_reference_the_mode_cannot_load_fails_naming_the_setting(model_dir: Path) -> None:
    versions = Versions({1: model_dir, 2: model_dir})  # full weights, but the cycle trains an adapter
    with pytest.raises(ReferenceMissing, match=r"trainer.reference=base \(v1\).*trainer.adapter=lora"):
        reference.resolve(with_trainer(0.1, adapter="lora"), registry(versions), champion=2)


def test_a_multi_rank_job_carries_the_reference(tmp_path: Path) -> None:
    for ref in (Reference(1, "champion"), Reference(4, "weights", tmp_path / "v4", tmp_path / "base")):
        assert Reference.from_job(ref.to_job()) == ref
    assert Reference.from_job(None) is None


# ---- the steps, on a real engine ----------------------------------------------------------------------


def batches() -> list[MicroBatch]:
    rows = [
        Row([5, 6, 7, 8, 9, 10], 3, [-3.0, -3.0, -3.0], 1.0),
        Row([5, 6, 11, 12], 2, [-3.0, -3.0], -1.0),
    ]
    return [collate(rows, pad_id=0)]


def trainer(**update: Any) -> TrainerSettings:
    """Three steps at a large learning rate (the weights move at once), no trust region, the
    reference penalty on unless `update` says otherwise."""
    fields: dict[str, Any] = {
        "steps": 3,
        "micro_batch": 4,
        "lr": 1e-2,
        "warmup_steps": 0,
        "carry_optimizer": False,
        "max_kl": None,
        "loss": CispoLoss(ref_kl_coef=0.5),
    }
    return TrainerSettings(**(fields | update))


@pytest.fixture
def engine(model_dir: Path) -> Iterator[Any]:
    from trainer.engine import close_engine, start_engine

    started = start_engine(model_dir, trainer(), accumulation=1)
    yield started
    close_engine(started)


@pytest.mark.parametrize("source", ["champion", "weights"])
def test_the_steps_penalise_the_distance_to_the_reference_and_report_it(
    engine: Any, model_dir: Path, source: str
) -> None:
    """The policy starts at the reference (the champion itself, or the same weights loaded from
    their checkpoint): π_ref's logprobs are the policy's, the first step's KL to it 0, and once the
    weights moved every later step reports it."""
    from trainer.losses import Normaliser, loss_function
    from trainer.steps import run_steps

    cfg, mbs = trainer(), batches()
    ref = Reference(1, "champion") if source == "champion" else Reference(1, "weights", model_dir)
    scored = reference.logprobs(engine, mbs, ref)
    if source == "weights":
        with torch.no_grad():
            policy = token_logprobs(engine, mbs[0]).tempered
        assert scored[0] is not None and torch.allclose(scored[0], policy, atol=1e-6)
    else:
        assert scored == [None], "π_old's own passes stand for a reference that is the champion"
    trained = run_steps(
        engine,
        mbs,
        cfg,
        loss_function(cfg.loss),
        Normaliser(tokens=5, sequences=2),
        mean_advantage=0.0,
        reference=ref,
    )
    first, *later = trained.steps
    assert first.ref_kl_k1 == pytest.approx(0.0, abs=1e-6) and first.ref_kl_k3 == pytest.approx(0.0, abs=1e-6)
    assert all(s.ref_kl_k3 is not None and s.ref_kl_k3 > 0 for s in later)
    # With π_ref the champion, the KL to it is the champion's own KL, by the same estimator's sums.
    if source == "champion":
        assert [s.ref_kl_k1 for s in later] == pytest.approx([-s.kl_k1 for s in later], abs=1e-5)


def test_without_the_penalty_the_steps_report_no_reference(engine: Any) -> None:
    from trainer.losses import Normaliser, loss_function
    from trainer.steps import mlflow_metrics, run_steps

    cfg = trainer(loss=CispoLoss())
    trained = run_steps(engine, batches(), cfg, loss_function(cfg.loss), Normaliser(5, 2), mean_advantage=0.0)
    assert all(s.ref_kl_k1 is None and s.ref_kl_k3 is None for s in trained.steps)
    assert "ref_kl_k3" not in mlflow_metrics(trained.steps[0])


def test_a_lora_engine_scores_the_base_with_its_adapter_disabled(model_dir: Path, tmp_path: Path) -> None:
    """An adapter that moved (B ≠ 0): the policy's logprobs differ from the base model's, and the
    reference's, taken from the same engine with the adapter disabled, are the base model's."""
    from transformers import AutoModelForCausalLM

    from trainer.engine import close_engine, start_engine

    cfg = trainer(adapter="lora")
    lora = cfg.lora
    adapter = write_identity_adapter(
        model_dir,
        tmp_path / "v1",
        rank=lora.rank,
        alpha=lora.alpha,
        dropout=0.0,
        target_modules=lora.target_modules,
    )
    engine = start_engine(adapter, cfg, accumulation=1, base_dir=model_dir)
    try:
        with torch.no_grad():
            for name, param in engine.module.named_parameters():
                if "lora_B" in name:
                    param.add_(0.05)
            mbs = batches()
            policy = token_logprobs(engine, mbs[0]).tempered
            base = token_logprobs(AutoModelForCausalLM.from_pretrained(model_dir).eval(), mbs[0]).tempered
        [scored] = reference.logprobs(engine, mbs, Reference(1, "adapter_off"))
        assert scored is not None and torch.allclose(scored, base, atol=1e-5)
        assert not torch.allclose(policy, base, atol=1e-3), "the adapter moved the policy"
        with torch.no_grad():
            again = token_logprobs(engine, mbs[0]).tempered
        assert torch.equal(again, policy), "the adapter is enabled again after scoring"
    finally:
        close_engine(engine)
