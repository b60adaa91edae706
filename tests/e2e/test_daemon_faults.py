"""`rtrl run` heals itself: the real daemon under simulated traffic, with its labeler, its trainer
worker and the serving vLLM server each SIGKILLed.

The daemon (gateway, labeler, worker, beat, reconciler under the supervisor) runs against the
session's services with a store (a PostgreSQL database, as in production), topics, registry model
and Redis database of this test's own;
simulated users send requests and feedback through the gateway the whole time. Killed: the labeler
three times (the supervisor restarts it), the worker while a cycle runs (its lease expires, the
cycle runs again on the restarted worker), and, once a challenger is promoted, the serving vLLM
server's whole process group (the reconciler restarts it and puts it back on ``@champion``).
Afterwards: every record produced is stored or dead-lettered, at least one version was promoted,
every server serves ``@champion``, and the gateway answered every probe throughout.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import traceback
import uuid
from pathlib import Path

import httpx
import psutil
import pytest
from factories import fresh_topics
from helpers import stop_group

from feedback.reconcile import Reconciliation, reconcile
from schemas.clock import wait_until
from schemas.settings import MetricsSettings, RetentionSuiteSettings, Settings
from services.launch import child_env, rtrl_command
from store import Store

pytestmark = pytest.mark.e2e


PACE_S = 1.0


class Traffic:
    """Simulated users in a thread (batches of 8 requests with feedback, PACE_S apart) and a prober of the
    gateway's /healthz every 0.2 s, until `stop`."""

    def __init__(self, settings: Settings, gateway: str, key: str) -> None:
        self.settings, self.gateway, self.key = settings, gateway, key
        self.stop = threading.Event()
        self.ok = self.failed = self.probes = 0
        self.unanswered: list[str] = []  # probes or requests that got no HTTP answer at all
        self.errors: list[str] = []
        self.crashed: str | None = None  # the simulated users' thread ended on this exception
        self.threads = [threading.Thread(target=self._users), threading.Thread(target=self._probe)]

    def __enter__(self) -> Traffic:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=300)

    def _users(self) -> None:
        from simulation.users import simulate

        seed = 0
        try:
            while not self.stop.is_set():
                seed += 1
                report = simulate(
                    self.settings, self.gateway, 8, "exclaim", concurrency=2, seed=seed, api_key=self.key
                )
                self.ok += report.ok
                self.failed += report.failed
                self.errors.extend(report.errors)
                self.unanswered.extend(
                    e for e in report.errors if "APIConnectionError" in e or "APITimeoutError" in e
                )
                # A pause between batches: traffic all along, at a rate that leaves the 2-core
                # machine's CPU to the cycles (unpaced, ~15 requests/s kept a promotion 400 s away).
                self.stop.wait(PACE_S)
        except BaseException:
            self.crashed = traceback.format_exc()
            raise

    def served(self, at_least: int, what: str, timeout_s: float) -> None:
        """Wait until the users have had `at_least` answers; the timeout says what they got instead."""

        def enough() -> bool:
            assert self.crashed is None, f"the simulated users' thread died:\n{self.crashed}"
            return self.ok >= at_least

        try:
            wait_until(enough, timeout_s=timeout_s, what=what)
        except TimeoutError as exc:
            raise TimeoutError(
                f"{exc}: {self.ok} answered (waiting for {at_least}), {self.failed} failed; "
                f"last errors {self.errors[-5:]}"
            ) from None

    def _probe(self) -> None:
        while not self.stop.wait(0.2):
            self.probes += 1
            try:
                httpx.get(f"{self.gateway}/healthz", timeout=5).raise_for_status()
            except httpx.HTTPError as exc:
                self.unanswered.append(f"/healthz: {exc!r}")


def _child(log: Path, name: str) -> int:
    """The pid of the supervisor's running ``rtrl <name>`` child, from its log ("started NAME (pid N)");
    the worker's command line is Celery's own, so the log is where the pid is said."""

    def found() -> int | None:
        pids = re.findall(rf"started {name} \(pid (\d+)\)", log.read_text())
        if not pids:
            return None
        pid = int(pids[-1])
        try:
            return pid if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE else None
        except psutil.NoSuchProcess:
            return None

    return wait_until(found, timeout_s=120, what=f"rtrl run's {name} process")


def _kill_group(pid: int) -> None:
    os.killpg(pid, signal.SIGKILL)


