"""Gateway overhead vs calling vLLM directly, measured side by side in one run.

    .venv/bin/python bench/bench_gateway.py [--requests 200] [--max-tokens 8] [--concurrency 8] [--workers 1] [--model-dir DIR]

Starts its own Kafka and vLLM serving server (free ports, a temporary run dir, the tiny model or the
checkpoint in ``--model-dir``, refused when `rtrl model check` rejects it)
and one `rtrl gateway` with an API key of its own (the production path, key check included), then
sends the same completion requests straight to vLLM and through the gateway (greedy, fixed prompts):

* one client, the paths interleaved request by request, so drift in machine load hits all alike:
  vLLM direct with the client's request, vLLM direct with what the gateway forwards (the client's
  request plus sampled-token logprobs and token ids, which the capture needs; vLLM's own extra
  work for them), and the gateway;
* `--concurrency` clients at once, the two paths in alternating rounds;
* streamed requests, one client, interleaved: time to the first token-carrying chunk (TTFT);
* feedback, one client: a `POST /v1/feedback` of one event is answered 202 only once the event is
  on Kafka or fsynced in the spool (docs/security.md, Accepted means durable), interleaved with
  the cost of that acknowledgement alone: one record sent by a producer with the gateway's
  settings (acks=all, its linger) and waited for.

It prints p50 / p95 latency of each path, the added milliseconds and the ratios; the last line is
one JSON object: ``{"name", "value": gateway p50 ms, "baseline": direct p50 ms, "ratio",
"added_ms_p50", "added_ms_p95", "..._c<N>", "ttft_added_ms", "workers", ...}`` (one client, non-streaming,
for value/baseline), and ``added_ms_p50_own`` / ``ratio_own``: the gateway against vLLM direct with
the forwarded request, i.e. what the gateway itself adds beyond vLLM computing the logprobs;
``feedback_p50_ms`` / ``feedback_p95_ms`` / ``kafka_ack_p50_ms`` / ``feedback_added_ms_p50``: the
feedback route against Kafka's acknowledgement of one record with the gateway's producer settings.
Target (docs/architecture.md, Targets): ≤ 3 ms p50 added, a ratio ≤ 1.10, and ≤ 3 ms TTFT added.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

import streams
from evals import get_task
from ingest.publisher import LINGER_MS
from schemas.settings import Settings
from services import down, up
from services.launch import gateway_process
from services.testing import make_run_dir, services_settings
from services.vllm import ensure_model
from serving import VllmClient
from store import Store


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="Requests per path.")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8, help="Clients at once in the concurrent phase.")
    parser.add_argument(
        "--workers", type=int, default=1, help="Gateway processes (gateway.workers, ingest/prefork.py)."
    )
    parser.add_argument(
        "--model-dir", type=Path, default=None, help="Checkpoint to serve (default: the tiny model, built)."
    )
    return parser.parse_args()


def _settings(run_dir: Path, model_dir: Path | None, workers: int) -> Settings:
    """Kafka and one vLLM serving server (no staging server) under `run_dir`, on free ports; a
    gateway of `workers` processes."""
    settings = services_settings(run_dir, model_dir or run_dir / "model", enabled=("kafka", "vllm"))
    return settings.model_copy(
        update={
            "vllm": settings.vllm.model_copy(update={"staging_server": None}),
            "services": settings.services.model_copy(update={"vllm_staging_port": None}),
            "gateway": settings.gateway.model_copy(update={"workers": workers}),
        }
    )


def _prepare(settings: Settings) -> str:
    """Start the services and do what the gateway's production path needs; returns a tenant key."""
    up(settings)
    # What `rtrl run` does first (deployer.rollout.bootstrap): the server serves a known version.
    # A server without one has every call dead-lettered at the gateway, which is not the path to time.
    with VllmClient(settings.vllm.servers[0], model=settings.vllm.served_model_name) as server:
        server.update_weight_version(1)
    # The production path: the gateway checks an API key on every call, and knows the served
    # version from the deployer's announcement in the store (what bootstrap records).
    store = Store(settings.store.url)
    store.migrate()
    _, key = store.create_api_key(
        role="tenant", tenant="bench", name="bench_gateway", rate_per_s=0
    )  # unlimited
    store.set_serving_version(settings.vllm.servers[0], 1, "bench: announced as the deployer does")
    store.close()
    return key


