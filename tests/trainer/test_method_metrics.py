"""A cycle's seed-method metrics (trainer/cycle.py `_method_metrics`) on a SQLite store: where PARL's λ
schedule stands for the cycle."""

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from factories import T0, Feeder, feedback, interaction

from schemas.rewards import PARL_V1
from store import Store, TrainingEpisode

pytestmark = pytest.mark.unit


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[Store]:
    """A migrated SQLite store (tests/trainer/conftest.py's `store` needs the session's Redis and MLflow)."""
    store = Store(f"sqlite:///{tmp_path}/rtrl.db")
    store.migrate()
    yield store
    store.close()


def test_the_cycles_lambda_counts_only_the_cycles_trained_under_its_spec(sqlite_store: Store) -> None:
    """Ten cycles under tab-v1, then a switch to parl-v1: its first cycle is at λ(0), not at λ(10) = 0."""
    from trainer.cycle import _method_metrics

    store = sqlite_store
    tab = Feeder(store)
    for n in range(10):
        tab.send(interaction(f"t{n}"), feedback(f"r-t{n}-0", "rejected"), now=T0 + timedelta(seconds=n))
        cycle = store.acquire_cycle("w", ttl_s=60, champion=1)
        assert cycle is not None
        store.mark_used(cycle, [f"t{n}"])
        store.finish_cycle(cycle, "rejected", challenger=2)
    batch = [TrainingEpisode(episode_id="p", reward=0.0, policy_version=1, created_at=T0, segments=[])]
    out = _method_metrics(PARL_V1, store, batch)
    assert (out["parl_cycle"], out["parl_lambda_parallel"], out["parl_lambda_finish"]) == (0.0, 0.2, 0.2)
    assert store.trained_cycles(PARL_V1.spec_id) == 0 and store.trained_cycles("tab-v1@2") == 10
