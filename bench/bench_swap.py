"""Hot-swap pause window vs a raw vLLM reload, and failed client requests during swaps under load.

    .venv/bin/python bench/bench_swap.py [--swaps 10] [--clients 2] [--model-dir DIR]

Starts its own vLLM serving server (free ports, a temporary run dir, the tiny model or the checkpoint
in ``--model-dir``, refused when `rtrl model check` rejects it) and builds a second checkpoint of the
same architecture (its weights with noise, in their dtype), then measures
side by side in one run, alternating the two checkpoints:

* baseline, raw vLLM: ``/pause`` → ``reload_weights`` → ``/resume``, nothing else (the floor);
* rtrl: `deployer.swap.swap_server` (pause → reload → digests → version → prefix-cache reset →
  resume, then the probe).

Meanwhile client threads send completions through an `rtrl gateway` (with an API key of its own,
Kafka up, every event captured as in production) non-stop, streaming and not, alternately; every
request must succeed, and a stream must end with ``[DONE]``. Then, with MLflow and the store up, the operator's command: the wall time of
``rtrl deploy rollback`` in a process of its own (imports, registry, probe, swap), after a
promotion, twice (``rollback_first_s``, ``rollback_s``), next to that swap's own time
(``rollback_swap_s``). The promotion computed the probe references of both versions (the
target and the one it would restore) and left them on disk, so a rollback loads no model. Target (docs/architecture.md,
Targets): pause window ≤ 2× raw, 0 failed requests, a rollback within seconds of its swap. The
last line is one JSON object: ``{"name", "value": rtrl p50 ms, "baseline": raw p50 ms, "ratio", ...}``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file, save_file

from deployer.probe import build_probe, reference_logprobs
from deployer.swap import Target, swap_server
from registry import Registry
from schemas.settings import Settings
from services import down, up
from services.launch import child_env, gateway_process, rtrl_command
from services.testing import make_run_dir, services_settings
from services.vllm import ensure_model
from serving import VllmClient
from store import Store


def noisy_copy(base: Path, out: Path, std: float = 0.02) -> Path:
    """`base` with Gaussian noise on every weight: same shapes and tokenizer, other logprobs."""
    shutil.copytree(base, out)
    generator = torch.Generator().manual_seed(1)
    for path in out.glob("*.safetensors"):
        tensors = load_file(path)
        save_file(
            {
                k: (v + std * torch.randn(v.shape, generator=generator)).to(v.dtype).contiguous()
                for k, v in tensors.items()
            },
            str(path),
            metadata={"format": "pt"},
        )
    return out


def load(
    url: str, key: str, model: str, stop: threading.Event, counts: dict[str, int], failures: list[str]
) -> None:
    """Completions through the gateway until `stop`, streaming every other one."""
    headers = {"authorization": f"Bearer {key}"}
    stream = False
    with httpx.Client(base_url=url, timeout=120.0, headers=headers) as client:
        while not stop.is_set():
            stream = not stream
            body = {
                "model": model,
                "prompt": "Q: What is 2 plus 3?\nA:",
                "max_tokens": 8,
                "temperature": 1.0,
                "stream": stream,
            }
            problem = None
            try:
                with client.stream("POST", "/v1/completions", json=body) as response:
                    lines = list(response.iter_lines())
                    if response.status_code != 200:
                        problem = f"{response.status_code}: {' '.join(lines)[:200]}"
                    elif stream and "data: [DONE]" not in lines:
                        problem = "stream ended without [DONE]"
            except httpx.HTTPError as exc:
                problem = repr(exc)
            counts["failed" if problem else "ok"] += 1
            if problem:
                failures.append(problem)


def timed_rtrl(settings: Settings, *args: str) -> tuple[float, str]:
    """Wall seconds of ``rtrl ARGS`` in a fresh process, and what it printed."""
    start = time.perf_counter()
    proc = subprocess.run(
        rtrl_command(*args), env=child_env(settings), capture_output=True, text=True, timeout=600
    )
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"rtrl {' '.join(args)} failed: {proc.stderr[-2000:]}")
    return elapsed, proc.stdout


@dataclass
class Measured:
    """What a run measured: the client requests through the gateway (counts and the failures' reasons),
    each raw reload's and verified swap's pause window, the probe's differences, and each timed
    rollback's (wall seconds, its swap's seconds)."""

    counts: dict[str, int] = field(default_factory=lambda: {"ok": 0, "failed": 0})
    failures: list[str] = field(default_factory=list)
    raw_ms: list[float] = field(default_factory=list)
    rtrl_ms: list[float] = field(default_factory=list)
    probe_diffs: list[float] = field(default_factory=list)
    rollbacks: list[tuple[float, float]] = field(default_factory=list)


def swaps(
    url: str, model: str, settings: Settings, targets: list[Target], n: int, measured: Measured
) -> None:
    """`n` raw reloads and `n` verified swaps, interleaved so drift in machine load hits both alike."""
    with VllmClient(url, model=model) as server:
        for i in range(n * 2):
            want = targets[i % 2]
            start = time.perf_counter()
            server.pause("wait")
            try:
                server.reload_weights(want.path)
            finally:
                server.resume()
            measured.raw_ms.append((time.perf_counter() - start) * 1000)
            step, _ = swap_server(server, targets[(i + 1) % 2], settings, restore=None)
            if not step.verified:
                raise SystemExit(f"swap not verified: {step.error}")
            measured.rtrl_ms.append(step.pause_ms)
            measured.probe_diffs.append(step.max_abs_logprob_diff or 0.0)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--swaps", type=int, default=10, help="Swaps per method (each alternates A and B).")
    parser.add_argument(
        "--clients", type=int, default=2, help="Client threads sending completions meanwhile."
    )
    parser.add_argument(
        "--model-dir", type=Path, default=None, help="Checkpoint to serve (default: the tiny model, built)."
    )
    return parser.parse_args()


def bench_settings(run_dir: Path, model_dir: Path | None) -> Settings:
    """Kafka and one vLLM server (no staging server) under `run_dir`, serving `model_dir` or the tiny model."""
    settings = services_settings(run_dir, model_dir or run_dir / "model", enabled=("kafka", "vllm"))
    return settings.model_copy(
        update={
            "vllm": settings.vllm.model_copy(update={"staging_server": None}),
            "services": settings.services.model_copy(update={"vllm_staging_port": None}),
        }
    )


def swap_targets(a: Path, b: Path) -> list[Target]:
    """`b` as version 2, then `a` as version 1, each with its probe and the probe's reference logprobs."""
    targets = []
    for version, path in ((2, b), (1, a)):
        probe = build_probe(path)
        targets.append(Target(version, path, probe, reference_logprobs(path, probe), None))
    return targets


