"""A poisoned episode in the trainer's batch (docs/security.md, Poisoned episodes): which failures
count against the batch (unit), and a token id beyond the vocabulary failing real cycles until it is
quarantined and the loop trains again (integration: SQLite store, MLflow server, DeepSpeed on CPU)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from episodes import feed, sample_episodes
from sqlalchemy import select, update

from registry import Registry, RegistryUnavailable
from schemas.settings import Settings
from store import DatabaseUnavailable, Store
from store.models import Interaction

FORGED_TOKEN = 2**31 - 1  # the largest token id the wire schema accepts, far beyond any vocabulary


class _RecordingStore:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def finish_cycle(self, cycle_id: int, status: str, **kw: Any) -> list[str]:
        self.calls.append({"cycle_id": cycle_id, "status": status, **kw})
        return []


@pytest.mark.unit
@pytest.mark.parametrize(
    ("failure", "counted"),
    [
        (IndexError("index out of range in self"), True),  # the embedding of a forged token id
        (RuntimeError("CUDA error: device-side assert triggered"), True),
        (ValueError("a checkpoint that does not load"), True),
        (KeyboardInterrupt(), False),
        (RegistryUnavailable("MLflow at http://mlflow:5000 does not answer"), False),
        (DatabaseUnavailable("the store is unreachable or locked"), False),
        (OSError(28, "No space left on device"), False),
        (TimeoutError("timed out"), False),
    ],
)
def test_which_failures_count_against_the_batch(
    failure: BaseException, counted: bool, tmp_path: Path
) -> None:
    from schemas.rewards import get_spec
    from trainer import checkpoint
    from trainer.cycle import _Cycle, _undo_on_failure
    from trainer.errors import Abandoned

    store = _RecordingStore()
    spec = get_spec("tab-v1")
    cycle = _Cycle(7, 1, spec, checkpoint.CycleFiles(tmp_path, spec.spec_id, 7), 0.0, datetime.now(UTC))
    undo = _undo_on_failure(store, None, cycle, 3)  # type: ignore[arg-type]
    for exc in (failure, Abandoned("the worker is stopping; cycle abandoned before step 2")):
        undo(type(exc), exc, None)
    assert [(c["cycle_id"], c["status"], c["max_episode_failures"]) for c in store.calls] == [
        (7, "failed", 3)
    ] * 2
    assert [c["count_failure"] for c in store.calls] == [counted, False]


@pytest.mark.integration
def test_a_forged_token_id_fails_three_cycles_then_the_loop_trains_without_it(
    settings: Settings, store: Store, registry: Registry, champion: int, tiny_model_dir: Path
) -> None:
    """Before the quarantine, every cycle that selected the forged episode failed, forever."""
    from trainer.cycle import run_cycle

    feed(store, sample_episodes(tiny_model_dir, 17, seed=11))
    with store.transaction() as session:  # a row the labeler stored before it checked token ids
        poison = session.scalar(select(Interaction.episode_id).order_by(Interaction.episode_id).limit(1))
        session.execute(
            update(Interaction)
            .where(Interaction.episode_id == poison)
            .values(completion_token_ids=[FORGED_TOKEN, FORGED_TOKEN])
        )
    for attempt in range(3):
        with pytest.raises(Exception):  # noqa: B017, PT011 - whatever the model raises for it
            run_cycle(settings, store, registry, owner=f"test-{attempt}")
        assert len(store.quarantined(100)) == (17 if attempt == 2 else 0)
    assert [c.status for c in store.recent_cycles(10)] == ["failed"] * 3
    # The batch fails as a whole: here all 17 episodes shared each of the three batches.
    quarantined = store.quarantined(100)
    assert {q.failed_cycles for q in quarantined} == {3}
    assert all(q.reason.startswith("cycle 3 failed: ") for q in quarantined)
    assert run_cycle(settings, store, registry, owner="test-4").status == "not_enough_data"

    innocent = [q.episode_id for q in quarantined if q.episode_id != poison]
    assert store.release_quarantined(innocent) == sorted(innocent)  # `rtrl dlq episodes --release`
    result = run_cycle(settings, store, registry, owner="test-5")
    assert (result.status, result.episodes) == ("registered", 16)
    assert [q.episode_id for q in store.quarantined(100)] == [poison]
