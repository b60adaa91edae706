"""`run_cycle`'s own bookkeeping on a SQLite store, without DeepSpeed or MLflow: the reward spec is
resolved once per cycle, and a cycle that fails part-way is undone (trainer/cycle.py, the module
docstring's guarantees).

The engine functions are replaced by stand-ins and the registry by a recorder of its calls: what
these tests check is what the cycle does around them. The real engine and registry are exercised
by tests/trainer/test_cycle.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from factories import Feeder, feedback, interaction
from pydantic import TypeAdapter

import schemas.rewards
from registry import Registry
from schemas.rewards import TAB_V1, HindsightTerm, RewardSpec
from schemas.settings import LossSettings, Settings
from serving.sampler import MicroBatch, Row
from store import Store
from trainer import cycle, hindsight, training
from trainer.losses import Normaliser
from trainer.steps import StepMetrics, Trained

pytestmark = pytest.mark.unit

EPISODES = 4


class Recorder:
    """The registry calls `run_cycle` makes, recorded in order; `fail` names a call (and its first
    argument, for end_run) that raises instead."""

    model_name = "cycle-steps"

    def __init__(self, champion_dir: Path, store: Store, fail: tuple[str, Any] | None = None) -> None:
        self.champion_dir, self.store, self.fail = champion_dir, store, fail
        self.calls: list[tuple[str, Any]] = []
        self.cycle_status_at_end_run: str | None = None

    def _call(self, name: str, arg: Any = None) -> None:
        self.calls.append((name, arg))
        if self.fail is not None and self.fail == (name, arg):
            raise RuntimeError(f"{name} failed")

    def champion(self) -> int:
        return 1

    def version_tags(self, version: int) -> dict[str, str]:
        return {"rtrl.base": "true"}

    def versions(self) -> list[int]:
        return [1]

    def download_checkpoint(self, version: int) -> Path:
        return self.champion_dir

    def start_run(self, name: str, tags: dict[str, str], params: dict[str, str]) -> str:
        self._call("start_run", params["reward.spec"])
        return "run-1"

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int | None = None) -> None:
        self._call("log_metrics", step)

    def log_json(self, run_id: str, files: dict[str, Any]) -> None:
        self._call("log_json", sorted(files))

    def set_run_tag(self, run_id: str, key: str, value: str) -> None:
        self._call("set_run_tag", key)

    def register_checkpoint(self, directory: Path, run_id: str, tags: dict[str, str]) -> int:
        self._call("register_checkpoint", run_id)
        return 2

    def set_alias(self, alias: str, version: int) -> None:
        self._call("set_alias", version)

    def delete_version(self, version: int) -> None:
        self._call("delete_version", version)

    def end_run(self, run_id: str, status: str) -> None:
        [record] = self.store.recent_cycles(1)
        self.cycle_status_at_end_run = record.status
        self._call("end_run", status)


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[Store]:
    """A migrated SQLite store (tests/trainer/conftest.py's `store` needs the session's Redis and MLflow)."""
    store = Store(f"sqlite:///{tmp_path}/rtrl.db")
    store.migrate()
    yield store
    store.close()


@pytest.fixture
def spec_reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every read of a ``.json`` reward spec from disk (`schemas.rewards.load_spec`), by path."""
    reads: list[Path] = []
    load = schemas.rewards.load_spec

    def counted(path: Path) -> RewardSpec:
        reads.append(path)
        return load(path)

    monkeypatch.setattr(schemas.rewards, "load_spec", counted)
    return reads


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    """tab-v1 as a ``.json`` spec file; a cycle of EPISODES episodes, trainable at once."""
    spec_file = tmp_path / "tab.json"
    spec_file.write_text(TAB_V1.model_dump_json())
    base = Settings(_env_file=None)
    return base.model_copy(
        update={
            "trainer": base.trainer.model_copy(
                update={
                    "min_samples": EPISODES,
                    "checkpoint_dir": tmp_path / "checkpoints",
                    "carry_optimizer": False,
                }
            ),
            "labeler": base.labeler.model_copy(
                update={"reward_spec": str(spec_file), "settle_window_s": 0.0}
            ),
            "gate": base.gate.model_copy(
                update={"ope": base.gate.ope.model_copy(update={"holdout_percent": 0})}
            ),
        }
    )


@pytest.fixture
def champion_dir(tmp_path: Path) -> Path:
    """What `checkpoint.check_source` takes for an HF checkpoint (the engine is a stand-in)."""
    directory = tmp_path / "champion"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "stand-in"}))
    (directory / "tokenizer.json").write_text("{}")
    return directory


