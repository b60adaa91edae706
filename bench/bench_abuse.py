"""One hostile tenant against one ordinary tenant on the same gateway, measured side by side in one run.

    .venv/bin/python bench/bench_abuse.py [--seconds 30] [--rate 8] [--max-tokens 8] [--patterns ...]

Starts its own Kafka and vLLM serving server (free ports, a temporary run dir, the tiny model), one
`rtrl gateway` and one `rtrl labeler` (the production processes), and two tenants with keys of the
default rate limit. Tenant ``bob`` sends ordinary completions at ``--rate`` a second (open loop: a
request leaves on schedule whether or not the last one came back; client timeout 30 s), first alone
for ``--seconds``, then for as long again beside each of tenant ``mallory``'s abuse patterns in
turn (``--patterns``), and last beside all of them at once (``all``), each pattern on a key of its
own (the worst case: one tenant holding several keys):

* slow readers: streams opened on raw sockets whose responses are never read (up to 256 at once);
* oversized feedback bodies: just under 1 MiB of empty items, four posters at once;
* token budgets: completions asking for the whole context with ``ignore_eos`` / ``min_tokens``,
  and for ``max_tokens`` 100000;
* flooded episodes: one episode buried under bodies of 1,000 ``accepted`` feedback events.

The last line is one JSON object: ``value`` is bob's p99 latency beside the last phase (``all``),
``baseline`` his p99 alone, ``ratio`` value / baseline (target <= 1.5, docs/security.md),
``p50_ms`` / ``baseline_p50_ms`` / ``ratio_p50``, ``failed_requests`` (bob's requests without a 200: target 0), what each of mallory's
patterns was answered (status -> count), and the labeler's lag when the flood stopped and how long it
took to drain (``labeler_lag_after_flood``, ``labeler_drain_s``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from evals import get_task
from feedback.reconcile import reconcile
from schemas.settings import Settings
from services import down, up
from services.launch import child_env, gateway_process, rtrl_command
from services.testing import make_run_dir, services_settings
from services.vllm import ensure_model
from serving import VllmClient
from store import Store

TARGET_RATIO = 1.5
CLIENT_TIMEOUT_S = 30.0
DRAIN_TIMEOUT_S = 600.0
SLOW_STREAMS = 256


# Where the machine's CPU goes during a phase: each process is counted under the first of these its
# command line (or an ancestor's) contains; the bench's own process (bob and mallory) is "clients".
COMPONENTS = (("gateway", "gateway"), ("labeler", "labeler"), ("vllm", "vllm"), ("kafka", "kafka"))
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _processes() -> dict[int, tuple[int, str, float]]:
    """pid -> (parent pid, command line, CPU seconds used so far) of every process readable now."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        found[int(entry.name)] = (int(fields[1]), cmdline, (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)
    return found


def _cpu_seconds() -> dict[str, float]:
    """CPU seconds used so far, per component (of the processes alive now), and the machine's busy time."""
    processes = _processes()

    def component(pid: int) -> str:
        seen = 0
        while pid in processes and seen < 64:
            if pid == os.getpid():
                return "clients"
            cmdline = processes[pid][1].lower()
            for name, needle in COMPONENTS:
                if needle in cmdline:
                    return name
            pid, seen = processes[pid][0], seen + 1
        return "other"

    totals: dict[str, float] = {}
    for pid, (_, _, seconds) in processes.items():
        totals[component(pid)] = totals.get(component(pid), 0.0) + seconds
    with open("/proc/stat") as stat:
        ticks = [int(t) for t in stat.readline().split()[1:]]
    totals["machine"] = (sum(ticks) - ticks[3] - ticks[4]) / CLOCK_TICKS  # all but idle and iowait
    return totals


def _cores_busy(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """Cores each component kept busy on average between two `_cpu_seconds` readings."""
    return {
        name: round(max(0.0, after.get(name, 0.0) - before.get(name, 0.0)) / seconds, 2)
        for name in ("machine", "clients", "gateway", "vllm", "kafka", "labeler", "other")
    }


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="Length of each phase.")
    parser.add_argument("--rate", type=float, default=8.0, help="bob's requests a second.")
    parser.add_argument("--max-tokens", type=int, default=8, help="bob's max_tokens.")
    parser.add_argument("--pause", type=float, default=5.0, help="Seconds between phases.")
    parser.add_argument(
        "--patterns",
        nargs="+",
        choices=PATTERNS,
        default=list(PATTERNS),
        help="mallory's patterns, one phase each ('all': every pattern at once; always run last).",
    )
    return parser.parse_args()