def announce_version_1(settings: Settings) -> str:
    """Version 1 announced on the server (as `rtrl run`'s bootstrap does) and in the store (as the
    deployer does); returns a tenant API key without a rate limit for the clients."""
    url, model = settings.vllm.servers[0], settings.vllm.served_model_name
    with VllmClient(url, model=model) as server:
        server.update_weight_version(1)  # what `rtrl run`'s bootstrap does
    store = Store(settings.store.url)
    store.migrate()
    _, key = store.create_api_key(role="tenant", tenant="bench", name="bench_swap", rate_per_s=0)  # unlimited
    store.set_serving_version(url, 1, "bench: announced as the deployer does")
    store.close()
    return key


def swaps_under_load(
    settings: Settings,
    key: str,
    targets: list[Target],
    args: argparse.Namespace,
    log: Path,
    measured: Measured,
) -> None:
    """`swaps` with ``--swaps`` (raw reloads and verified swaps, interleaved) while ``--clients``
    threads send completions with `key` through an `rtrl gateway` (its output in `log`)."""
    url, model = settings.vllm.servers[0], settings.vllm.served_model_name
    stop = threading.Event()
    with gateway_process(settings, log) as gateway:
        threads = [
            threading.Thread(
                target=load, args=(gateway, key, model, stop, measured.counts, measured.failures)
            )
            for _ in range(args.clients)
        ]
        for thread in threads:
            thread.start()
        try:
            swaps(url, model, settings, targets, args.swaps, measured)
        finally:
            stop.set()
            for thread in threads:
                thread.join()


def time_rollbacks(settings: Settings, a: Path, b: Path) -> list[tuple[float, float]]:
    """The operator's rollback, timed as the operator sees it: with MLflow up, `a` bootstrapped and `b`
    registered, twice ``rtrl deploy promote`` of `b` then ``rtrl deploy rollback`` timed: (its wall
    seconds, its swap's seconds)."""
    up(
        settings.model_copy(
            update={"services": settings.services.model_copy(update={"enabled": ("mlflow",)})}
        )
    )
    registry = Registry.from_settings(settings)
    timed_rtrl(settings, "labeler", "migrate")
    timed_rtrl(settings, "deploy", "bootstrap", str(a))
    v2 = registry.register_checkpoint(b)
    rollbacks: list[tuple[float, float]] = []
    for _ in range(2):
        timed_rtrl(settings, "deploy", "promote", str(v2))
        elapsed, printed = timed_rtrl(settings, "deploy", "rollback")
        rollbacks.append((elapsed, float(json.loads(printed)["servers"][0]["total_ms"]) / 1000))
    return rollbacks


def report(measured: Measured) -> None:
    """The two lines of figures, then the JSON line."""
    raw, rtrl = statistics.median(measured.raw_ms), statistics.median(measured.rtrl_ms)
    counts, failures, rollbacks = measured.counts, measured.failures, measured.rollbacks
    print(
        f"raw pause+reload+resume p50 {raw:.1f} ms; rtrl verified swap pause window p50 {rtrl:.1f} ms "
        f"({rtrl / raw:.2f}x); client requests through the gateway ok {counts['ok']}, "
        f"failed {counts['failed']} {failures[:3]}"
    )
    print(
        f"rtrl deploy rollback: first {rollbacks[0][0]:.2f} s, later {rollbacks[1][0]:.2f} s "
        f"(the swap itself {rollbacks[1][1]:.2f} s)"
    )
    print(
        json.dumps(
            {
                "name": "swap_pause_window_ms_p50",
                "value": round(rtrl, 1),
                "baseline": round(raw, 1),
                "ratio": round(rtrl / raw, 3),
                "probe_max_abs_logprob_diff": max(measured.probe_diffs),
                "failed_requests": counts["failed"],
                "client_requests_ok": counts["ok"],
                "swaps": len(measured.raw_ms) + len(measured.rtrl_ms),
                "rollback_first_s": round(rollbacks[0][0], 2),
                "rollback_s": round(rollbacks[1][0], 2),
                "rollback_swap_s": round(rollbacks[1][1], 3),
            }
        )
    )


def main() -> None:
    args = parse_args()
    run_dir = make_run_dir("rtrl-bench-swap-")
    settings = bench_settings(run_dir, args.model_dir)
    a = ensure_model(settings)
    b = noisy_copy(a, run_dir / "model-b")
    targets = swap_targets(a, b)
    measured = Measured()
    try:
        up(settings)
        key = announce_version_1(settings)
        swaps_under_load(settings, key, targets, args, run_dir / "gateway.log", measured)
        measured.rollbacks = time_rollbacks(settings, a, b)
    finally:
        down(settings)
        shutil.rmtree(run_dir, ignore_errors=True)
    report(measured)


if __name__ == "__main__":
    main()