def fed(store: Store) -> Store:
    """EPISODES one-call episodes of v1 with feedback, half up and half down."""
    Feeder(store).send(
        *[
            event
            for n in range(EPISODES)
            for event in (
                interaction(f"e{n}"),
                feedback(f"r-e{n}-0", "thumbs_up" if n % 2 else "thumbs_down"),
            )
        ]
    )
    return store


def stand_in_engine(monkeypatch: pytest.MonkeyPatch, steps: Callable[..., Trained]) -> list[object]:
    """Replace the engine functions the cycle's training calls (trainer/training.py); `steps` runs
    as `run_steps`. Returns the engines closed so far."""
    closed: list[object] = []
    monkeypatch.setattr(training, "start_engine", lambda *args, **kwargs: object())
    monkeypatch.setattr(training, "close_engine", closed.append)
    monkeypatch.setattr(training, "state_dict", lambda engine: {"w": torch.zeros(1)})
    monkeypatch.setattr(training, "run_steps", steps)
    return closed


def one_step(*args: Any, **kwargs: Any) -> Trained:
    metrics = StepMetrics(
        step=0,
        loss=0.0,
        mean_ratio=1.0,
        clip_fraction=0.0,
        kl_k1=0.0,
        is_weight=1.0,
        grad_norm=0.1,
        mean_advantage=kwargs["mean_advantage"],
        tokens=2 * EPISODES,
    )
    kwargs["before_step"](0)
    kwargs["after_step"](metrics)
    return Trained([metrics], kl_stop=None)