@dataclass(frozen=True)
class _Timer:
    """Times one greedy completion of prompt `i` on a path (vLLM direct or the gateway), in ms."""

    client: httpx.Client
    model: str
    key: str
    prompts: list[str]
    max_tokens: int

    def call(self, url: str, i: int, capture_fields: bool = False) -> float:
        body = {
            "model": self.model,
            "prompt": self.prompts[i % len(self.prompts)],
            "max_tokens": self.max_tokens,
            "temperature": 0,
        }
        if capture_fields:  # what ingest/shaping.py adds to a completion request
            body |= {"logprobs": 0, "return_token_ids": True}
        start = time.perf_counter()
        response = self.client.post(url, json=body, headers={"authorization": f"Bearer {self.key}"})
        elapsed = (time.perf_counter() - start) * 1000
        response.raise_for_status()
        return elapsed

    def first_token(self, url: str, i: int) -> float:
        body = {
            "model": self.model,
            "prompt": self.prompts[i % len(self.prompts)],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": True,
        }
        start = time.perf_counter()
        with self.client.stream(
            "POST", url, json=body, headers={"authorization": f"Bearer {self.key}"}
        ) as response:
            response.raise_for_status()
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                    elapsed = (time.perf_counter() - start) * 1000
                    break
            else:
                raise RuntimeError(f"{url}: the stream ended without a token")
            for _ in lines:
                pass  # read to the end, as a client would
        return elapsed

    def request_id(self, url: str, i: int) -> str:
        """The signed request id the gateway answers a completion with (what feedback names)."""
        body = {"model": self.model, "prompt": self.prompts[i % len(self.prompts)], "max_tokens": 1}
        response = self.client.post(url, json=body, headers={"authorization": f"Bearer {self.key}"})
        response.raise_for_status()
        return response.headers["x-rtrl-request-id"]

    def feedback(self, url: str, request_id: str) -> float:
        """One `accepted` event about `request_id`, answered 202 once durable."""
        body = {"request_id": request_id, "kind": "accepted"}
        start = time.perf_counter()
        response = self.client.post(url, json=body, headers={"authorization": f"Bearer {self.key}"})
        elapsed = (time.perf_counter() - start) * 1000
        if response.status_code != 202:
            raise RuntimeError(f"feedback answered {response.status_code}: {response.text}")
        return elapsed


def _measure_feedback(
    timer: _Timer, gateway: str, settings: Settings, requests: int
) -> dict[str, list[float]]:
    """Feedback through the gateway, interleaved with Kafka's acknowledgement alone: one record sent
    with the gateway's producer settings (acks=all, its linger) and waited for."""
    ids = [timer.request_id(f"{gateway}/v1/completions", i) for i in range(requests)]
    producer = streams.producer(
        settings.kafka, "bench-gateway", enable_idempotence=False, linger_ms=LINGER_MS
    )

    def ack() -> float:
        start = time.perf_counter()
        producer.send(settings.kafka.feedback_topic, key=b"bench", value=b"{}").get(timeout=30)
        return (time.perf_counter() - start) * 1000

    try:
        for request_id in ids[:10]:  # warm: the producer's metadata, the route
            timer.feedback(f"{gateway}/v1/feedback", request_id)
            ack()
        ms: dict[str, list[float]] = {"feedback": [], "kafka_ack": []}
        for request_id in ids:
            ms["feedback"].append(timer.feedback(f"{gateway}/v1/feedback", request_id))
            ms["kafka_ack"].append(ack())
    finally:
        producer.close(timeout=10)
    return ms


def _measure(
    timer: _Timer, direct_url: str, gateway_url: str, requests: int, n: int
) -> dict[str, list[float]]:
    """The latencies of each path: one client interleaved, `n` clients in alternating rounds, streamed TTFT."""
    for i in range(20):  # warm both paths (connections, caches, the gateway's version read)
        timer.call(direct_url, i)
        timer.call(gateway_url, i)
        timer.first_token(direct_url, i)
        timer.first_token(gateway_url, i)
    ms: dict[str, list[float]] = {
        name: []
        for name in (
            "direct",
            "direct_capture",
            "through",
            "direct_c",
            "through_c",
            "ttft_direct",
            "ttft_through",
        )
    }
    for i in range(requests):  # interleaved, so drift in machine load hits all alike
        ms["direct"].append(timer.call(direct_url, i))
        ms["direct_capture"].append(timer.call(direct_url, i, capture_fields=True))
        ms["through"].append(timer.call(gateway_url, i))
    with ThreadPoolExecutor(max_workers=n) as pool:
        for start in range(0, requests, n):  # rounds of n requests, the paths alternating
            ms["direct_c"].extend(pool.map(lambda i: timer.call(direct_url, i), range(start, start + n)))
            ms["through_c"].extend(pool.map(lambda i: timer.call(gateway_url, i), range(start, start + n)))
    for i in range(requests):
        ms["ttft_direct"].append(timer.first_token(direct_url, i))
        ms["ttft_through"].append(timer.first_token(gateway_url, i))
    return ms


