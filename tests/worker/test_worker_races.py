"""Two trainer workers and two fleet reconcilers on one PostgreSQL store, as real processes: each
cycle runs once and no two swaps of a server overlap (docs/scaling.md, Several workers and
reconcilers).

Two ``rtrl worker`` processes (Celery, solo pool) and two ``rtrl deploy reconcile --forever``
(ticking every half second, so that their ticks meet the chain's gate and promotion) run against a
PostgreSQL database of this test's own, the session's vLLM servers (serving and staging), MLflow
and Redis. 40 episodes sampled from the tiny model are fed through the labeler's store code; a cycle
takes 16. Twice, two cycle tasks are sent at the same moment, so that both workers start one at
once: one wins the lease and trains, gates and promotes; the other finds the lease taken.
Afterwards, from the store: two cycles, each on 16 episodes of its own, every episode trained once,
no cycle failed on a lock a reconciler held; from a trigger on the ``server_rotation`` table (the
announcements every swap makes, in commit order): no swap of the serving server began while another
was open. tests/store/test_races.py races the same store calls thousands of times without vLLM.
"""

from __future__ import annotations

import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from episodes import feed, sample_episodes
from helpers import rtrl_child
from sqlalchemy import text

from deployer import rollout
from registry import Registry
from schemas.clock import wait_until
from schemas.settings import MetricsSettings, RetentionSuiteSettings, Settings
from store import Store
from trainer.selection import count_trainable

pytestmark = pytest.mark.integration

EPISODES, BATCH, ROUNDS = 40, 16, 2  # a tenth of the episodes is the gate's held-out slice

# Every change of a server's announced version, in commit order (docs/runbooks/deployer.md: a swap
# announces None, then the version it verified).
AUDIT = [
    "CREATE TABLE race_announcements (id bigserial PRIMARY KEY, url text, version int, epoch int,"
    " reason text, at timestamptz DEFAULT clock_timestamp())",
    "CREATE FUNCTION race_announce() RETURNS trigger AS $$ BEGIN"
    " IF TG_OP = 'UPDATE' AND OLD.version_epoch IS NOT DISTINCT FROM NEW.version_epoch THEN RETURN NEW; END IF;"
    " INSERT INTO race_announcements (url, version, epoch, reason)"
    " VALUES (NEW.url, NEW.serving_version, NEW.version_epoch, NEW.reason); RETURN NEW; END $$ LANGUAGE plpgsql",
    "CREATE TRIGGER race_announce AFTER INSERT OR UPDATE ON server_rotation"
    " FOR EACH ROW EXECUTE FUNCTION race_announce()",
]


def _settings(services: Settings, url: str, tmp_path: Path) -> Settings:
    tag = uuid.uuid4().hex[:8]
    broker = services.celery.broker_url.rsplit("/", 1)[0] + "/8"  # a Redis database of this test's own
    return services.model_copy(
        update={
            "store": services.store.model_copy(update={"url": url}),
            "services": services.services.model_copy(update={"run_dir": tmp_path / "run"}),
            "mlflow": services.mlflow.model_copy(
                update={"model_name": f"race-{tag}", "experiment": f"race-{tag}"}
            ),
            "celery": services.celery.model_copy(update={"broker_url": broker, "result_backend": broker}),
            "trainer": services.trainer.model_copy(
                update={
                    "min_samples": BATCH,
                    "max_episodes": BATCH,
                    "max_policy_lag": 2,  # the second cycle trains on v1's episodes after v2 served
                    "lease_ttl_s": 8.0,
                    "checkpoint_dir": tmp_path / "checkpoints",
                }
            ),
            "labeler": services.labeler.model_copy(update={"settle_window_s": 0.0}),
            "gate": services.gate.model_copy(
                update={
                    "tolerance": 1.0,
                    "eval_prompts": 8,
                    "retention": RetentionSuiteSettings(margin=1.0, anchor_margin=1.0),
                }
            ),  # not what this tests
            # Ticks every half second: the chain's gate and promotion meet them.
            "deployer": services.deployer.model_copy(
                update={"reconcile_interval_s": 0.5, "lock_wait_s": 120.0}
            ),
            "metrics": MetricsSettings(
                supervisor_port=0, labeler_port=0, worker_port=0, beat_port=0, reconciler_port=0
            ),  # two of each process on one host: no exporter ports to share
        }
    )


def _client(settings: Settings) -> Any:
    """A Celery client of this test's own broker and result backend. Not `worker.app.configure`:
    an earlier test of the session may have used `worker.app.app`, and Celery keeps the broker pool
    and result backend it opened then (a later ``conf.update(broker_url=...)`` does not move them),
    so its tasks and pings would go to the session's broker, where these workers do not listen."""
    from celery import Celery

    client = Celery(
        "rtrl-race-client", broker=settings.celery.broker_url, backend=settings.celery.result_backend
    )
    client.conf.update(
        task_serializer="json", result_serializer="json", accept_content=["json"], result_extended=True
    )
    return client