def test_a_json_reward_spec_is_read_once_per_cycle(
    settings: Settings,
    sqlite_store: Store,
    champion_dir: Path,
    spec_reads: list[Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Count, select, method metrics, MLflow params, baselines: every step of a registered cycle
    gets the spec `run_cycle` resolved when it started."""
    store = fed(sqlite_store)
    closed = stand_in_engine(monkeypatch, one_step)
    registry = Recorder(champion_dir, store)

    result = cycle.run_cycle(settings, store, cast(Registry, registry), owner="test")

    assert (result.status, result.challenger_version, result.episodes) == ("registered", 2, EPISODES)
    assert spec_reads == [Path(settings.labeler.reward_spec)]
    assert ("start_run", TAB_V1.spec_id) in registry.calls and registry.calls[-1] == ("end_run", "FINISHED")
    assert len(closed) == 1
    assert list(settings.trainer.checkpoint_dir.glob(f"baselines-*.cycle-{result.cycle_id}.json"))


def test_a_failure_in_the_steps_closes_the_engine_and_undoes_the_cycle(
    settings: Settings, sqlite_store: Store, champion_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The steps raise after the episodes are claimed and the run started: the engine is closed,
    the cycle failed (before the run is ended, so its episodes are free first), the run FAILED,
    nothing registered or staged, and the exception propagates."""
    store = fed(sqlite_store)

    def failing(*args: Any, **kwargs: Any) -> Trained:
        raise ValueError("a step failed")

    closed = stand_in_engine(monkeypatch, failing)
    registry = Recorder(champion_dir, store)

    with pytest.raises(ValueError, match="a step failed"):
        cycle.run_cycle(settings, store, cast(Registry, registry), owner="test")

    assert len(closed) == 1
    [record] = store.recent_cycles(1)
    assert (record.status, record.error) == ("failed", "ValueError: a step failed")
    assert store.count_trainable(1, 0) == EPISODES, "the episodes went back to the pool"
    assert registry.calls[-1] == ("end_run", "FAILED") and registry.cycle_status_at_end_run == "failed"
    assert not any(name == "register_checkpoint" for name, _ in registry.calls)
    assert not list(settings.trainer.checkpoint_dir.glob("baselines-*"))


def test_a_failure_after_registration_deletes_the_version(
    settings: Settings, sqlite_store: Store, champion_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last step fails (ending the run): the cycle is failed, then the version it registered
    deleted, then its run marked FAILED; the first failure propagates."""
    store = fed(sqlite_store)
    stand_in_engine(monkeypatch, one_step)
    registry = Recorder(champion_dir, store, fail=("end_run", "FINISHED"))

    with pytest.raises(RuntimeError, match="end_run failed"):
        cycle.run_cycle(settings, store, cast(Registry, registry), owner="test")

    [record] = store.recent_cycles(1)
    assert record.status == "failed" and store.count_trainable(1, 0) == EPISODES
    assert registry.calls[-3:] == [("end_run", "FINISHED"), ("delete_version", 2), ("end_run", "FAILED")]
    assert registry.cycle_status_at_end_run == "failed"


def with_loss(settings: Settings, loss: dict[str, Any]) -> Settings:
    return settings.model_copy(
        update={
            "trainer": settings.trainer.model_copy(
                update={"loss": TypeAdapter(LossSettings).validate_python(loss)}
            )
        }
    )


def recording_steps(seen: list[tuple[list[MicroBatch], Normaliser]]) -> Callable[..., Trained]:
    """`one_step`, keeping the micro-batches and the normaliser it was handed."""

    def steps(*args: Any, **kwargs: Any) -> Trained:
        seen.append((args[1], args[4]))
        return one_step(*args, **kwargs)

    return steps


def test_rft_trains_on_the_accepted_episodes_only(
    settings: Settings, sqlite_store: Store, champion_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Half the episodes got a thumbs up (reward 0.5 > 0): their rows, weight 1 each, are the batch."""
    store = fed(sqlite_store)
    seen: list[tuple[list[MicroBatch], Normaliser]] = []
    stand_in_engine(monkeypatch, recording_steps(seen))

    result = cycle.run_cycle(
        with_loss(settings, {"type": "rft"}), store, cast(Registry, Recorder(champion_dir, store)), owner="t"
    )

    assert result.status == "registered" and result.trainable_rows == EPISODES // 2
    assert result.selection == {"rft_accepted": 2, "rft_left_out": 2}
    [(batches, norm)] = seen
    assert [a for mb in batches for a in mb.advantages.tolist()] == [1.0, 1.0]
    assert (norm.sequences, norm.tokens) == (2, 4)


def test_dpo_pairs_each_up_with_a_down_of_the_same_prompt(
    settings: Settings, sqlite_store: Store, champion_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four episodes of one prompt, two up and two down: two pairs, each in one micro-batch with
    its winner at +1 and its loser at −1; the normaliser counts the pairs."""
    store = fed(sqlite_store)
    seen: list[tuple[list[MicroBatch], Normaliser]] = []
    stand_in_engine(monkeypatch, recording_steps(seen))

    result = cycle.run_cycle(
        with_loss(settings, {"type": "dpo"}), store, cast(Registry, Recorder(champion_dir, store)), owner="t"
    )

    assert result.status == "registered" and result.selection == {"dpo_pairs": 2, "dpo_unpaired": 0}
    [(batches, norm)] = seen
    assert norm.sequences == 2
    sides: dict[int, list[float]] = {}
    for mb in batches:
        for pair, advantage in zip(mb.pairs.tolist(), mb.advantages.tolist(), strict=True):
            sides.setdefault(pair, []).append(advantage)
    assert {pair: sorted(s) for pair, s in sides.items()} == {0: [-1.0, 1.0], 1: [-1.0, 1.0]}


def test_a_dpo_cycle_without_a_pair_is_skipped_not_failed(
    settings: Settings, sqlite_store: Store, champion_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every episode got a thumbs up: no two differ, so nothing trains; the cycle ends ``skipped``
    (as a cycle without signal does), the engine never started, nothing registered."""
    Feeder(sqlite_store).send(
        *[e for n in range(EPISODES) for e in (interaction(f"e{n}"), feedback(f"r-e{n}-0", "thumbs_up"))]
    )
    seen: list[tuple[list[MicroBatch], Normaliser]] = []
    closed = stand_in_engine(monkeypatch, recording_steps(seen))
    registry = Recorder(champion_dir, sqlite_store)

    result = cycle.run_cycle(
        with_loss(settings, {"type": "dpo"}), sqlite_store, cast(Registry, registry), owner="t"
    )

    assert (result.status, result.challenger_version) == ("skipped", None)
    assert result.selection == {"dpo_pairs": 0, "dpo_unpaired": EPISODES}
    assert seen == [] and closed == [] and registry.calls == []
    [record] = sqlite_store.recent_cycles(1)
    assert record.status == "skipped"


class StandInTeacher:
    """trainer/hindsight.py's `Teacher` without a model: the hint makes every completion token
    0.5 nats more likely; records that it was closed."""

    closed: list[bool] = []

    def __init__(self, champion_dir: Path, base_dir: Path | None, micro_batch: int) -> None:
        pass

    def tokenize(self, text: str) -> list[int]:
        return [9]

    def score(self, rows: list[Row]) -> list[list[float]]:
        return [[-0.5 if 9 in r.input_ids else -1.0] * len(r.behaviour_logprobs) for r in rows]

    def close(self) -> None:
        StandInTeacher.closed.append(True)


def test_a_spec_with_a_hindsight_term_distils_the_corrected_episodes_into_their_token_advantages(
    settings: Settings, sqlite_store: Store, champion_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EPISODES episodes, half up and half down; the first down one also got a written correction. Its
    row's tokens carry its advantage + 2 · 0.5; every other row has one advantage; the result and the
    run count one distilled episode, and the teacher was freed before the steps."""
    spec = TAB_V1.model_copy(update={"hindsight": HindsightTerm(weight=2.0)})
    Path(settings.labeler.reward_spec).write_text(spec.model_dump_json())
    store = sqlite_store
    Feeder(store).send(
        *[
            event
            for n in range(EPISODES)
            for event in (
                interaction(f"e{n}"),
                feedback(f"r-e{n}-0", "thumbs_up" if n % 2 else "thumbs_down"),
            )
        ],
        # In the same batch as its thumbs down: a correction after the episode settled is late.
        feedback("r-e0-0", "correction", text="The answer is 12."),
    )
    seen: list[tuple[list[MicroBatch], Normaliser]] = []
    stand_in_engine(monkeypatch, recording_steps(seen))
    monkeypatch.setattr(hindsight, "Teacher", StandInTeacher)
    StandInTeacher.closed = []

    result = cycle.run_cycle(settings, store, cast(Registry, Recorder(champion_dir, store)), owner="t")

    assert result.status == "registered" and StandInTeacher.closed == [True]
    assert result.hindsight["hindsight_episodes"] == 1.0 and result.hindsight["hindsight_tokens"] == 2.0
    assert result.hindsight["hindsight_gap_mean"] == pytest.approx(0.5)
    [(batches, _)] = seen
    shifts = []
    for mb in batches:
        per_row = mb.advantages[:, None].expand_as(mb.mask) * mb.mask
        shifts += ((mb.token_advantages - per_row) * mb.mask).sum(dim=1).tolist()
    assert sorted(shifts) == pytest.approx([0.0] * (EPISODES - 1) + [2.0 * 0.5 * 2])


@pytest.mark.parametrize(
    ("caps", "says"),
    [
        ({}, "line 2: messages: Field required"),
        ({"max_bytes": 64}, r"replay.jsonl: 89 bytes, over trainer.replay.max_bytes \(64\)"),
        ({"max_line_bytes": 40}, r"line 1: 70 bytes, over trainer.replay.max_line_bytes \(40\)"),
    ],
)
def test_a_bad_replay_file_fails_the_cycle_before_it_takes_the_lease(
    settings: Settings,
    sqlite_store: Store,
    champion_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caps: dict[str, int],
    says: str,
) -> None:
    """trainer.replay names a file with a bad line, or one over its size caps: the cycle raises the
    file's error, naming the line or the size and the setting, before it holds the lease or claims
    an episode, so a bad file costs no episode a failure."""
    from schemas.replay import ReplayFileError
    from schemas.settings import ReplaySettings

    store = fed(sqlite_store)
    stand_in_engine(monkeypatch, one_step)
    bad = tmp_path / "replay.jsonl"
    bad.write_text(
        '{"messages": [{"role": "user", "content": "hi"}], "completion": " 7."}\n{"completion": 7}\n'
    )
    replay = ReplaySettings(path=bad, **caps)
    configured = settings.model_copy(
        update={"trainer": settings.trainer.model_copy(update={"replay": replay})}
    )

    with pytest.raises(ReplayFileError, match=says):
        cycle.run_cycle(configured, store, cast(Registry, Recorder(champion_dir, store)), owner="test")

    assert store.recent_cycles(1) == [] and store.count_trainable(1, 0) == EPISODES


def test_a_reference_that_is_not_registered_fails_the_cycle_before_it_takes_the_lease(
    settings: Settings, sqlite_store: Store, champion_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """trainer.reference names a version the registry does not have while trainer.loss.ref_kl_coef > 0:
    the cycle raises an error naming both settings before it holds the lease or claims an episode;
    with the base (v1, the champion here) it trains, the reference being the champion's own passes."""
    from trainer.reference import Reference, ReferenceMissing

    store = fed(sqlite_store)
    handed: list[Reference | None] = []

    def steps(*args: Any, **kwargs: Any) -> Trained:
        handed.append(kwargs["reference"])
        return one_step(*args, **kwargs)

    stand_in_engine(monkeypatch, steps)
    missing = with_loss(settings, {"type": "cispo", "ref_kl_coef": 0.1})
    missing = missing.model_copy(update={"trainer": missing.trainer.model_copy(update={"reference": "5"})})

    with pytest.raises(ReferenceMissing, match=r"trainer.reference=5 names v5.*ref_kl_coef=0.1"):
        cycle.run_cycle(missing, store, cast(Registry, Recorder(champion_dir, store)), owner="test")
    assert store.recent_cycles(1) == [] and store.count_trainable(1, 0) == EPISODES

    base = with_loss(settings, {"type": "cispo", "ref_kl_coef": 0.1})
    result = cycle.run_cycle(base, store, cast(Registry, Recorder(champion_dir, store)), owner="test")
    assert result.status == "registered" and handed == [Reference(1, "champion")]