def _report(ms: dict[str, list[float]], args: argparse.Namespace) -> None:
    d50, g50 = statistics.median(ms["direct"]), statistics.median(ms["through"])
    x50 = statistics.median(ms["direct_capture"])
    d95, g95 = _percentile(ms["direct"], 0.95), _percentile(ms["through"], 0.95)
    dc50, gc50 = statistics.median(ms["direct_c"]), statistics.median(ms["through_c"])
    dc95, gc95 = _percentile(ms["direct_c"], 0.95), _percentile(ms["through_c"], 0.95)
    t50, tg50 = statistics.median(ms["ttft_direct"]), statistics.median(ms["ttft_through"])
    f50, f95 = statistics.median(ms["feedback"]), _percentile(ms["feedback"], 0.95)
    k50 = statistics.median(ms["kafka_ack"])
    n = args.concurrency
    print(
        f"requests per path: {args.requests}, max_tokens {args.max_tokens}, greedy; gateway workers {args.workers}"
    )
    print(f"1 client   vLLM direct     p50 {d50:7.2f} ms   p95 {d95:7.2f} ms")
    print(f"1 client   vLLM direct, request as forwarded (+logprobs, token ids) p50 {x50:7.2f} ms")
    print(f"1 client   through gateway p50 {g50:7.2f} ms   p95 {g95:7.2f} ms")
    print(
        f"           added p50 {g50 - d50:+.2f} ms  p95 {g95 - d95:+.2f} ms  ratio p50 {g50 / d50:.3f}x"
        "   (target: <= +3 ms and <= 1.10x)"
    )
    print(
        f"           of which vLLM's extra work for the capture fields {x50 - d50:+.2f} ms; "
        f"the gateway's own {g50 - x50:+.2f} ms ({g50 / x50:.3f}x)"
    )
    print(f"{n} clients  vLLM direct     p50 {dc50:7.2f} ms   p95 {dc95:7.2f} ms")
    print(f"{n} clients  through gateway p50 {gc50:7.2f} ms   p95 {gc95:7.2f} ms")
    print(
        f"           added p50 {gc50 - dc50:+.2f} ms  p95 {gc95 - dc95:+.2f} ms  ratio p50 {gc50 / dc50:.3f}x"
    )
    print(
        f"streamed   TTFT direct p50 {t50:7.2f} ms   through gateway {tg50:7.2f} ms   added {tg50 - t50:+.2f} ms"
        "   (target: <= +3 ms)"
    )
    print(
        f"feedback   202 once durable p50 {f50:7.2f} ms   p95 {f95:7.2f} ms; Kafka's acknowledgement alone "
        f"(linger {LINGER_MS} ms) p50 {k50:7.2f} ms   added {f50 - k50:+.2f} ms"
    )
    print(
        json.dumps(
            {
                "name": "gateway_latency_p50_ms",
                "value": round(g50, 3),
                "baseline": round(d50, 3),
                "ratio": round(g50 / d50, 4),
                "added_ms_p50": round(g50 - d50, 3),
                "added_ms_p95": round(g95 - d95, 3),
                "gateway_p95_ms": round(g95, 3),
                "direct_p95_ms": round(d95, 3),
                "direct_capture_fields_p50_ms": round(x50, 3),
                "added_ms_p50_own": round(g50 - x50, 3),
                "ratio_own": round(g50 / x50, 4),
                f"gateway_p50_ms_c{n}": round(gc50, 3),
                f"direct_p50_ms_c{n}": round(dc50, 3),
                f"added_ms_p50_c{n}": round(gc50 - dc50, 3),
                f"added_ms_p95_c{n}": round(gc95 - dc95, 3),
                f"ratio_c{n}": round(gc50 / dc50, 4),
                "ttft_direct_ms": round(t50, 3),
                "ttft_gateway_ms": round(tg50, 3),
                "ttft_added_ms": round(tg50 - t50, 3),
                "feedback_p50_ms": round(f50, 3),
                "feedback_p95_ms": round(f95, 3),
                "kafka_ack_p50_ms": round(k50, 3),
                "feedback_added_ms_p50": round(f50 - k50, 3),
                "requests_per_path": args.requests,
                "max_tokens": args.max_tokens,
                "concurrency": n,
                "workers": args.workers,
            }
        )
    )


def main() -> None:
    args = _parse_args()
    run_dir = make_run_dir("rtrl-bench-gw-")
    settings = _settings(run_dir, args.model_dir, args.workers)
    ensure_model(settings)
    prompts = get_task("exclaim").heldout_prompts(50)
    try:
        key = _prepare(settings)
        with (
            gateway_process(settings, run_dir / "gateway.log") as gateway,
            httpx.Client(timeout=60) as client,
        ):
            timer = _Timer(
                client=client,
                model=settings.vllm.served_model_name,
                key=key,
                prompts=prompts,
                max_tokens=args.max_tokens,
            )
            ms = _measure(
                timer,
                f"{settings.vllm.servers[0]}/v1/completions",
                f"{gateway}/v1/completions",
                args.requests,
                args.concurrency,
            )
            ms |= _measure_feedback(timer, gateway, settings, args.requests)
    finally:
        down(settings)
        shutil.rmtree(run_dir, ignore_errors=True)
    _report(ms, args)


if __name__ == "__main__":
    main()