def _settings(run_dir: Path) -> Settings:
    """Kafka and one vLLM serving server (no staging server) under `run_dir`, on free ports."""
    settings = services_settings(run_dir, run_dir / "model", enabled=("kafka", "vllm"))
    return settings.model_copy(
        update={
            "vllm": settings.vllm.model_copy(update={"staging_server": None}),
            "services": settings.services.model_copy(update={"vllm_staging_port": None}),
        }
    )


def _prepare(settings: Settings) -> dict[str, str]:
    """Start the services, announce a served version, make the keys; returns key name -> key."""
    up(settings)
    with VllmClient(settings.vllm.servers[0], model=settings.vllm.served_model_name) as server:
        server.update_weight_version(1)
    keys = {}
    with Store(settings.store.url) as store:
        store.migrate()
        store.set_serving_version(settings.vllm.servers[0], 1, "bench: announced as the deployer does")
        for name, tenant in [("bob", "bob")] + [
            (p, "mallory") for p in ("slow", "bodies", "budget", "flood")
        ]:
            _, keys[name] = store.create_api_key(role="tenant", tenant=tenant, name=f"bench_abuse_{name}")
    return keys


@dataclass
class _Victim:
    """bob: completions on a fixed schedule; latency in ms of each 200, the rest counted as failed."""

    url: str
    key: str
    model: str
    prompts: list[str]
    max_tokens: int
    latencies: list[float] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)

    def call(self, client: httpx.Client, i: int) -> None:
        body = {
            "model": self.model,
            "prompt": self.prompts[i % len(self.prompts)],
            "max_tokens": self.max_tokens,
            "temperature": 0,
        }
        start = time.perf_counter()
        try:
            response = client.post(
                f"{self.url}/v1/completions", json=body, headers={"authorization": f"Bearer {self.key}"}
            )
        except httpx.HTTPError as exc:
            self.failures[type(exc).__name__] += 1
            return
        if response.status_code != 200:
            self.failures[str(response.status_code)] += 1
            return
        self.latencies.append((time.perf_counter() - start) * 1000)

    def run(self, seconds: float, rate: float) -> None:
        """Open loop: request i leaves at start + i / rate."""
        n = int(seconds * rate)
        with httpx.Client(timeout=CLIENT_TIMEOUT_S) as client, ThreadPoolExecutor(64) as pool:
            start = time.monotonic()
            futures: list[Future[None]] = []
            for i in range(n):
                time.sleep(max(0.0, start + i / rate - time.monotonic()))
                futures.append(pool.submit(self.call, client, i))
            for future in futures:
                future.result()


