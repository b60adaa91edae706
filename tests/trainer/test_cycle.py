"""The training cycle on real services: SQLite store, MLflow server, DeepSpeed on CPU, the tiny model.

Episodes are sampled from the tiny model with transformers and fed through the labeler's own
write/join/settle code (`factories.Feeder`), so their behaviour logprobs are the model's and the
first step's ratios are ≈ 1. The Celery round trip goes through the real Redis broker to a real
(in-thread) worker.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from episodes import feed, sample_episodes
from factories import Feeder, feedback, interaction
from helpers import run_rtrl
from pydantic import TypeAdapter

from registry import CHAMPION, Registry
from schemas.events import FeedbackKind, SamplingParams
from schemas.rewards import TAB_V1, HindsightTerm
from schemas.settings import LOSS_TYPES, DapoLoss, LossSettings, Settings
from store import Store

pytestmark = pytest.mark.integration


def test_cycles_train_save_and_register_challengers(
    settings: Settings, store: Store, registry: Registry, champion: int, tiny_model_dir: Path
) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from trainer.checkpoint import baselines_path
    from trainer.cycle import end_cycle, run_cycle

    feed(store, sample_episodes(tiny_model_dir, 32, seed=1))
    assert store.count_trainable(champion, 0) == 32

    result = run_cycle(settings, store, registry, owner="test")

    assert result.status == "registered"
    assert (result.champion_version, result.challenger_version, result.episodes) == (1, 2, 32)
    assert result.first_interaction_at is not None and result.train_s is not None
    first = result.steps[0]
    # Behaviour logprobs came from this very model: π_θ = π_old = μ on the first step.
    assert first.mean_ratio == pytest.approx(1.0, abs=1e-6)
    assert first.is_weight == pytest.approx(1.0, abs=1e-3)
    assert first.clip_fraction == 0.0 and first.grad_norm is not None and first.grad_norm > 0
    assert result.steps[1].kl_k1 != 0.0, "the second step sees updated weights"

    # The checkpoint: HF format, loads in transformers, differs from the champion.
    ckpt = Path(result.checkpoint_dir or "")
    assert {"config.json", "model.safetensors", "tokenizer.json", "rtrl_checkpoint.json"} <= {
        p.name for p in ckpt.iterdir()
    }
    base, trained = load_file(tiny_model_dir / "model.safetensors"), load_file(ckpt / "model.safetensors")
    assert base.keys() == trained.keys()
    assert any(not torch.equal(base[k], trained[k]) for k in base)
    AutoModelForCausalLM.from_pretrained(ckpt)

    # MLflow: the run, its metrics and lineage, version 2 @challenger.
    run = registry.run(result.mlflow_run_id or "")
    assert run.info.status == "FINISHED"
    assert run.data.params["trainer.loss.type"] == "cispo"
    assert {"loss", "mean_ratio", "clip_fraction", "kl_k1", "grad_norm", "mean_advantage"} <= set(
        run.data.metrics
    )
    assert run.data.tags["rtrl.episodes"] == "32"
    episodes_json = registry.download_run_artifact(run.info.run_id, "episodes.json", ckpt.parent / "lineage")
    with store.transaction() as session:
        from sqlalchemy import select

        from store.models import Episode

        used = set(
            session.scalars(select(Episode.episode_id).where(Episode.used_in_cycle == result.cycle_id))
        )
    assert set(json.loads(episodes_json.read_text())) == used and len(used) == 32
    assert registry.challenger() == 2 and registry.champion() == 1
    tags = registry.version_tags(2)
    assert tags["rtrl.cycle_id"] == str(result.cycle_id) and tags["rtrl.parent_version"] == "1"
    assert registry.download_checkpoint(2).joinpath("model.safetensors").is_file()

    cycle = store.get_cycle(result.cycle_id or 0)
    assert cycle is not None and cycle.status == "registered" and cycle.challenger == 2
    assert set(cycle.episode_ids) == used
    assert store.count_trainable(champion, 0) == 0
    # The cycle's baselines are staged, not committed: its episodes are not spent until it ends.
    committed = baselines_path(settings.trainer.checkpoint_dir, "tab-v1@2")
    assert not committed.exists()
    assert list(settings.trainer.checkpoint_dir.glob(f"baselines-*.cycle-{result.cycle_id}.json"))

    # The gate's verdict would end the cycle; then a second cycle runs in this same process.
    # `rtrl train status --id` shows the same record in full.
    shown = run_rtrl(settings, "train", "status", "--id", str(result.cycle_id))
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["challenger"] == 2 and len(json.loads(shown.stdout)["episode_ids"]) == 32

    end_cycle(settings, store, result.cycle_id or 0, "rejected")  # the gate's verdict: episodes spent
    assert committed.is_file()
    feed(store, sample_episodes(tiny_model_dir, 16, seed=2))
    second = run_cycle(settings, store, registry, owner="test")
    assert second.status == "registered" and second.challenger_version == 3 and second.episodes == 16
    assert registry.challenger() == 3


@pytest.mark.parametrize("loss", LOSS_TYPES)
def test_every_loss_trains_a_real_cycle_on_tempered_truncated_samples(
    settings: Settings, store: Store, registry: Registry, champion: int, tiny_model_dir: Path, loss: str
) -> None:
    """Each loss of the library runs one cycle on samples drawn at T = 0.7, top-p 0.9: the first
    step sees π_θ = π_old and the behaviour weights ≈ 1, no sampled token is outside the trainer's
    truncation, and a challenger is registered."""
    from trainer.cycle import run_cycle

    sampling = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=8, logprobs_mode="processed")
    feed(store, sample_episodes(tiny_model_dir, 16, seed=3, sampling=sampling, alternate=True))
    configured = settings.model_copy(
        update={
            "trainer": settings.trainer.model_copy(
                update={
                    "loss": TypeAdapter(LossSettings).validate_python({"type": loss}),
                    "min_samples": 8,
                }
            )
        }
    )

    result = run_cycle(configured, store, registry, owner="test")

    assert result.status == "registered", result
    first = result.steps[0]
    assert first.mean_ratio == pytest.approx(1.0, abs=1e-6)
    assert first.is_weight == pytest.approx(1.0, abs=1e-3)
    assert first.impossible_tokens == 0 and result.unreproducible_rows == 0
    assert all(math.isfinite(step.loss) for step in result.steps)
    assert result.steps[1].kl_k1 != 0.0, "the second step sees updated weights"
    assert registry.run(result.mlflow_run_id or "").data.params["trainer.loss.type"] == loss
    # rft learns from the 8 thumbs-up episodes; dpo pairs each prompt's up and down (8 pairs).
    assert result.no_signal_rows == 0 and result.trainable_rows == (8 if loss == "rft" else 16)
    assert result.selection == {
        "rft": {"rft_accepted": 8, "rft_left_out": 8},
        "dpo": {"dpo_pairs": 8, "dpo_unpaired": 0},
    }.get(loss, {})


@pytest.mark.parametrize(("stage", "precision"), [(2, "fp32"), (3, "fp32"), (2, "bf16")])
def test_zero_stages_train_a_real_cycle_and_save_a_loadable_checkpoint(
    settings: Settings,
    store: Store,
    registry: Registry,
    champion: int,
    tiny_model_dir: Path,
    stage: int,
    precision: str,
) -> None:
    """ZeRO 2 (optimizer state and gradients partitioned) and 3 (parameters too, gathered to save),
    and bf16 (what a GPU trains in; DeepSpeed's CPU accelerator runs it too); stage 0 in fp32 is the
    default every other cycle test runs."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from trainer.cycle import run_cycle

    feed(store, sample_episodes(tiny_model_dir, 16, seed=6, alternate=True))
    configured = settings.model_copy(
        update={"trainer": settings.trainer.model_copy(update={"zero_stage": stage, "precision": precision})}
    )

    result = run_cycle(configured, store, registry, owner="test")

    assert result.status == "registered", result
    assert (
        result.steps[0].mean_ratio == pytest.approx(1.0, abs=1e-6) and result.steps[0].grad_norm is not None
    )
    assert result.steps[1].kl_k1 != 0.0, "the second step sees updated weights"
    ckpt = Path(result.checkpoint_dir or "")
    base, trained = load_file(tiny_model_dir / "model.safetensors"), load_file(ckpt / "model.safetensors")
    assert base.keys() == trained.keys() and all(base[k].shape == trained[k].shape for k in base)
    assert any(not torch.equal(base[k], trained[k]) for k in base)
    AutoModelForCausalLM.from_pretrained(ckpt)


@pytest.mark.parametrize("loss", ["cispo", "rft"])
def test_a_real_cycle_distils_written_corrections(
    settings: Settings,
    store: Store,
    registry: Registry,
    champion: int,
    tiny_model_dir: Path,
    tmp_path: Path,
    loss: str,
) -> None:
    """tab-v1 with a hindsight term: every rejected episode also got a written correction, in the
    same batch as its rejection. The cycle loads the champion as the teacher, trains and registers a
    challenger, and the result and the run count the 8 distilled episodes; under rft, which keeps
    only the 8 accepted episodes, the corrected ones join at advantage 0 (16 rows)."""
    from trainer.cycle import run_cycle

    spec_file = tmp_path / "hindsight.json"
    spec = TAB_V1.model_copy(update={"hindsight": HindsightTerm(weight=1.0)})
    spec_file.write_text(spec.model_dump_json())
    pairs = sample_episodes(tiny_model_dir, 16, seed=7, alternate=True)
    corrections = [
        feedback(verdict.request_id, "correction", text="Answer with an exclamation mark!")
        for _, verdict in pairs
        if verdict.kind == FeedbackKind.thumbs_down
    ]
    Feeder(store).send(*[event for pair in pairs for event in pair], *corrections)
    configured = settings.model_copy(
        update={
            "labeler": settings.labeler.model_copy(update={"reward_spec": str(spec_file)}),
            "trainer": settings.trainer.model_copy(
                update={"loss": TypeAdapter(LossSettings).validate_python({"type": loss}), "min_samples": 8}
            ),
        }
    )

    result = run_cycle(configured, store, registry, owner="test")

    assert result.status == "registered" and result.challenger_version is not None, result
    assert len(corrections) == 8 and result.trainable_rows == 16
    assert result.hindsight["hindsight_episodes"] == 8 and result.hindsight["hindsight_rows"] == 8
    assert result.hindsight["hindsight_added_rows"] == (8 if loss == "rft" else 0)
    assert result.hindsight["hindsight_tokens"] > 0 and math.isfinite(result.hindsight["hindsight_gap_mean"])
    assert result.steps[0].mean_ratio == pytest.approx(1.0, abs=1e-6)
    assert all(math.isfinite(step.loss) for step in result.steps)
    run = registry.run(result.mlflow_run_id or "")
    assert run.data.metrics["hindsight_episodes"] == 8.0
    assert run.data.params["reward.hindsight.weight"] == "1.0"


def test_a_real_cycle_replays_retention_data_beside_the_policy_objective(
    settings: Settings, store: Store, registry: Registry, champion: int, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """trainer.replay on a file of the task's training questions (services/tinymodel.py): the
    cycle trains and registers; the replay rows are no episodes (not counted, not in the policy's
    tokens or the trust region's), every step reports their NLL, and the run logs it."""
    from schemas.settings import ReplaySettings
    from services.tinymodel import replay_examples, write_replay
    from trainer.cycle import run_cycle

    path = write_replay(tmp_path / "replay.jsonl", replay_examples("exclaim", seed=0))
    feed(store, sample_episodes(tiny_model_dir, 16, seed=3))
    configured = settings.model_copy(
        update={
            "trainer": settings.trainer.model_copy(
                update={"replay": ReplaySettings(path=path, weight=1.0, per_cycle=8)}
            )
        }
    )

    result = run_cycle(configured, store, registry, owner="test")

    assert result.status == "registered" and result.challenger_version is not None, result
    assert (result.episodes, result.trainable_rows) == (16, 16)
    assert all(step.tokens == result.tokens == step.kl_tokens for step in result.steps)
    assert result.steps[0].mean_ratio == pytest.approx(1.0, abs=1e-6)  # π_old is the policy's alone
    assert all(step.replay_tokens > 0 and math.isfinite(step.replay_nll or math.nan) for step in result.steps)
    assert 0 < (result.steps[0].replay_nll or 0) < 10
    run = registry.run(result.mlflow_run_id or "")
    assert "replay_nll" in run.data.metrics


def test_the_kl_penalty_to_the_base_holds_the_promoted_champion_to_it(
    settings: Settings, store: Store, registry: Registry, champion: int, tiny_model_dir: Path
) -> None:
    """trainer.loss.ref_kl_coef > 0 (trainer/reference.py): a reference that is not registered fails
    the cycle before the lease; from the base the reference is the champion's own first passes (KL 0
    at the first step, the distance reported as the weights move); once a challenger is promoted, the
    next cycle loads the base's checkpoint and its first step already measures the champion's drift."""
    from schemas.settings import CispoLoss
    from trainer.cycle import end_cycle, run_cycle
    from trainer.reference import ReferenceMissing

    anchored = settings.model_copy(
        update={
            "trainer": settings.trainer.model_copy(
                # A large step without warm-up or trust region, so that the champion moves visibly.
                update={"loss": CispoLoss(ref_kl_coef=0.5), "lr": 1e-2, "warmup_steps": 0, "max_kl": None}
            )
        }
    )
    feed(store, sample_episodes(tiny_model_dir, 16, seed=41, alternate=True))
    missing = anchored.model_copy(update={"trainer": anchored.trainer.model_copy(update={"reference": "9"})})
    with pytest.raises(ReferenceMissing, match="trainer.reference=9 names v9"):
        run_cycle(missing, store, registry, owner="test")
    assert store.recent_cycles(1) == [] and store.count_trainable(champion, 0) == 16

    first = run_cycle(anchored, store, registry, owner="test")
    assert first.status == "registered", first
    assert first.steps[0].ref_kl_k3 == pytest.approx(0.0, abs=1e-6)
    assert (first.steps[-1].ref_kl_k3 or 0.0) > 1e-4
    assert {"ref_kl_k1", "ref_kl_k3"} <= set(registry.run(first.mlflow_run_id or "").data.metrics)
    lineage = json.loads((Path(first.checkpoint_dir or "") / "rtrl_checkpoint.json").read_text())
    assert lineage["reference"] == {"version": champion, "ref_kl_coef": 0.5}

    end_cycle(anchored, store, first.cycle_id or 0, "promoted")
    registry.set_alias(CHAMPION, first.challenger_version or 0)
    store.record_promotion(registry.model_name, first.challenger_version or 0, "force", "test", "by hand")
    champion_dir = registry.download_checkpoint(first.challenger_version or 0)
    feed(
        store,
        sample_episodes(champion_dir, 16, seed=42, version=f"v{first.challenger_version}", alternate=True),
    )
    second = run_cycle(anchored, store, registry, owner="test")
    assert second.status == "registered", second
    assert second.steps[0].mean_ratio == pytest.approx(1.0, abs=1e-5)  # π_old is still the champion
    assert (second.steps[0].ref_kl_k3 or 0.0) > 1e-4, "the champion's distance from the base, at once"
    assert second.steps[0].kl_k3 == pytest.approx(0.0, abs=1e-6)


def test_dapo_leaves_rows_without_signal_out(
    settings: Settings, store: Store, registry: Registry, champion: int, tiny_model_dir: Path
) -> None:
    """Pairs that share a prompt and got the same feedback have advantage 0 on a first cycle's
    group baseline: DAPO's dynamic sampling drops them (overlong shaping off here, so that the
    rewards are the feedback's)."""
    from trainer.cycle import run_cycle

    sampling = SamplingParams(max_tokens=8, logprobs_mode="processed")
    pairs = sample_episodes(tiny_model_dir, 16, seed=4, sampling=sampling)
    # Pairs 0-3 split (up, down); pairs 4-7 agree (up, up): only the first 8 rows carry a signal.
    pairs = [
        (event, feedback(event.request_id, "thumbs_up" if i >= 8 or i % 2 == 0 else "thumbs_down"))
        for i, (event, _) in enumerate(pairs)
    ]
    feed(store, pairs)
    configured = settings.model_copy(
        update={
            "trainer": settings.trainer.model_copy(
                update={
                    "loss": DapoLoss(overlong_buffer=0.0),
                    "min_samples": 8,
                }
            )
        }
    )

    result = run_cycle(configured, store, registry, owner="test")

    assert result.status == "registered", result
    assert (result.trainable_rows, result.no_signal_rows) == (8, 8)


def test_a_cycle_whose_promotion_fails_leaves_the_baselines_as_they_were(
    settings: Settings, store: Store, registry: Registry, champion: int, tiny_model_dir: Path
) -> None:
    """Its episodes go back to the pool: had its baselines been kept, those episodes would train
    again against baselines that already hold their own rewards."""
    from trainer.checkpoint import baselines_path, load_baselines
    from trainer.cycle import end_cycle, run_cycle

    feed(store, sample_episodes(tiny_model_dir, 16, seed=5, alternate=True))
    first = run_cycle(settings, store, registry, owner="test")
    assert first.status == "registered"
    end_cycle(settings, store, first.cycle_id or 0, "failed", error="swap failed: test")
    committed = baselines_path(settings.trainer.checkpoint_dir, "tab-v1@2")
    assert not committed.exists() and not list(
        settings.trainer.checkpoint_dir.glob("baselines-*.cycle-*.json")
    )
    assert store.count_trainable(champion, 0) == 16, "the episodes went back to the pool"

    second = run_cycle(
        settings, store, registry, owner="test"
    )  # the same episodes, the same (empty) baselines
    assert second.status == "registered" and second.episodes == 16
    assert [s.mean_advantage for s in second.steps] == pytest.approx([s.mean_advantage for s in first.steps])
    end_cycle(settings, store, second.cycle_id or 0, "promoted")
    assert load_baselines(settings.trainer.checkpoint_dir, "tab-v1@2").prompts  # committed on promotion


def test_a_batch_without_signal_is_skipped_not_shipped(
    settings: Settings, store: Store, registry: Registry, champion: int, tiny_model_dir: Path
) -> None:
    """Traffic with no feedback at all: every episode settles by the window with reward 0 and
    carries no signal (on a first cycle every advantage is 0 too, but the decision reads the
    feedback: tests/trainer/test_estimators.py). The cycle trains nothing, registers nothing and
    spends the episodes."""
    from factories import at

    from trainer.checkpoint import baselines_path
    from trainer.cycle import run_cycle

    feeder = Feeder(store)
    feeder.send(*[event for event, _ in sample_episodes(tiny_model_dir, 16, seed=7)])
    assert feeder.settle_window(at(31), 30) == 16

    result = run_cycle(settings, store, registry, owner="test")

    assert (result.status, result.challenger_version, result.signal_episodes, result.steps) == (
        "skipped",
        None,
        0,
        [],
    )
    assert result.trainable_rows == 16
    cycle = store.get_cycle(result.cycle_id or 0)
    assert cycle is not None and cycle.status == "skipped"
    assert store.count_trainable(champion, 0) == 0, "the episodes are spent"
    assert registry.challenger() is None
    assert baselines_path(settings.trainer.checkpoint_dir, "tab-v1@2").is_file()


def test_the_optimizer_state_carries_over_to_the_cycle_that_trains_the_promoted_version(
    settings: Settings, store: Store, registry: Registry, champion: int, tiny_model_dir: Path
) -> None:
    """A fresh AdamW takes steps of about lr whatever the gradient; the next cycle continues the
    moments of the cycle that produced its champion, unless the ZeRO stage or precision changed.
    The learning rate warms up over the optimizer's life (trainer.warmup_steps): a fresh one from
    lr / N, a carried one where the last cycle left it."""
    from trainer.checkpoint import optimizer_dir
    from trainer.cycle import end_cycle, run_cycle
    from trainer.engine import warmup_lr

    lr, warmup = settings.trainer.learning_rate, settings.trainer.warmup_steps
    assert warmup > settings.trainer.steps  # so the second cycle is still warming up

    def lrs(steps: list[Any]) -> list[float | None]:
        return [s.lr for s in steps if s.applied]

    feed(store, sample_episodes(tiny_model_dir, 16, seed=8, alternate=True))
    first = run_cycle(settings, store, registry, owner="test")
    assert first.status == "registered" and first.optimizer_from_cycle is None  # from the base model: fresh
    taken = len(lrs(first.steps))
    assert lrs(first.steps) == pytest.approx([warmup_lr(lr, t, warmup) for t in range(1, taken + 1)])
    assert optimizer_dir(settings.trainer.checkpoint_dir, first.cycle_id or 0).is_dir()
    end_cycle(settings, store, first.cycle_id or 0, "promoted")
    registry.set_alias(CHAMPION, first.challenger_version or 0)
    store.record_promotion(registry.model_name, first.challenger_version or 0, "force", "test", "by hand")

    version, champion_dir = (
        f"v{first.challenger_version}",
        registry.download_checkpoint(first.challenger_version or 0),
    )
    feed(store, sample_episodes(champion_dir, 16, seed=9, version=version, alternate=True))
    second = run_cycle(settings, store, registry, owner="test")
    assert second.status == "registered" and second.optimizer_from_cycle == first.cycle_id
    # Loading the state kept the champion's weights: its own samples' behaviour weights are 1.
    assert second.steps[0].is_weight == pytest.approx(1.0, abs=1e-3)
    assert second.steps[0].lr == pytest.approx(warmup_lr(lr, taken + 1, warmup))
    end_cycle(settings, store, second.cycle_id or 0, "rejected")

    feed(store, sample_episodes(champion_dir, 16, seed=10, version=version, alternate=True))
    other = settings.model_copy(update={"trainer": settings.trainer.model_copy(update={"zero_stage": 2})})
    third = run_cycle(other, store, registry, owner="test")
    assert third.status == "registered" and third.optimizer_from_cycle is None  # saved at stage 0: fresh
    assert third.steps[0].lr == pytest.approx(lr / warmup)  # ZeRO 2's fresh optimizer warms up again


def test_the_trust_region_stops_a_cycle_before_the_step_that_would_leave_it(
    settings: Settings, store: Store, registry: Registry, champion: int, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """With trainer.max_kl, the first step whose forward passes measure the policy beyond it is not
    applied and the cycle stops: its checkpoint holds exactly the weights of the steps before (the
    same batch trained for that many steps without a trust region gives the same tensors)."""
    from safetensors.torch import load_file

    from trainer.cycle import run_cycle

    pairs = sample_episodes(tiny_model_dir, 16, seed=11, alternate=True)
    feed(store, pairs)
    bounded = settings.model_copy(
        update={
            "trainer": settings.trainer.model_copy(
                update={"steps": 6, "lr": 1e-2, "max_kl": 1e-4, "carry_optimizer": False}
            )
        }
    )

    result = run_cycle(bounded, store, registry, owner="test")

    assert result.status == "registered" and result.kl_stopped_at_step == 1, result
    assert [s.applied for s in result.steps] == [True, False]
    assert result.steps[0].kl_k3 == pytest.approx(0.0, abs=1e-9)  # π_θ = π_old before any update
    assert result.steps[1].kl_k3 > 1e-4 and result.steps[1].grad_norm is None
    run = registry.run(result.mlflow_run_id or "")
    assert run.data.metrics["applied"] == 0.0 and "kl_k3" in run.data.metrics

    # The same episodes in a store of their own, one step, no trust region: the same weights.
    other = Store(f"sqlite:///{tmp_path / 'other.db'}")
    other.migrate()
    try:
        feed(other, pairs)
        one_step = bounded.model_copy(
            update={
                "store": bounded.store.model_copy(update={"url": f"sqlite:///{tmp_path / 'other.db'}"}),
                "trainer": bounded.trainer.model_copy(
                    update={"steps": 1, "max_kl": None, "checkpoint_dir": tmp_path / "other-checkpoints"}
                ),
            }
        )
        reference = run_cycle(one_step, other, registry, owner="test")
    finally:
        other.close()
    assert reference.status == "registered" and reference.kl_stopped_at_step is None
    stopped = load_file(Path(result.checkpoint_dir or "") / "model.safetensors")
    expected = load_file(Path(reference.checkpoint_dir or "") / "model.safetensors")
    assert all(torch.equal(stopped[k], expected[k]) for k in expected)
    base = load_file(tiny_model_dir / "model.safetensors")
    assert any(not torch.equal(base[k], stopped[k]) for k in base)  # step 0 was applied


def test_failed_cycle_registers_nothing_and_releases_its_episodes(
    settings: Settings, store: Store, registry: Registry, champion: int, tiny_model_dir: Path
) -> None:
    from trainer.cycle import run_cycle

    feed(store, sample_episodes(tiny_model_dir, 16, seed=3))
    # A corrupt cached champion checkpoint: the failure happens after the episodes are claimed
    # and the MLflow run is started.
    broken = registry.checkpoints_dir / f"v{champion}"
    broken.mkdir(parents=True)
    (broken / "config.json").write_text("{not json")
    (broken / "tokenizer.json").write_text("{}")
    (broken / ".rtrl-complete").write_text("test\n")

    with pytest.raises(Exception) as failure:
        run_cycle(settings, store, registry, owner="test")

    assert registry.versions() == [1]
    assert registry.challenger() is None
    assert store.count_trainable(champion, 0) == 16, "the episodes went back to the pool"
    [cycle] = store.recent_cycles(10)
    assert cycle.status == "failed" and type(failure.value).__name__ in (cycle.error or "")
    runs = registry.runs("tags.`rtrl.kind` = 'training_cycle'")
    assert [r.info.status for r in runs] == ["FAILED"]


def test_no_cycle_without_enough_data_or_while_another_holds_the_lease(
    settings: Settings, store: Store, registry: Registry, champion: int
) -> None:
    from trainer.cycle import run_cycle

    assert run_cycle(settings, store, registry, owner="test").status == "not_enough_data"
    relaxed = settings.model_copy(update={"trainer": settings.trainer.model_copy(update={"min_samples": 1})})
    feed(store, [(interaction(f"fake-{i}"), feedback(f"r-fake-{i}-0", "thumbs_up")) for i in range(2)])
    assert store.acquire_cycle("someone-else", 600, champion) is not None
    assert run_cycle(relaxed, store, registry, owner="test").status == "busy"


def test_celery_round_trip_through_the_real_broker(
    settings: Settings, store: Store, champion: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real worker (in a thread, solo pool) consumes rtrl.train_cycle and rtrl.maybe_train from Redis."""
    from celery.contrib.testing.worker import start_worker

    from worker import tasks
    from worker.app import configure
    from worker.tasks import maybe_train, train_cycle

    monkeypatch.setattr(tasks, "_resources", None)  # the worker opens this test's store and registry

    app = configure(settings)
    try:
        with start_worker(
            app, pool="solo", concurrency=1, perform_ping_check=False, loglevel="WARNING", shutdown_timeout=30
        ):
            result = train_cycle.apply_async().get(timeout=120)
            assert result["status"] == "not_enough_data" and result["gate"] is None
            assert result["version_after"] == champion
            assert maybe_train.apply_async().get(timeout=60) == "waiting: 0 < 16 trainable episodes of v1"

            # `rtrl train pause`: beat's check enqueues nothing until `rtrl train resume`.
            paused = run_rtrl(settings, "train", "pause", "--reason", "looking at v1")
            assert paused.returncode == 0 and json.loads(paused.stdout)["paused"] is True, paused.stderr
            said = maybe_train.apply_async().get(timeout=60)
            assert said.startswith("paused since ") and "(looking at v1)" in said, said
            assert json.loads(run_rtrl(settings, "train", "resume").stdout) == {"paused": False}

            # The cadence: a cycle that spent its episodes started just now holds the next one back
            # for trainer.cadence_s (5 h by default); a failed one does not.
            failed = store.acquire_cycle("elsewhere", 60, champion)
            assert failed is not None
            store.finish_cycle(failed, "failed", error="x")
            assert maybe_train.apply_async().get(timeout=60).startswith("waiting: ")
            spent = store.acquire_cycle("elsewhere", 60, champion)
            assert spent is not None
            store.finish_cycle(spent, "registered", challenger=2)
            store.finish_cycle(spent, "rejected")
            said = maybe_train.apply_async().get(timeout=60)
            assert said.startswith("cadence: next cycle not before ") and "cadence_s 18000" in said, said
    finally:
        if tasks._resources is not None:
            tasks._resources.store.close()