def _round(app: Any, workers: set[str]) -> list[dict[str, Any]]:
    """Two cycle tasks sent at once; both workers take one at the same moment: one runs the cycle,
    the other finds the lease taken (`busy`). Their results."""
    from worker.app import CYCLE_TASK, QUEUE

    sent = [app.send_task(CYCLE_TASK, queue=QUEUE) for _ in range(2)]
    results = [task.get(timeout=900) for task in sent]
    assert {task.worker for task in sent} == workers, "both workers must have run one of the two tasks"
    assert sorted(r["status"] == "busy" for r in results) == [False, True], results  # met at the lease
    return results


def _announcements(store: Store, url: str) -> list[tuple[int | None, str]]:
    with store.engine.connect() as connection:
        rows = connection.execute(
            text("SELECT version, reason FROM race_announcements WHERE url = :url ORDER BY id"),
            {"url": url.rstrip("/")},
        )
        return [(row.version, row.reason) for row in rows]


def test_two_workers_and_two_reconcilers_run_each_cycle_once_and_never_swap_a_server_twice_at_once(
    services: Settings, postgres_database: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    import redis

    settings = _settings(services, postgres_database, tmp_path)
    redis.Redis.from_url(settings.celery.broker_url).flushdb()
    store = Store(settings.store.url)
    store.migrate()
    with store.engine.begin() as connection:
        for statement in AUDIT:
            connection.execute(text(statement))
    registry = Registry.from_settings(settings)
    assert rollout.bootstrap(settings, registry, tiny_model_dir) == 1
    feed(store, sample_episodes(tiny_model_dir, EPISODES, seed=33, alternate=True))
    assert count_trainable(settings, store, 1) >= ROUNDS * BATCH  # by the worker's own rule
    logs = tmp_path / "logs"
    logs.mkdir()
    workers = {f"race-{name}-{uuid.uuid4().hex[:6]}@localhost" for name in ("a", "b")}
    app = _client(settings)
    results: list[dict[str, Any]] = []
    try:
        with ExitStack() as processes:
            for name in ("a", "b"):
                processes.enter_context(
                    rtrl_child(settings, logs / f"reconciler-{name}.log", "deploy", "reconcile", "--forever")
                )
            for hostname in sorted(workers):
                processes.enter_context(
                    rtrl_child(settings, logs / f"{hostname}.log", "worker", "--hostname", hostname)
                )
            wait_until(
                lambda: {n for reply in app.control.ping(timeout=1.0) for n in reply} >= workers,
                timeout_s=180,
                what="both workers consuming",
            )
            for _ in range(ROUNDS):
                results += _round(app, workers)
        _check(settings, store, registry, results)
    finally:
        store.close()
        if registry.versions() and registry.champion() != 1:
            rollout.promote(settings, registry, 1)  # the shared servers back on the base model


def _check(settings: Settings, store: Store, registry: Registry, results: list[dict[str, Any]]) -> None:
    print("task results:", [(r["status"], r.get("cycle_id"), r.get("gate"), r.get("error")) for r in results])
    ran = [r for r in results if r.get("cycle_id") is not None]
    assert len(ran) == ROUNDS and all(r["status"] in ("promoted", "rejected") for r in ran), results
    cycles = store.recent_cycles(20)
    print("cycles:", [(c.id, c.status, c.owner, c.challenger, len(c.episode_ids), c.error) for c in cycles])
    # Each cycle ran once: one row per task that ran one, none failed (a lock a reconciler held
    # waits, deployer.lock_wait_s), one registered version each.
    assert sorted(c.id for c in cycles) == sorted(r["cycle_id"] for r in ran)
    assert all(c.status in ("promoted", "rejected") and c.error is None for c in cycles), cycles
    assert registry.versions() == [1, 2, 3]
    # No episode trained twice: two batches of their own, every episode in one.
    trained = [e for c in cycles for e in c.episode_ids]
    assert len(trained) == len(set(trained)) == ROUNDS * BATCH
    assert store.active_cycles() == []
    # No two swaps of the serving server overlapped: every window a swap opened (None announced)
    # was closed (a version announced) before the next one opened.
    server = settings.vllm.servers[0]
    announced = _announcements(store, server)
    print("announcements:", announced)
    opened = [i for i, (version, _) in enumerate(announced) if version is None]
    assert opened or not any(c.status == "promoted" for c in cycles), "a promotion announced no swap"
    assert all(i + 1 < len(announced) and announced[i + 1][0] is not None for i in opened), announced
    champion = store.recorded_champion(registry.model_name, registry.champion, "test")
    assert announced[-1][0] == champion
    assert [h for h in store.lock_holders() if h.held] == []
