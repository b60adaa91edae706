"""The loop closes: two full cycles of `rtrl demo` on the real services and the tiny model.

Runs the real CLI (`python -m rtrl.cli demo --cycles 2`) against the session's services, then
checks the loop's effects where they live: the vLLM server, the SQL store, MLflow and Kafka.
While it runs, every process's metrics endpoint is scraped once a second (docs/metrics.md), and
the key series must move: labelled events, consumer lag, cycle duration, swap window, the version
each server serves.
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections import defaultdict
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from factories import fresh_topics
from helpers import REPO, gate_without_judgement, open_in_browser, run_rtrl
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file

from schemas.settings import MetricsSettings, Settings, StoreSettings
from services.launch import child_env, rtrl_command
from services.testing import free_ports
from store import Store

pytestmark = pytest.mark.e2e

REQUESTS_PER_CYCLE = 48


@pytest.fixture()
def loop_settings(services: Settings, tmp_path: Path) -> Settings:
    """The session's services, with a store (SQLite, as `rtrl demo` embeds it), topics, registry
    model and gateway of this test's own. The same loop on PostgreSQL, as `rtrl run` deploys it,
    is tests/e2e/test_daemon_faults.py."""
    suffix = tmp_path.name.replace("_", "-")[-24:]
    url = f"sqlite:///{tmp_path / 'rtrl.db'}"
    return fresh_topics(services, prefix="e2e").model_copy(
        update={
            "store": StoreSettings(url=url),
            "mlflow": services.mlflow.model_copy(
                update={"model_name": f"rtrl-e2e-{suffix}", "experiment": f"rtrl-e2e-{suffix}"}
            ),
            "gateway": services.gateway.model_copy(
                update={"port": free_ports(1)[0], "spool_dir": tmp_path / "spool"}
            ),
            "trainer": services.trainer.model_copy(
                update={"min_samples": 16, "checkpoint_dir": tmp_path / "checkpoints"}
            ),
            # This test is about the loop closing, not about the gate's judgement (tests/deployer and
            # bench/bench_learning.py cover that): no margin, no alarm. With the real gate the second
            # challenger of these 48-request cycles is sometimes a small regression and is rightly
            # rejected (in CI: users' reward -0.031, lower bound -0.057 against a 0.05 margin).
            "gate": gate_without_judgement(services.gate),
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


Sample = tuple[str, tuple[tuple[str, str], ...]]  # (name, sorted labels)


class Scraper:
    """Scrapes each process's /metrics once a second in a thread; keeps every value seen per series."""

    def __init__(self, targets: dict[str, tuple[str, dict[str, str]]]) -> None:
        self.targets = targets  # process -> (url, headers)
        self.seen: dict[str, list[dict[Sample, float]]] = defaultdict(list)  # process -> one dict per scrape
        self.ready: dict[str, set[int]] = defaultdict(set)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scraper", daemon=True)

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        with httpx.Client(timeout=2.0) as client:
            while not self._stop.wait(1.0):
                for process, (url, headers) in self.targets.items():
                    try:
                        text = client.get(f"{url}/metrics", headers=headers).text
                        self.ready[process].add(client.get(f"{url}/readyz", headers=headers).status_code)
                    except httpx.HTTPError:
                        continue  # not started yet, or gone
                    self.seen[process].append(
                        {
                            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
                            for family in text_string_to_metric_families(text)
                            for sample in family.samples
                        }
                    )

    def values(self, process: str, name: str, **labels: str) -> list[float]:
        """Per scrape in which it appears, the sum of the series `name` whose labels include `labels`."""
        out = []
        for scrape in self.seen[process]:
            matching = [v for (n, ls), v in scrape.items() if n == name and set(labels.items()) <= set(ls)]
            if matching:
                out.append(sum(matching))
        return out

    def series(self, process: str, name: str) -> list[dict[str, str]]:
        return [dict(ls) for scrape in self.seen[process] for (n, ls) in scrape if n == name]


