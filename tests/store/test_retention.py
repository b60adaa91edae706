"""Retention (store/retention.py, `rtrl store prune`): old settled episodes go with their segments
and feedback, open, recent and cycle-held ones stay; orphaned feedback and dead letters go by age;
a dry run changes nothing; small batches delete the same; a second run deletes nothing; rows Kafka
still holds stay, so the counts `rtrl labeler reconcile` compares do not move. Ended canaries go by
age on both backends (tests/store/test_retention_canaries.py); the command reports them too."""

from __future__ import annotations

import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
from factories import FakeClock, Feeder, at, feedback, interaction

from schemas.clock import utcnow
from schemas.settings import KafkaSettings, ServicesSettings, Settings, StoreSettings
from services.launch import child_env, rtrl_command
from services.testing import free_ports
from store import Store
from store.retention import prune

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DAY = 86400.0
NOW = at(30 * DAY)  # when prune runs
CUTOFF = at(23 * DAY)  # --older-than 7
OLD, RECENT = 0.0, 25 * DAY


def settled(feeder: Feeder, name: str, when: float) -> None:
    """An episode of one segment, settled at once by terminal feedback, all at `when`."""
    feeder.send(interaction(name, created_at=at(when)), now=at(when))
    feeder.send(feedback(f"r-{name}-0", "thumbs_up", created_at=at(when)), now=at(when))


def fill(store: Store, clock: FakeClock) -> None:
    feeder = Feeder(store)
    for name in ("old", "old-2", "old-3", "trained", "held"):
        settled(feeder, name, OLD)
    settled(feeder, "recent", RECENT)
    feeder.send(
        interaction("open", created_at=at(OLD)), now=at(OLD)
    )  # never settles: no feedback, no window pass
    # Late feedback on a settled episode: joined (late), goes with its episode.
    feeder.send(feedback("r-old-0", "thumbs_down", created_at=at(DAY)), now=at(DAY))
    # Feedback for requests the labeler never saw: unjoined (orphaned).
    feeder.send(feedback("r-nowhere", "thumbs_up", created_at=at(OLD)), now=at(OLD))
    feeder.send(feedback("r-nowhere-yet", "thumbs_up", created_at=at(RECENT)), now=at(RECENT))
    feeder.send(b"not json", now=at(OLD))  # dead letters
    feeder.send(b"{still not json", now=at(RECENT))

    clock.now = at(2 * DAY)
    finished = store.acquire_cycle("w1", ttl_s=3600, champion=1)
    assert finished is not None
    store.mark_used(finished, ["trained"])
    store.finish_cycle(finished, "rejected")  # a finished cycle no longer holds its episodes
    active = store.acquire_cycle("w2", ttl_s=3600, champion=1)
    assert active is not None
    store.mark_used(active, ["held"])  # running (its lease long expired by NOW: still held until failed)
    clock.now = NOW


def remaining(store: Store) -> dict[str, set[str]]:
    from sqlalchemy import select

    from store.models import DeadLetter, Episode, Feedback, Interaction

    with store.transaction() as session:
        return {
            "episodes": set(session.scalars(select(Episode.episode_id))),
            "interactions": set(session.scalars(select(Interaction.episode_id))),
            "feedback": set(session.scalars(select(Feedback.event_id))),
            "dead_letters": set(session.scalars(select(DeadLetter.source))),
        }


@pytest.mark.parametrize("batch_size", [1, 2, 5000])
def test_prune_deletes_old_settled_episodes_orphans_and_dead_letters_only(
    store: Store, clock: FakeClock, batch_size: int
) -> None:
    fill(store, clock)
    before = remaining(store)
    dry = prune(store, CUTOFF, None, dry_run=True, batch_size=batch_size)
    assert remaining(store) == before  # a dry run changes nothing

    report = prune(store, CUTOFF, None, batch_size=batch_size)
    expected = {
        "episodes": 4,
        "interactions": 4,
        "feedback": 4 + 1 + 1,
        "dead_letters": 1,
        "canary_traffic": 0,
        "canaries": 0,
    }
    assert report.deleted == dry.deleted == expected
    assert (report.dry_run, dry.dry_run) == (False, True)
    assert remaining(store) == {
        "episodes": {"recent", "open", "held"},
        "interactions": {"recent", "open", "held"},
        "feedback": {"f-r-recent-0-thumbs_up", "f-r-held-0-thumbs_up", "f-r-nowhere-yet-thumbs_up"},
        "dead_letters": {"interactions:0:8"},
    }
    again = prune(store, CUTOFF, None, batch_size=batch_size)
    assert again.deleted == dict.fromkeys(expected, 0)  # idempotent


def test_an_episode_goes_once_its_active_cycle_has_failed(store: Store, clock: FakeClock) -> None:
    fill(store, clock)
    prune(store, CUTOFF, None)
    (cycle,) = store.recent_cycles(1)
    assert cycle.status == "running"
    store.finish_cycle(cycle.id, "failed")  # releases "held": unclaimed, settled, old
    assert prune(store, CUTOFF, None).deleted == {
        "episodes": 1,
        "interactions": 1,
        "feedback": 1,
        "dead_letters": 0,
        "canary_traffic": 0,
        "canaries": 0,
    }
    assert remaining(store)["episodes"] == {"recent", "open"}


