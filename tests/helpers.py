"""Helpers for service-backed tests (not a test module): read Kafka topics, run the real CLI.

Waiting is `schemas.clock.wait_until` everywhere: a test waits for a condition, never for a time.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import streams
from schemas.clock import wait_until
from schemas.settings import (
    AlarmSettings,
    GateSettings,
    KafkaSettings,
    MetricsSettings,
    Settings,
    StoreSettings,
)
from services.launch import child_env, rtrl_command

REPO = Path(__file__).resolve().parents[1]


class TopicReader:
    """Reads a topic from its end offsets at creation (only records produced after that), or from
    its beginning with ``from_beginning=True``."""

    def __init__(self, kafka: KafkaSettings, topic: str, from_beginning: bool = False) -> None:
        from kafka import TopicPartition

        self.consumer = streams.consumer(kafka, "rtrl-tests", group_id=None)
        partitions = wait_until(
            lambda: self.consumer.partitions_for_topic(topic), timeout_s=30, what=f"topic {topic} exists"
        )
        self.partitions = [TopicPartition(topic, p) for p in partitions]
        self.consumer.assign(self.partitions)
        if from_beginning:
            self.consumer.seek_to_beginning(*self.partitions)
        else:
            self.consumer.seek_to_end(*self.partitions)
        for tp in self.partitions:
            self.consumer.position(tp)  # resolve the offset now, before the test produces
        self.records: list[Any] = []

    def poll(self) -> None:
        for batch in self.consumer.poll(timeout_ms=500).values():
            self.records.extend(batch)

    def wait_for(self, predicate: Callable[[Any], bool], count: int = 1, timeout_s: float = 60) -> list[Any]:
        """Records matching `predicate` once there are `count` of them; what there is after `timeout_s`."""

        def enough() -> bool:
            self.poll()
            return sum(1 for r in self.records if predicate(r)) >= count

        try:
            wait_until(enough, timeout_s=timeout_s, interval_s=0.05, what="records")
        except TimeoutError:
            pass
        return [r for r in self.records if predicate(r)]

    def read_to_end(self, timeout_s: float = 60) -> list[Any]:
        """Every record up to the end offsets as they are now."""
        end = self.consumer.end_offsets(self.partitions)

        def at_end() -> bool:
            self.poll()
            return all(self.consumer.position(tp) >= end[tp] for tp in self.partitions)

        wait_until(at_end, timeout_s=timeout_s, interval_s=0.0, what="reading the topic to its end")
        return self.records

    def close(self) -> None:
        self.consumer.close()


def produce(kafka: KafkaSettings, items: list[tuple[str, bytes | None]]) -> None:
    """Produce (topic, value) records, each acknowledged before the next."""
    producer = streams.producer(kafka, "rtrl-tests", max_request_size=2**21)
    try:
        for topic, value in items:
            producer.send(topic, key=b"k", value=value).get(timeout=30)
    finally:
        producer.close()


def send_as(kafka: KafkaSettings, topic: str) -> None:
    """One record to `topic` as the principal `kafka` authenticates with, acknowledged within
    seconds: raises kafka-python's error of a refusal (TopicAuthorizationFailedError), or streams'
    when the broker cannot be reached or authentication fails."""
    producer = streams.producer(kafka, "rtrl-tests", max_block_ms=5_000, bootstrap_timeout_ms=5_000)
    try:
        producer.send(topic, key=b"k", value=b"{}").get(timeout=10)
    finally:
        producer.close(timeout=2)


def run_rtrl(settings: Settings, *args: str, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    """Run ``rtrl ARGS`` in a child process that gets `settings`, as the supervisor hands them."""
    return subprocess.run(
        rtrl_command(*args),
        cwd=REPO,
        env=child_env(settings),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def alive(pid: int) -> bool:
    """Whether process `pid` exists (a zombie counts until its parent reaps it)."""
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_group(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGTERM the process group `proc` leads (started with ``start_new_session``), SIGKILL it
    after `grace_s`, and reap the leader."""
    import os
    import signal

    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def open_in_browser(path: Path, timeout_s: float = 60) -> tuple[str, list[str]]:
    """Load the file `path` in headless Chromium: its DOM once loaded (after its scripts ran), and
    the page's console messages and uncaught exceptions ("Uncaught Error: ...").

    Chromium logs a web page's console messages at INFO whatever their level (it passes the level on
    only for its own chrome:// pages), so console.error cannot be told from console.log here: every
    console message is returned, and a page that should run cleanly must log nothing. A missing
    Chromium fails the test (run `make test-deps`), it does not skip it.
    """
    import re
    import shutil
    import tempfile

    import pytest

    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail(
            "chromium is not installed: run `make test-deps` (`bash infra/system-deps.sh --test` installs it)",
            pytrace=False,
        )
    with tempfile.TemporaryDirectory(prefix="rtrl-chromium-") as profile:
        proc = subprocess.run(
            [
                chromium,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--enable-logging=stderr",
                "--v=0",
                f"--user-data-dir={profile}",
                "--dump-dom",
                path.resolve().as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    assert proc.returncode == 0, f"chromium exited {proc.returncode}: {proc.stderr[-3000:]}"
    # One log record per console message or uncaught exception, e.g.
    #   [9854:9854:1201/103835.300971:INFO:CONSOLE:3] "Uncaught Error: x", source: file:///tmp/a.html (3)
    # ("CONSOLE(3)" in older versions); a record may run over several lines.
    starts = [m.start() for m in re.finditer(r"^\[\d+:\d+:\d+/\d+\.\d+:[A-Z]+:", proc.stderr, re.MULTILINE)]
    records = [proc.stderr[a:b].strip() for a, b in zip(starts, [*starts[1:], len(proc.stderr)], strict=True)]
    console = [
        m.group(1)
        for m in (re.match(r"^\[[^\]]*:CONSOLE[:(]\d+\)?\] (.*)", r, re.DOTALL) for r in records)
        if m
    ]
    return proc.stdout, console


def gate_without_judgement(gate: GateSettings, **update: Any) -> GateSettings:
    """The gate with no margin, no anchor and no alarm: for tests about the loop closing, not about
    the gate's judgement (tests/deployer and bench/bench_learning.py cover that)."""
    alarms = AlarmSettings(
        length_ratio=1000,
        entropy_ratio=0,
        repetition_rate=1,
        truncation_rate=1,
        kl_budget=1e9,
        no_action_rate=1,
    )
    retention = gate.retention.model_copy(update={"margin": 1.0})  # its own margin, not `tolerance`
    return gate.model_copy(
        update={"tolerance": 1.0, "retention": retention, "anchor": "none", "alarms": alarms, **update}
    )


def demo_settings(fleet: Settings, tmp_path: Path, name: str) -> Settings:
    """Settings for one `rtrl demo` run of an e2e test on `fleet`'s servers: topics, a SQLite store,
    a registered model, a gateway port, checkpoints and metrics ports of its own, 16 episodes a
    cycle, and the gate without its judgement (the test is about the loop closing)."""
    from factories import fresh_topics

    from services.testing import free_ports

    suffix = tmp_path.name.replace("_", "-")[-24:]
    return fresh_topics(fleet, prefix=name).model_copy(
        update={
            "store": StoreSettings(url=f"sqlite:///{tmp_path / 'rtrl.db'}"),
            "mlflow": fleet.mlflow.model_copy(
                update={"model_name": f"rtrl-{name}-{suffix}", "experiment": f"rtrl-{name}-{suffix}"}
            ),
            "gateway": fleet.gateway.model_copy(
                update={"port": free_ports(1)[0], "spool_dir": tmp_path / "spool"}
            ),
            "trainer": fleet.trainer.model_copy(
                update={"min_samples": 16, "checkpoint_dir": tmp_path / "ckpt"}
            ),
            "gate": gate_without_judgement(fleet.gate, eval_prompts=16),
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


@contextmanager
def rtrl_child(settings: Settings, log: Path, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """``rtrl ARGS`` in a session of its own, its output in `log`; stopped at the end (SIGTERM,
    then its group killed: `stop_group`)."""
    with log.open("ab") as out:
        proc = subprocess.Popen(
            rtrl_command(*args),
            env=child_env(settings),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        stop_group(proc)


@contextmanager
def own_fleet(
    services: Settings,
    model_dir: Path | Callable[[Path], Path],
    adapter: str = "lora",
    max_loras: int = 1,
    prefix: str = "rtrl-fleet-",
) -> Iterator[Settings]:
    """A serving and a staging vLLM server of the caller's own on `model_dir` (or on the model that
    `model_dir(run_dir)` builds in the fleet's run dir), `trainer.adapter` = `adapter`, with room for
    `max_loras` adapters side by side in LoRA mode (the global one and tenants': docs/lora.md);
    stopped and removed after."""
    import os
    import shutil

    from services import down, up
    from services.testing import free_ports, make_run_dir, start_reaper

    run_dir = make_run_dir(prefix)
    model = model_dir(run_dir) if callable(model_dir) else model_dir
    serving_port, staging_port = free_ports(2)
    settings = services.model_copy(
        update={
            "services": services.services.model_copy(
                update={
                    "run_dir": run_dir,
                    "vllm_port": serving_port,
                    "vllm_staging_port": staging_port,
                    "enabled": ("vllm",),
                }
            ),
            "vllm": services.vllm.model_copy(
                update={
                    "model_dir": model,
                    "servers": (f"http://127.0.0.1:{serving_port}",),
                    "staging_server": f"http://127.0.0.1:{staging_port}",
                    "max_loras": max_loras,
                }
            ),
            "trainer": services.trainer.model_copy(update={"adapter": adapter}),
        }
    )
    reaper = start_reaper(settings, os.getpid())
    try:
        up(settings, ("vllm",))
        yield settings
    finally:
        down(settings, ("vllm",))
        reaper.terminate()
        reaper.wait()
        shutil.rmtree(run_dir, ignore_errors=True)


# Both store backends, for a test that must hold on each: SQLite (unit) and PostgreSQL (integration).
STORE_BACKENDS = [
    pytest.param("sqlite", marks=pytest.mark.unit),
    pytest.param("postgresql", marks=pytest.mark.integration),
]


def migrated_store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A migrated store's URL for a `STORE_BACKENDS` fixture: an SQLite file in tmp_path, or a
    database of its own on the session's PostgreSQL."""
    from store import Store

    if request.param == "sqlite":
        found = f"sqlite:///{tmp_path / 'rtrl.db'}"
    else:
        found = request.getfixturevalue("postgres_database")
    with Store(found) as store:
        store.migrate()
    return found