def test_two_cycles_swap_the_served_weights_twice(
    loop_settings: Settings, services: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from deployer.probe import build_probe, reference_logprobs
    from deployer.rollout import promote
    from feedback.reconcile import reconcile
    from registry import Registry
    from serving import VllmClient

    settings = loop_settings
    # The demo would stop services it started itself; here every service is already up, so it
    # starts none of them. It shares the session's run dir for the service pid files.
    settings = settings.model_copy(update={"services": services.services})
    out = tmp_path / "cycles.json"
    store = Store(settings.store.url)
    store.migrate()
    _, admin_key = store.create_api_key(
        role="admin", tenant=None, name="e2e scraper", rate_per_s=0
    )  # the gateway's /metrics
    store.close()
    m, host = settings.metrics, settings.metrics.host
    targets = {
        name: (f"http://{host}:{port}", {})
        for name, port in (
            ("supervisor", m.supervisor_port),
            ("labeler", m.labeler_port),
            ("worker", m.worker_port),
        )
    }
    targets["gateway"] = (
        f"http://{settings.gateway.host}:{settings.gateway.port}",
        {"authorization": f"Bearer {admin_key}"},
    )
    with Scraper(targets) as scraper:
        proc = subprocess.run(
            rtrl_command("demo", "--cycles", "2", "--requests", str(REQUESTS_PER_CYCLE), "--json", str(out)),
            cwd=REPO,
            env=child_env(settings),
            capture_output=True,
            text=True,
            timeout=1500,
        )
    logs = Path(settings.services.run_dir) / "logs"
    assert proc.returncode == 0, f"demo failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}\nlogs in {logs}"
    rows = json.loads(out.read_text())
    for version in (2, 3):  # the gate's decisions, in the test's output
        explain = subprocess.run(
            rtrl_command("gate", "explain", str(version)),
            cwd=REPO,
            env=child_env(settings),
            capture_output=True,
            text=True,
            timeout=120,
        )
        print(explain.stdout, explain.stderr)
    print(rows)
    assert [(r["version_before"], r["version_after"], r["gate"]) for r in rows] == [
        ("v1", "v2", "pass"),
        ("v2", "v3", "pass"),
    ]
    check_metrics_moved(scraper, settings)
    assert out.with_suffix(".png").stat().st_size > 1000

    # The served weight version changed twice (above), and the table says so.
    assert all(r["episodes"] >= 16 and r["swap_ms"] > 0 and r["data_to_deploy_s"] > 0 for r in rows)
    server = VllmClient(settings.vllm.servers[0], model=settings.vllm.served_model_name)
    assert server.weight_version() == 3

    # Interactions served after the first swap carry the new policy version.
    engine = sa.create_engine(settings.store.url)
    with engine.connect() as conn:
        per_version = dict(
            conn.execute(
                sa.text("SELECT policy_version, COUNT(*) FROM interactions GROUP BY policy_version")
            ).all()
        )
        used = dict(
            conn.execute(
                sa.text(
                    "SELECT policy_version, COUNT(*) FROM episodes WHERE used_in_cycle IS NOT NULL "
                    "GROUP BY policy_version"
                )
            ).all()
        )
    engine.dispose()
    assert per_version == {"v1": REQUESTS_PER_CYCLE, "v2": REQUESTS_PER_CYCLE}
    assert used == {
        "v1": rows[0]["episodes"],
        "v2": rows[1]["episodes"],
    }  # each cycle trained on its own policy

    # MLflow holds the versions, with @champion on the latest passed one.
    registry = Registry.from_settings(settings)
    assert registry.versions() == [1, 2, 3]
    assert registry.champion() == 3

    # Produced = stored + dead-lettered.
    store = Store(settings.store.url)
    counts = reconcile(settings, store)
    store.close()
    assert counts.balanced, counts
    assert counts.produced >= 2 * REQUESTS_PER_CYCLE * 2  # interactions + at least one feedback each

    # The deployed weights differ from the base model's, and the server serves exactly them.
    deployed = load_file(str(registry.download_checkpoint(3) / "model.safetensors"))
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    assert deployed.keys() == base.keys()
    assert any(not deployed[k].equal(base[k]) for k in base)
    probe = build_probe(tiny_model_dir)
    served = server.prompt_logprobs(list(probe.token_ids[0]))
    base_reference = reference_logprobs(tiny_model_dir, probe)[0]
    assert max(abs(a - b) for a, b in zip(served, base_reference, strict=True)) > 1e-4

    # What an operator looks at: `rtrl status` (exit 1: the demo's supervisor has stopped, which it
    # lists as a problem) and `rtrl report`, opened in a headless browser.
    status = run_rtrl(settings, "status", "--json", timeout_s=180)
    assert status.returncode == 1, status.stderr[-2000:]
    state = json.loads(status.stdout)
    assert state["registry"] == {"champion": 3, "latest": 3}
    assert state["labeler"]["balanced"] is True
    assert [row["version"] for row in state["fleet"] if row["role"] == "serving"] == [3], state["fleet"]
    assert any("rtrl run is not running" in p for p in state["problems"]), state["problems"]
    report = tmp_path / "report.html"
    made = run_rtrl(settings, "report", "--out", str(report), timeout_s=180)
    assert made.returncode == 0 and report.exists(), made.stderr[-2000:]
    dom, console = open_in_browser(report)
    assert console == [], console  # no script error, nothing logged
    assert dom.count("<svg") >= 5 and "Gate decisions" in dom and "promoted" in dom  # no dead letters: no 6th

    # Leave the shared servers on the base weights for the tests that follow.
    assert promote(settings, registry, 1).ok
    assert server.weight_version() == 1
    server.close()


def check_metrics_moved(scraper: Scraper, settings: Settings) -> None:
    """The key series of every process, as scraped while the demo ran (docs/metrics.md)."""
    # Every process answered /metrics, and was ready at some point.
    for process in ("supervisor", "labeler", "worker", "gateway"):
        assert scraper.seen[process], f"{process}: never scraped"
        assert 200 in scraper.ready[process], f"{process}: never ready ({scraper.ready[process]})"
    # Labeller: events labelled went up to both cycles' interactions; lag measured on every partition.
    labelled = scraper.values("labeler", "rtrl_labeler_events_total", kind="interaction")
    assert labelled[0] < labelled[-1] and labelled[-1] >= 2 * REQUESTS_PER_CYCLE, labelled
    assert (
        scraper.values("labeler", "rtrl_labeler_events_total", kind="feedback")[-1] >= 2 * REQUESTS_PER_CYCLE
    )
    lag = {(s["topic"], s["partition"]) for s in scraper.series("labeler", "rtrl_labeler_consumer_lag")}
    assert lag >= {
        (t, str(p))
        for t in (settings.kafka.interactions_topic, settings.kafka.feedback_topic)
        for p in range(settings.kafka.partitions)
    }, lag
    assert scraper.values("labeler", "rtrl_labeler_consumer_lag")[-1] == 0  # caught up at the end
    assert (
        scraper.values("labeler", "rtrl_labeler_settle_latency_seconds_count")[-1] >= 2 * REQUESTS_PER_CYCLE
    )
    # Worker: a cycle ran (seen running), its phases timed, promoted, a swap window, and the server's
    # version as the worker saw it went 1 → 2 (→ 3: the demo stops the worker as soon as the second
    # cycle's result arrives, which the last scrape a second before may not have seen).
    assert 1.0 in scraper.values("worker", "rtrl_trainer_cycle_running")
    for phase in ("chain", "train", "cycle", "gate", "deploy"):
        assert max(scraper.values("worker", "rtrl_trainer_cycle_duration_seconds_count", phase=phase)) >= 1, (
            phase
        )
    assert max(scraper.values("worker", "rtrl_trainer_cycles_total", status="promoted")) >= 1
    assert max(scraper.values("worker", "rtrl_trainer_last_cycle", stat="episodes")) >= 16
    server = settings.vllm.servers[0].rstrip("/")
    assert max(scraper.values("worker", "rtrl_deployer_swap_window_seconds_count", server=server)) >= 1
    versions = scraper.values("worker", "rtrl_deployer_server_weight_version", server=server)
    assert [v for i, v in enumerate(versions) if i == 0 or v != versions[i - 1]] in ([2], [2, 3]), versions
    assert max(scraper.values("worker", "rtrl_gate_decisions_total", decision="pass")) >= 1
    # Gateway and supervisor.
    assert (
        scraper.values("gateway", "rtrl_gateway_requests_total", status="200")[-1] >= 2 * REQUESTS_PER_CYCLE
    )
    for child in ("gateway", "labeler", "worker"):
        assert 1.0 in scraper.values("supervisor", "rtrl_supervisor_child_up", child=child)