def test_rows_kafka_still_holds_stay_so_reconcile_counts_do_not_move(store: Store) -> None:
    feeder = Feeder(store)
    settled(feeder, "a", OLD)  # interactions:0, feedback:0
    settled(feeder, "b", OLD)  # interactions:1, feedback:1
    feeder.send(feedback("r-a-0", "thumbs_down", created_at=at(DAY)), now=at(DAY))  # feedback:2, late on a
    feeder.send(b"not json", now=at(OLD))  # interactions:2, a dead letter

    def reconcile_counts(floor: dict[tuple[str, int], int]) -> dict[str, tuple[int, int]]:
        # What `rtrl labeler reconcile` compares with end - beginning, per partition.
        return {
            t: store.source_counts(t, 0, floor[(t, 0)], feeder.offsets[t])
            for t in ("interactions", "feedback")
        }

    # Kafka's retention has deleted interactions 0-1 and feedback 0-1: b's records are gone, a's
    # late feedback and the dead letter's record are still there.
    floor = {("interactions", 0): 2, ("feedback", 0): 2}
    counted = reconcile_counts(floor)
    report = prune(store, CUTOFF, floor)
    assert report.deleted == {
        "episodes": 1,
        "interactions": 1,
        "feedback": 1,
        "dead_letters": 0,
        "canary_traffic": 0,
        "canaries": 0,
    }
    assert report.held == {"episodes": 1, "interactions": 0, "feedback": 0, "dead_letters": 1}
    assert reconcile_counts(floor) == counted == {"interactions": (0, 1), "feedback": (1, 0)}
    assert remaining(store)["episodes"] == {"a"}

    # A partition Kafka was not asked about keeps its rows.
    assert prune(store, CUTOFF, {("feedback", 0): 3}).deleted["episodes"] == 0

    floor = {("interactions", 0): 3, ("feedback", 0): 3}  # retention moved on
    report = prune(store, CUTOFF, floor)
    assert report.deleted == {
        "episodes": 1,
        "interactions": 1,
        "feedback": 2,
        "dead_letters": 1,
        "canary_traffic": 0,
        "canaries": 0,
    }
    assert report.held == dict.fromkeys(report.held, 0)
    assert remaining(store) == {
        "episodes": set(),
        "interactions": set(),
        "feedback": set(),
        "dead_letters": set(),
    }


# ---- the command ----------------------------------------------------------------------------------


def rtrl(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    """``rtrl ARGS`` as `run_rtrl` (tests/helpers.py) runs it, with stdin that is not a terminal."""
    return subprocess.run(
        rtrl_command(*args),
        cwd=REPO,
        env=child_env(settings),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )


def cli_settings(tmp_path: Path) -> Settings:
    """A SQLite store in tmp_path and a Kafka address where nothing answers (--without-kafka runs)."""
    (closed,) = free_ports(1)
    return Settings(
        store=StoreSettings(url=f"sqlite:///{tmp_path}/rtrl.db"),
        services=ServicesSettings(run_dir=tmp_path / "run"),
        kafka=KafkaSettings(bootstrap_servers=f"127.0.0.1:{closed}"),
    )


def test_the_command_refuses_without_yes_when_stdin_is_not_a_terminal(tmp_path: Path) -> None:
    settings = cli_settings(tmp_path)
    result = rtrl(settings, "store", "prune", "--older-than", "30")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "rtrl: store prune deletes rows for good; pass --yes to confirm (or --dry-run to count them)"
    ]
    assert not (tmp_path / "rtrl.db").exists()  # refused before touching anything

    too_recent = rtrl(settings, "store", "prune", "--older-than", "0.5", "--yes")
    assert (
        too_recent.returncode == 1 and "--older-than 0.5 is too recent: at least 1 days" in too_recent.stderr
    )


def test_the_command_counts_then_deletes(tmp_path: Path) -> None:
    settings = cli_settings(tmp_path)
    store = Store(settings.store.url)
    store.migrate()
    feeder = Feeder(store)
    then = utcnow() - timedelta(days=40)
    feeder.send(interaction("gone", created_at=then), now=then)
    feeder.send(feedback("r-gone-0", "thumbs_up", created_at=then), now=then)
    feeder.send(interaction("open", created_at=then), now=then)
    with Store(settings.store.url, clock=lambda: then) as old:  # a canary that ended 40 days ago,
        ended = old.start_canary("policy", 3, 2, "http://127.0.0.1:8002", 0.1)
        old.end_canary(ended.id, "failed", "lost live", None)
        old.start_canary("policy", 4, 2, "http://127.0.0.1:8002", 0.1)  # and one running since then

    dry = rtrl(settings, "store", "prune", "--older-than", "30", "--dry-run", "--without-kafka")
    assert dry.returncode == 0, dry.stderr
    assert (
        "episodes      1 would be deleted" in dry.stdout and "feedback      1 would be deleted" in dry.stdout
    )
    assert "canaries      1 would be deleted" in dry.stdout
    assert "reports NOT balanced" in dry.stderr
    done = rtrl(settings, "store", "prune", "--older-than", "30", "--yes", "--without-kafka")
    assert done.returncode == 0, done.stderr
    assert "episodes      1 deleted" in done.stdout and "interactions  1 deleted" in done.stdout
    assert "canaries      1 deleted" in done.stdout
    assert [c.challenger_version for c in store.recent_canaries()] == [4]  # the running one stays
    stats = store.stats()
    assert (stats["episodes_settled"], stats["episodes_open"], stats["interactions"], stats["feedback"]) == (
        0,
        1,
        1,
        0,
    )
    store.close()
