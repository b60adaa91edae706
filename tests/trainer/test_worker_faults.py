"""A trainer worker stopped mid-cycle, on real processes: `rtrl beat` and `rtrl worker` children,
Redis, MLflow, the session's vLLM servers (gate and swap).

SIGKILL: the killed cycle's lease stops being renewed; once it has expired, beat's next check
fails the cycle, releases its episodes and enqueues a new cycle (trainer/lease.py). SIGTERM: the
worker abandons the cycle at its next step boundary, fails it (episodes released at once) and
exits. Either way a restarted worker trains, gates and promotes the episodes: exactly one version
registered, no lease left held.
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
from schemas.settings import RetentionSuiteSettings, Settings
from store import Store

pytestmark = pytest.mark.integration

LEASE_TTL_S = 8.0


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_worker_stopped_mid_cycle_is_replaced_and_the_cycle_completes_once(
    services: Settings, tiny_model_dir: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    tag = uuid.uuid4().hex[:8]
    broker = services.celery.broker_url.rsplit("/", 1)[0] + "/7"  # a Redis database of this test's own
    settings = services.model_copy(
        update={
            "store": services.store.model_copy(update={"url": f"sqlite:///{tmp_path / 'rtrl.db'}"}),
            "services": services.services.model_copy(update={"run_dir": tmp_path / "run"}),
            "mlflow": services.mlflow.model_copy(
                update={"model_name": f"faults-{tag}", "experiment": f"faults-{tag}"}
            ),
            "celery": services.celery.model_copy(update={"broker_url": broker, "result_backend": broker}),
            "trainer": services.trainer.model_copy(
                update={
                    "min_samples": 16,
                    "steps": 60,
                    "micro_batch": 8,
                    "max_kl": None,
                    "interval_s": 2.0,
                    "lease_ttl_s": LEASE_TTL_S,
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
        }
    )
    import redis

    redis.Redis.from_url(broker).flushdb()
    store = Store(settings.store.url)
    store.migrate()
    registry = Registry.from_settings(settings)
    assert rollout.bootstrap(settings, registry, tiny_model_dir) == 1
    feed(store, sample_episodes(tiny_model_dir, 32, seed=21, alternate=True))
    logs = tmp_path / "logs"
    logs.mkdir()
    try:
        with rtrl_child(settings, logs / "beat.log", "beat"):
            with rtrl_child(settings, logs / "worker-1.log", "worker", "--hostname", f"w1-{tag}") as first:
                # Beat enqueues a cycle; the worker takes it. Kill the worker while it trains.
                wait_until(lambda: bool(store.recent_cycles(1)), timeout_s=120, what="a cycle started")
                killed = store.recent_cycles(1)[0]
                time.sleep(4)  # into DeepSpeed's steps (60 of them: well over a minute on this machine)
                assert store.get_cycle(killed.id).status == "running", "the cycle ended before the kill"  # type: ignore[union-attr]
                os.killpg(first.pid, sig)
                first.wait(timeout=30)  # SIGTERM: the worker stops by itself, within a step
                killed_at = time.monotonic()
            stopped = store.get_cycle(killed.id)
            assert stopped is not None
            if sig == signal.SIGKILL:
                assert stopped.status == "running"  # nobody ended it: its lease will expire
            else:
                assert stopped.status == "failed" and "abandoned before step" in (stopped.error or ""), (
                    stopped
                )
                assert store.count_trainable(1, 0) == 32  # released at once

            with rtrl_child(settings, logs / "worker-2.log", "worker", "--hostname", f"w2-{tag}"):

                def finished() -> bool:
                    return any(c.status in {"promoted", "rejected"} for c in store.recent_cycles(5))

                wait_until(finished, timeout_s=300, what="a cycle finished after the restart")
                recovered_s = time.monotonic() - killed_at
        cycles = {c.id: c for c in store.recent_cycles(10)}
        dead = cycles[killed.id]
        reason = "stopped renewing" if sig == signal.SIGKILL else "the worker is stopping"
        assert dead.status == "failed" and reason in (dead.error or ""), dead
        (done,) = [c for c in cycles.values() if c.status in {"promoted", "rejected"}]
        assert done.id > dead.id and sorted(done.episode_ids) == sorted(dead.episode_ids)  # released, re-used
        assert registry.versions() == [1, 2] and done.challenger == 2  # exactly one version registered
        assert store.active_cycles() == []  # the lease is released
        print(f"killed cycle {dead.id}; cycle {done.id} {done.status} {recovered_s:.0f} s after the kill")
        assert recovered_s < 240
    finally:
        store.close()
        if registry.versions() and registry.champion() != 1:
            rollout.promote(settings, registry, 1)  # the shared servers back on the base model
