"""Gateway overhead vs calling vLLM directly, measured side by side in one run.

    .venv/bin/python bench/bench_gateway.py [--requests 200] [--max-tokens 8]

Starts its own Kafka and vLLM serving server (free ports, a temporary run dir, the tiny model)
and one `rtrl gateway` with an API key of its own (the production path, key check included), then
sends the same completion requests alternately straight to vLLM and through the gateway (greedy, fixed prompts, one at a time so queueing does not blur the numbers),
and prints p50 / p95 latency of each path, the added milliseconds and the ratio; the last line is
one JSON object: ``{"name", "value": gateway p50 ms, "baseline": direct p50 ms, "ratio", ...}``.
Target (docs/architecture.md, Targets): ≤ 3 ms p50 added and a ratio ≤ 1.10.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time

import httpx

from evals import get_task
from rtrl.launch import gateway_process
from rtrl.services import down, up
from rtrl.services.testing import make_run_dir, services_settings
from rtrl.services.vllm import ensure_model
from serving import VllmClient
from store import Store


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="Requests per path.")
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()

    run_dir = make_run_dir("rtrl-bench-gw-")
    settings = services_settings(run_dir, run_dir / "model", enabled=("kafka", "vllm"))
    settings = settings.model_copy(update={
        "vllm": settings.vllm.model_copy(update={"staging_server": None}),
        "services": settings.services.model_copy(update={"vllm_staging_port": None}),
    })
    ensure_model(settings)
    prompts = get_task("exclaim").heldout_prompts(50)
    try:
        up(settings)
        # What `rtrl run` does first (deployer.rollout.bootstrap): the server serves a known version.
        # A server without one has every call dead-lettered at the gateway, which is not the path to time.
        with VllmClient(settings.vllm.servers[0], model=settings.vllm.served_model_name) as server:
            server.update_weight_version(1)
        # The production path: the gateway checks an API key on every call.
        store = Store(settings.store.url)
        store.migrate()
        _, key = store.create_api_key(role="tenant", tenant="bench", name="bench_gateway", rate_per_s=0)  # unlimited
        store.close()
        with gateway_process(settings, run_dir / "gateway.log") as gateway, httpx.Client(timeout=60) as client:
            direct_url = f"{settings.vllm.servers[0]}/v1/completions"
            gateway_url = f"{gateway}/v1/completions"

            def call(url: str, i: int) -> float:
                body = {"model": settings.vllm.served_model_name, "prompt": prompts[i % len(prompts)],
                        "max_tokens": args.max_tokens, "temperature": 0}
                start = time.perf_counter()
                response = client.post(url, json=body, headers={"authorization": f"Bearer {key}"})
                elapsed = (time.perf_counter() - start) * 1000
                response.raise_for_status()
                return elapsed

            for i in range(20):  # warm both paths (connections, caches, the gateway's version read)
                call(direct_url, i)
                call(gateway_url, i)
            direct: list[float] = []
            through: list[float] = []
            for i in range(args.requests):  # interleaved, so drift in machine load hits both alike
                direct.append(call(direct_url, i))
                through.append(call(gateway_url, i))
    finally:
        down(settings)
        shutil.rmtree(run_dir, ignore_errors=True)

    d50, g50 = statistics.median(direct), statistics.median(through)
    print(f"requests per path: {args.requests}, max_tokens {args.max_tokens}, greedy, sequential")
    print(f"vLLM direct     p50 {d50:7.2f} ms   p95 {_percentile(direct, 0.95):7.2f} ms")
    print(f"through gateway p50 {g50:7.2f} ms   p95 {_percentile(through, 0.95):7.2f} ms")
    print(f"added p50 {g50 - d50:+.2f} ms   ratio p50 {g50 / d50:.3f}x   (target: <= +3 ms and <= 1.10x)")
    print(json.dumps({
        "name": "gateway_latency_p50_ms", "value": round(g50, 3), "baseline": round(d50, 3),
        "ratio": round(g50 / d50, 4), "added_ms_p50": round(g50 - d50, 3),
        "gateway_p95_ms": round(_percentile(through, 0.95), 3), "direct_p95_ms": round(_percentile(direct, 0.95), 3),
        "requests_per_path": args.requests, "max_tokens": args.max_tokens,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
