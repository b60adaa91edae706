"""A worker stopped (SIGTERM) while its chain waits for a deploy lock, on real processes: `rtrl beat`
and `rtrl worker` children, Redis, MLflow, the session's vLLM servers.

The test holds the "staging" lock (as a reconciler tick or another gate run would) for the whole
cycle, so the chain, once it has registered its challenger, waits for it (``deployer.lock_wait_s``,
300 s). SIGTERM then ends that wait within a poll (`deployer.swap.rollout_lock`, `WaitStopped`)
and the worker exits at once, instead of when the lock comes free: the cycle fails after
registration like a lock that stayed held (its episodes released, the version registered, never
promoted) and no lease stays held.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import pytest
from episodes import feed, sample_episodes
from helpers import rtrl_child

from deployer import rollout
from registry import Registry
from schemas.clock import wait_until
from schemas.settings import Settings
from store import Store

pytestmark = pytest.mark.integration

REGISTERED_TO_WAITING_S = 5.0  # the gate's plan (champion, draw, suites) before it asks for staging


def test_a_worker_waiting_for_a_deploy_lock_stops_at_once_on_sigterm(
    services: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:8]
    broker = services.celery.broker_url.rsplit("/", 1)[0] + "/8"  # a Redis database of this test's own
    settings = services.model_copy(
        update={
            "store": services.store.model_copy(update={"url": f"sqlite:///{tmp_path / 'rtrl.db'}"}),
            "services": services.services.model_copy(update={"run_dir": tmp_path / "run"}),
            "mlflow": services.mlflow.model_copy(
                update={"model_name": f"lockwait-{tag}", "experiment": f"lockwait-{tag}"}
            ),
            "celery": services.celery.model_copy(update={"broker_url": broker, "result_backend": broker}),
            "trainer": services.trainer.model_copy(
                update={
                    "min_samples": 16,
                    "steps": 2,
                    "micro_batch": 8,
                    "max_kl": None,
                    "interval_s": 2.0,
                    "checkpoint_dir": tmp_path / "checkpoints",
                }
            ),
            "labeler": services.labeler.model_copy(update={"settle_window_s": 0.0}),
            "deployer": services.deployer.model_copy(update={"lock_wait_s": 300.0}),
        }
    )
    import redis

    redis.Redis.from_url(broker).flushdb()
    store = Store(settings.store.url)
    store.migrate()
    registry = Registry.from_settings(settings)
    assert rollout.bootstrap(settings, registry, tiny_model_dir) == 1
    feed(store, sample_episodes(tiny_model_dir, 32, seed=23, alternate=True))
    logs = tmp_path / "logs"
    logs.mkdir()
    try:
        with store.exclusive("staging", "a gate run elsewhere (this test)"):
            with (
                rtrl_child(settings, logs / "beat.log", "beat"),
                rtrl_child(settings, logs / "worker.log", "worker", "--hostname", f"w-{tag}") as worker,
            ):

                def registered() -> bool:
                    cycles = store.recent_cycles(1)
                    return bool(cycles) and cycles[0].status == "registered"

                wait_until(registered, timeout_s=300, what="a cycle registered its challenger")
                waiting = store.recent_cycles(1)[0]
                time.sleep(REGISTERED_TO_WAITING_S)  # the chain now waits for "staging"
                assert store.get_cycle(waiting.id).status == "registered"  # type: ignore[union-attr]
                os.killpg(worker.pid, signal.SIGTERM)
                stopped_at = time.monotonic()
                worker.wait(timeout=120)
                stop_s = time.monotonic() - stopped_at
        ended = store.get_cycle(waiting.id)
        assert ended is not None and ended.status == "failed", ended
        assert "WaitStopped" in (ended.error or "") and "stopped waiting for the staging lock" in (
            ended.error or ""
        ), ended.error
        print(f"the worker exited {stop_s:.1f} s after SIGTERM ({ended.error})")
        assert stop_s < 60  # not the 300 s of deployer.lock_wait_s
        assert registry.versions() == [1, 2] and registry.champion() == 1  # registered, never promoted
        assert store.active_cycles() == []  # the lease is released
        assert store.count_trainable(1, 0) == 32  # its episodes are trainable again
    finally:
        store.close()
        if registry.versions() and registry.champion() != 1:
            rollout.promote(settings, registry, 1)  # the shared servers back on the base model