@dataclass
class _Abuser:
    """mallory: each pattern in a thread of its own until `stop` is set; statuses counted per pattern."""

    url: str
    keys: dict[str, str]
    model: str
    max_model_len: int
    stop: threading.Event = field(default_factory=threading.Event)
    answers: dict[str, Counter[str]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _count(self, pattern: str, outcome: str) -> None:
        with self.lock:
            self.answers.setdefault(pattern, Counter())[outcome] += 1

    def _post(self, client: httpx.Client, pattern: str, path: str, content: bytes) -> httpx.Response | None:
        try:
            response = client.post(
                f"{self.url}{path}",
                content=content,
                headers={"authorization": f"Bearer {self.keys[pattern]}", "content-type": "application/json"},
            )
        except httpx.HTTPError as exc:
            self._count(pattern, type(exc).__name__)
            return None
        self._count(pattern, str(response.status_code))
        if response.status_code == 429:  # what a client that is limited sees; it tries again at once
            time.sleep(0.01)
        return response

    def slow_readers(self) -> None:
        """Streams that ask for the whole context and are never read, kept open until the phase ends."""
        parts = urlsplit(self.url)
        body = json.dumps(
            {"model": self.model, "prompt": "hello", "max_tokens": self.max_model_len - 16, "stream": True}
        ).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nhost: {parts.netloc}\r\n"
            f"authorization: Bearer {self.keys['slow']}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode()
        sockets: list[socket.socket] = []
        try:
            while not self.stop.is_set():
                if len(sockets) >= SLOW_STREAMS:
                    self.stop.wait(0.5)
                    continue
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                try:
                    sock.connect((parts.hostname or "127.0.0.1", parts.port or 80))
                    sock.sendall(head + body)
                except OSError as exc:
                    self._count("slow", type(exc).__name__)
                    sock.close()
                    continue
                sockets.append(sock)
                self._count("slow", "opened")
                self.stop.wait(0.02)
        finally:
            for sock in sockets:
                sock.close()

    def oversized_bodies(self) -> None:
        """Bodies of empty items just under the feedback limit (1 MiB by default)."""
        body = b"[" + b",".join([b"{}"] * 349_000) + b"]"
        with httpx.Client(timeout=CLIENT_TIMEOUT_S) as client:
            while not self.stop.is_set():
                self._post(client, "bodies", "/v1/feedback", body)

    def token_budgets(self) -> None:
        """Completions that would hold a slot for the whole context, or ask past it."""
        asks = [
            {
                "max_tokens": self.max_model_len - 16,
                "min_tokens": self.max_model_len - 16,
                "ignore_eos": True,
            },
            {"max_tokens": 100_000, "ignore_eos": True},
            {"max_tokens": self.max_model_len - 16},
        ]
        with httpx.Client(timeout=CLIENT_TIMEOUT_S) as client:
            i = 0
            while not self.stop.is_set():
                body = {"model": self.model, "prompt": "count to a million", **asks[i % len(asks)]}
                self._post(client, "budget", "/v1/completions", json.dumps(body).encode())
                i += 1

    def flooded_episode(self) -> None:
        """One completion, then bodies of 1,000 `accepted` feedback events about it, as fast as allowed."""
        with httpx.Client(timeout=CLIENT_TIMEOUT_S) as client:
            response = None
            while response is None or response.status_code != 200:
                if self.stop.is_set():
                    return
                body = {"model": self.model, "prompt": "hi", "max_tokens": 4}
                response = self._post(client, "flood", "/v1/completions", json.dumps(body).encode())
            request_id = response.headers["x-rtrl-request-id"]
            events = json.dumps([{"request_id": request_id, "kind": "accepted"}] * 1000).encode()
            while not self.stop.is_set():
                self._post(client, "flood", "/v1/feedback", events)

    def start(self, pattern: str) -> list[threading.Thread]:
        """Start one pattern (or all of them) in threads of its own; `stop` ends them."""
        self.stop.clear()
        runs: dict[str, list[Callable[[], None]]] = {
            "slow": [self.slow_readers],
            "bodies": [self.oversized_bodies] * 4,
            "budget": [self.token_budgets] * 2,
            "flood": [self.flooded_episode],
        }
        chosen = [run for name, group in runs.items() if pattern in (name, "all") for run in group]
        threads = [threading.Thread(target=run, daemon=True) for run in chosen]
        for thread in threads:
            thread.start()
        return threads


PATTERNS = ("slow", "bodies", "budget", "flood", "all")


def _drain(settings: Settings) -> tuple[int, float]:
    """The labeler's lag (records not committed) now, and the seconds until it is 0."""
    start = time.monotonic()
    with Store(settings.store.url) as store:
        lag = reconcile(settings, store).pending
        pending = lag
        while pending and time.monotonic() - start < DRAIN_TIMEOUT_S:
            time.sleep(1.0)
            pending = reconcile(settings, store).pending
    return lag, (time.monotonic() - start) if pending == 0 else float("nan")


@dataclass
class _Phase:
    """bob's answers during one phase, what mallory's requests got, and the labeler's lag after it."""

    latencies: list[float]
    failed: int
    answers: dict[str, dict[str, int]]
    cores: dict[str, float]
    lag: int = 0
    drain_s: float = 0.0

    def summary(self) -> dict[str, object]:
        return {
            "p50_ms": round(statistics.median(self.latencies), 3),
            "p99_ms": round(_percentile(self.latencies, 0.99), 3),
            "answered": len(self.latencies),
            "failed": self.failed,
            "abuser_answers": self.answers,
            "cores_busy": self.cores,
            "labeler_lag": self.lag,
            "labeler_drain_s": round(self.drain_s, 1),
        }


def _run_phase(
    victim: _Victim, abuser: _Abuser | None, pattern: str, args: argparse.Namespace, settings: Settings
) -> _Phase:
    """bob for `args.seconds` beside mallory's `pattern` (none when `abuser` is None); then the lag drains."""
    victim.latencies, victim.failures = [], Counter()
    threads = []
    if abuser is not None:
        abuser.answers = {}
        threads = abuser.start(pattern)
    before, started = _cpu_seconds(), time.monotonic()
    victim.run(args.seconds, args.rate)
    cores = _cores_busy(before, _cpu_seconds(), time.monotonic() - started)
    if abuser is not None:
        abuser.stop.set()
        for thread in threads:
            thread.join(timeout=CLIENT_TIMEOUT_S + 5)
    lag, drain_s = _drain(settings)
    answers = {} if abuser is None else {k: dict(v) for k, v in sorted(abuser.answers.items())}
    phase = _Phase(victim.latencies, sum(victim.failures.values()), answers, cores, lag, drain_s)
    print(f"{pattern:6s} {json.dumps(phase.summary())}", flush=True)
    time.sleep(args.pause)  # what mallory left in vLLM's queue finishes before the next phase
    return phase


def _report(phases: dict[str, _Phase]) -> None:
    alone, abused = phases["alone"], list(phases.values())[-1]
    b50, b99 = statistics.median(alone.latencies), _percentile(alone.latencies, 0.99)
    p50, p99 = statistics.median(abused.latencies), _percentile(abused.latencies, 0.99)
    for name, phase in phases.items():
        q50, q99 = statistics.median(phase.latencies), _percentile(phase.latencies, 0.99)
        print(
            f"bob beside {name:6s} p50 {q50:9.2f} ms ({q50 / b50:7.2f}x)  p99 {q99:9.2f} ms ({q99 / b99:7.2f}x)"
            f"  failed {phase.failed}"
        )
    print(
        f"target: ratio <= {TARGET_RATIO} at p50 and p99, failed 0 (the 'all' phase: every pattern at once)"
    )
    flood = phases.get("flood", abused)
    print(
        json.dumps(
            {
                "name": "abuse_victim_latency_p99_ms",
                "value": round(p99, 3),
                "baseline": round(b99, 3),
                "ratio": round(p99 / b99, 4),
                "p50_ms": round(p50, 3),
                "baseline_p50_ms": round(b50, 3),
                "ratio_p50": round(p50 / b50, 4),
                "target_ratio": TARGET_RATIO,
                "failed_requests": sum(p.failed for p in phases.values()),
                "labeler_lag_after_flood": max(flood.lag, abused.lag),
                "labeler_drain_s": round(max(flood.drain_s, abused.drain_s), 1),
                "phases": {name: phase.summary() for name, phase in phases.items()},
            }
        )
    )


def main() -> None:
    args = _parse_args()
    run_dir = make_run_dir("rtrl-bench-abuse-")
    settings = _settings(run_dir)
    ensure_model(settings)
    prompts = get_task("exclaim").heldout_prompts(50)
    labeler = None
    try:
        keys = _prepare(settings)
        with open(run_dir / "labeler.log", "ab") as log:
            labeler = subprocess.Popen(
                rtrl_command("labeler"), env=child_env(settings), stdout=log, stderr=subprocess.STDOUT
            )
        with gateway_process(settings, run_dir / "gateway.log") as url:
            model = settings.vllm.served_model_name
            victim = _Victim(url, keys["bob"], model, prompts, args.max_tokens)
            victim.run(3.0, args.rate)  # warm: connections, caches, the gateway's version read
            abuser = _Abuser(url, keys, model, settings.vllm.max_model_len)
            phases = {"alone": _run_phase(victim, None, "alone", args, settings)}
            for pattern in args.patterns:
                phases[pattern] = _run_phase(victim, abuser, pattern, args, settings)
    finally:
        if labeler is not None:
            labeler.terminate()
            labeler.wait(timeout=60)
        down(settings)
        shutil.rmtree(run_dir, ignore_errors=True)
    _report(phases)


if __name__ == "__main__":
    main()