def test_rtrl_run_heals_a_killed_labeler_worker_and_vllm_server(
    services: Settings, postgres_database: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    import redis

    from deployer import rollout
    from registry import Registry
    from services import services as units
    from services import up
    from services.testing import free_ports
    from serving import VllmClient
    from simulation.client import simulation_key

    tag = uuid.uuid4().hex[:8]
    broker = services.celery.broker_url.rsplit("/", 1)[0] + "/5"  # a Redis database of this test's own
    redis.Redis.from_url(broker).flushdb()
    settings = fresh_topics(services, prefix="daemon").model_copy(
        update={
            "store": services.store.model_copy(update={"url": postgres_database}),  # as `rtrl run` deploys it
            "mlflow": services.mlflow.model_copy(
                update={"model_name": f"daemon-{tag}", "experiment": f"daemon-{tag}"}
            ),
            "celery": services.celery.model_copy(update={"broker_url": broker, "result_backend": broker}),
            "gateway": services.gateway.model_copy(
                update={"port": free_ports(1)[0], "spool_dir": tmp_path / "spool"}
            ),
            "labeler": services.labeler.model_copy(update={"settle_window_s": 0.0}),
            "trainer": services.trainer.model_copy(
                update={
                    "min_samples": 16,
                    "cadence_s": 0.0,
                    "interval_s": 2.0,
                    "lease_ttl_s": 8.0,
                    "checkpoint_dir": tmp_path / "checkpoints",
                }
            ),
            "gate": services.gate.model_copy(
                update={
                    "tolerance": 1.0,
                    "eval_prompts": 8,
                    "retention": RetentionSuiteSettings(margin=1.0, anchor_margin=1.0),
                }
            ),  # not what this tests
            "deployer": services.deployer.model_copy(update={"reconcile_interval_s": 3.0}),
            "metrics": MetricsSettings(
                **dict(
                    zip(
                        ("supervisor_port", "labeler_port", "worker_port", "beat_port", "reconciler_port"),
                        free_ports(5),
                        strict=True,
                    )
                )
            ),
        }
    )
    gateway = f"http://{settings.gateway.host}:{settings.gateway.port}"
    serving_unit = next(u for u in units(settings, ("vllm",)) if u.name == "vllm")
    registry = Registry.from_settings(settings)
    log_path = tmp_path / "rtrl-run.log"
    with log_path.open("ab") as out:
        daemon = subprocess.Popen(
            rtrl_command("run"),
            env=child_env(settings),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    store = Store(settings.store.url)
    killed: dict[str, int] = {}
    try:
        wait_until(lambda: _ready(store), timeout_s=300, what="rtrl run prepared the store")
        with simulation_key(store, gateway, timeout_s=120) as key, Traffic(settings, gateway, key) as traffic:
            # The labeler, three times: the supervisor starts it again each time.
            for _ in range(3):
                traffic.served(8 * (len(killed) + 1), "traffic flowing", timeout_s=300)
                labeler = _child(log_path, "labeler")
                _kill_group(labeler)
                killed[f"labeler-{len(killed)}"] = labeler
                wait_until(
                    lambda old=labeler: _child(log_path, "labeler") != old,
                    timeout_s=60,  # type: ignore[misc]
                    what="labeler restarted",
                )

            # The worker, while its cycle runs.
            wait_until(lambda: bool(store.active_cycles()), timeout_s=600, what="a cycle running")
            worker = _child(log_path, "worker")
            _kill_group(worker)
            killed["worker"] = worker
            dead_cycle = store.recent_cycles(1)[0].id

            # Once a challenger is promoted, the serving vLLM server.
            wait_until(
                lambda: registry.champion() >= 2, timeout_s=900, what="a promotion after the worker's death"
            )
            vllm_pid = serving_unit.pid()
            assert vllm_pid is not None
            _kill_group(vllm_pid)
            killed["vllm"] = vllm_pid
            wait_until(
                lambda: serving_unit.pid() not in (None, vllm_pid), timeout_s=300, what="vLLM restarted"
            )
            wait_until(
                lambda: _version(settings.vllm.servers[0], settings) == registry.champion(),
                timeout_s=600,
                what="the restarted server back on @champion",
            )
            traffic.served(traffic.ok + 16, "users served after the restart", timeout_s=300)

        print(
            f"killed {killed}; users: {traffic.ok} ok, {traffic.failed} failed {traffic.errors[:5]}; "
            f"probes {traffic.probes}; cycles",
            [
                (c.id, c.status, c.challenger, len(c.episode_ids), c.started_at.strftime("%H:%M:%S"), c.error)
                for c in store.recent_cycles(20)
            ],
        )
        assert traffic.unanswered == [], traffic.unanswered[:10]  # the gateway answered throughout
        wait_until(lambda: not store.active_cycles(), timeout_s=600, what="the last cycle finished")
        champion = registry.champion()
        for url in (*settings.vllm.servers, settings.vllm.staging_server):
            assert url is not None
            wait_until(
                lambda u=url: _version(u, settings) == champion,
                timeout_s=300,  # type: ignore[misc]
                what=f"{url} on @champion v{champion}",
            )
        cycles = store.recent_cycles(50)
        assert any(c.id == dead_cycle and c.status == "failed" for c in cycles), cycles
        promoted = [c for c in cycles if c.status == "promoted"]
        assert promoted and max(c.challenger or 0 for c in promoted) == champion, cycles
        assert all(row.in_rotation for row in store.rotation().values())
        counts = wait_until(lambda: _balanced(settings, store), timeout_s=300, what="the labeler caught up")
        print("reconciliation:", counts)
        assert counts.produced >= traffic.ok
        check_metrics(settings, champion, killed)
    finally:
        stop_group(daemon, grace_s=90)
        store.close()
        up(services, only=("vllm",))  # whatever happened above, the session's servers run again
        if registry.versions() and registry.champion() != 1:
            rollout.promote(settings, registry, 1)
        rollout.align_fleet(settings, registry)  # staging too
        for url in (*settings.vllm.servers, settings.vllm.staging_server):
            assert url is not None
            with VllmClient(url, model=settings.vllm.served_model_name) as server:
                assert server.weight_version() == 1


def _ready(store: Store) -> bool:
    try:
        store.check_schema()
    except Exception:  # noqa: BLE001 - not migrated yet
        return False
    return True


def _version(url: str, settings: Settings) -> int | None:
    from serving import VllmClient

    try:
        with VllmClient(url, model=settings.vllm.served_model_name, timeout_s=5) as server:
            return server.weight_version()
    except Exception:  # noqa: BLE001 - down or starting
        return None


def _balanced(settings: Settings, store: Store) -> Reconciliation | None:
    counts = reconcile(settings, store)
    return counts if counts.balanced and counts.pending == 0 else None


def scrape(port: int, settings: Settings) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """One process's /metrics (docs/metrics.md) as {(name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://{settings.metrics.host}:{port}/metrics", timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def check_metrics(settings: Settings, champion: int, killed: dict[str, int]) -> None:
    """What the supervisor, the reconciler and beat report about what happened (the labeler's and
    the worker's own series are checked in tests/e2e/test_loop.py)."""
    m = settings.metrics
    for port in (m.supervisor_port, m.labeler_port, m.worker_port, m.beat_port, m.reconciler_port):
        assert httpx.get(f"http://{m.host}:{port}/healthz", timeout=5).status_code == 200, port
    supervisor = scrape(m.supervisor_port, settings)
    assert supervisor[("rtrl_supervisor_child_restarts_total", (("child", "labeler"),))] >= 3
    assert supervisor[("rtrl_supervisor_child_restarts_total", (("child", "worker"),))] >= 1
    assert supervisor[("rtrl_supervisor_child_up", (("child", "reconciler"),))] == 1
    server = settings.vllm.servers[0].rstrip("/")

    def reconciled() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
        seen = scrape(m.reconciler_port, settings)
        return seen if seen.get(("rtrl_deployer_fleet_agreement", ())) == 1 else None

    reconciler = wait_until(reconciled, timeout_s=60, what="the reconciler seeing the fleet agree")
    assert reconciler[("rtrl_deployer_server_restarts_total", (("server", server),))] >= 1  # the killed vLLM
    assert reconciler[("rtrl_deployer_server_weight_version", (("server", server),))] == champion
    assert reconciler[("rtrl_deployer_champion_version", ())] == champion
    assert (
        reconciler[("rtrl_deployer_swaps_total", (("outcome", "verified"),))] >= 1
    )  # the restarted server's swap
    assert httpx.get(f"http://{m.host}:{m.reconciler_port}/readyz", timeout=5).status_code == 200
