"""Two workers and two reconcilers on one PostgreSQL store: the cycle lease, the episodes' claims and
the deploy locks hold between real processes (docs/scaling.md, Several workers and reconcilers).

`test_two_workers_and_two_reconcilers_race_on_one_postgresql` starts four processes at once
(tests/store/race_procs.py), each calling the store, lease and lock functions the worker's chain
and the fleet reconciler call, as fast as they can for a few seconds; then it reads the database
and the intervals the processes recorded. The whole loop on vLLM, Kafka and MLflow, with the real
Celery workers and `rtrl deploy reconcile --forever`, is tests/e2e/test_daemon_races.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from factories import FakeClock, Feeder, feedback, interaction
from sqlalchemy import select, text

from store import Store
from store.models import Cycle, DeployLockHolder, Episode, RecordedDigests

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PROCS = ROOT / "tests" / "store" / "race_procs.py"
WORKERS = ("worker-a", "worker-b")
RECONCILERS = ("reconciler-a", "reconciler-b")
SECONDS = 10.0
EPISODES = 400


def _seed(store: Store, count: int) -> None:
    """`count` settled, rated episodes of v1 (what the labeler leaves for the trainer)."""
    events: list[Any] = []
    for i in range(count):
        events += [interaction(f"e{i}"), feedback(f"r-e{i}-0", "edit_persisted")]
    Feeder(store).send(*events)
    assert store.count_trainable(1, 1000) == count


def _race(url: str, out: Path) -> list[dict[str, Any]]:
    """Start the four processes, let them go at the same moment, and collect their logs."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    roles = [("worker", n) for n in WORKERS] + [("reconciler", n) for n in RECONCILERS]
    procs = [
        subprocess.Popen(
            [sys.executable, str(PROCS), role, name, url, str(out), str(SECONDS)],
            env=env,
            stdout=(out / f"{name}.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        for role, name in roles
    ]
    try:
        deadline = time.monotonic() + 120
        while not all((out / f"{n}.ready").exists() for _, n in roles):
            assert time.monotonic() < deadline, "the race's processes did not start"
            assert all(p.poll() is None for p in procs), _logs(out)
            time.sleep(0.05)
        (out / "go").touch()
        codes = [p.wait(timeout=SECONDS + 120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0] * len(procs), _logs(out)
    return [json.loads((out / f"{n}.json").read_text()) for _, n in roles]


def _logs(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(out.glob("*.log")))


def _overlapping(intervals: list[tuple[int, int, str]]) -> list[tuple[str, str]]:
    """Pairs of (start, end, who) intervals that overlap; [] when each starts after the last ended."""
    found, last_end, last_who = [], -1, ""
    for start, end, who in sorted(intervals):
        if start <= last_end:
            found.append((last_who, who))
        if end > last_end:
            last_end, last_who = end, who
    return found


def test_two_workers_and_two_reconcilers_race_on_one_postgresql(
    postgres_database: str, tmp_path: Path
) -> None:
    store = Store(postgres_database)
    store.migrate()
    _seed(store, EPISODES)
    logs = _race(postgres_database, tmp_path)
    workers = [log for log in logs if log["role"] == "worker"]
    cycles = [c for log in workers for c in log["cycles"]]
    print(
        f"{len(cycles)} cycles ({sum(c['status'] == 'promoted' for c in cycles)} promoted); held:",
        {
            lock: sum(h["lock"] == lock for log in logs for h in log["holds"])
            for lock in ("rollout", "staging", "canary")
        },
        "busy:",
        {log["name"]: log["busy"] for log in logs},
    )

    assert [b for log in logs for b in log["broken"]] == []
    # No two cycles held the lease at once, and every cycle ran once, by the worker that recorded it.
    assert _overlapping([(c["start"], c["end"], f"cycle {c['cycle']}") for c in cycles]) == []
    with store.transaction() as session:
        rows = {c.id: c for c in session.scalars(select(Cycle))}
        claims = dict(session.execute(select(Episode.episode_id, Episode.used_in_cycle)).all())
        holders = session.scalars(select(DeployLockHolder)).all()
        digests = {r.version for r in session.scalars(select(RecordedDigests))}
    assert sorted(rows) == sorted(c["cycle"] for c in cycles)
    assert all(rows[c["cycle"]].owner == c["owner"] for c in cycles)
    assert all(rows[c["cycle"]].status == c["status"] for c in cycles)
    # No episode trained by two cycles: the promoted cycles' batches are disjoint, the store's claim
    # on each is that cycle, and a failed cycle's episodes went back to the pool.
    promoted = [c for c in cycles if c["status"] == "promoted"]
    trained = [e for c in promoted for e in c["episodes"]]
    assert len(trained) == len(set(trained))
    assert {e: c["cycle"] for c in promoted for e in c["episodes"]} == {
        e: cycle for e, cycle in claims.items() if cycle is not None
    }
    assert all(rows[c["cycle"]].episode_ids == c["episodes"] for c in promoted)
    # No two holders of a deploy lock overlapped, whichever processes they were.
    for lock in ("rollout", "staging", "canary"):
        held = [
            (h["start"], h["end"], log["name"]) for log in logs for h in log["holds"] if h["lock"] == lock
        ]
        assert held, f"nobody took the {lock} lock"
        assert _overlapping(held) == [], lock
    swaps = sum(1 for log in logs for h in log["holds"] if h["lock"] == "rollout")
    assert store.rotation()["http://vllm-race:8000"].epoch == 2 * swaps  # each swap announced twice, alone
    assert holders == []  # every holder removed its row before releasing
    assert digests == {c["cycle"] + 1 for c in promoted}
    # The race happened: both workers ran cycles while the other found the lease busy, the
    # reconcilers found locks busy; and the chain, which waits, never lost a lock to a tick.
    assert all(any(c["status"] == "promoted" for c in log["cycles"]) for log in workers)
    assert sum(log["busy"]["lease"] for log in workers) > 0
    assert sum(sum(log["busy"].values()) for log in logs if log["role"] == "reconciler") > 0
    assert [
        log["busy"] for log in workers if any(log["busy"][k] for k in ("rollout", "staging", "canary"))
    ] == []
    store.close()


def test_an_expiry_that_read_a_cycle_before_its_worker_promoted_it_leaves_it_promoted(
    postgres_database: str,
) -> None:
    """A worker that outlived its lease finishes its cycle while another process expires it: the
    expiry read the cycle as active and expired, then waited on its row; once the worker's commit
    lands, the expiry must not turn the promoted cycle into a failed one and give its episodes back
    (they would be trained on again)."""
    clock = FakeClock()
    store = Store(postgres_database, clock=clock)
    store.migrate()
    Feeder(store).send(interaction(), feedback("r-e1-0", "edit_persisted"))
    cycle = store.acquire_cycle("host:1:task", 60, champion=1)
    assert cycle is not None
    store.mark_used(cycle, ["e1"])
    store.finish_cycle(cycle, "registered", challenger=2)
    clock.advance(61)  # its renewals stopped (a stalled worker); it is still finishing the chain
    expired: list[list[int]] = []
    with store.engine.connect() as owner, store.engine.connect() as watcher:
        finishing = owner.begin()  # the worker's finish_cycle: its row locked FOR UPDATE
        owner.execute(text("SELECT id FROM cycles WHERE id = :id FOR UPDATE"), {"id": cycle})
        expiry = threading.Thread(target=lambda: expired.append(store.expire_cycles()))
        expiry.start()
        deadline = time.monotonic() + 30
        while not watcher.execute(text("SELECT count(*) FROM pg_locks WHERE NOT granted")).scalar():
            assert time.monotonic() < deadline, "the expiry never waited on the cycle's row"
            time.sleep(0.02)
            watcher.rollback()
        owner.execute(
            text("UPDATE cycles SET status = 'promoted', active_slot = NULL WHERE id = :id"), {"id": cycle}
        )
        finishing.commit()
        expiry.join(30)
    assert expired == [[]]
    ended = store.get_cycle(cycle)
    assert ended is not None and ended.status == "promoted" and ended.error is None
    with store.transaction() as session:
        episode = session.get(Episode, "e1")
        assert episode is not None and (episode.used_in_cycle, episode.failed_cycles) == (cycle, 0)
    store.close()
