"""Hot-swap pause window vs a raw vLLM reload, and failed client requests during swaps under load.

Side by side in one run, on one running vLLM server (VLLM_SERVER_DEV_MODE=1) and two HF
checkpoints of the same architecture (A = what the server serves now, B = another):

* raw: ``/pause`` → ``reload_weights`` → ``/resume``, nothing else (the floor);
* rtrl: `deployer.rollout.swap_server` (pause → reload → digests → version → prefix-cache reset →
  resume, then the probe), alternating B and A.

Meanwhile client threads send completions non-stop; every request must succeed (target: 0
failed, pause window <= 2x raw, DESIGN.md). Prints one JSON object.

    .venv/bin/python bench/bench_swap.py --url http://127.0.0.1:18400 --a CKPT_A --b CKPT_B --swaps 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import httpx

from deployer.fleet import VllmServer
from deployer.probe import build_probe, reference_logprobs
from deployer.rollout import Target, swap_server
from schemas.settings import DeployerSettings, Settings


def load(url: str, model: str, stop: threading.Event, counts: dict[str, int]) -> None:
    with httpx.Client(base_url=url, timeout=120.0) as client:
        while not stop.is_set():
            body = {"model": model, "prompt": "Q: What is 2 plus 3?\nA:", "max_tokens": 8, "temperature": 1.0}
            try:
                ok = client.post("/v1/completions", json=body).status_code == 200
            except httpx.HTTPError:
                ok = False
            counts["ok" if ok else "failed"] += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--a", type=Path, required=True, help="checkpoint the server serves now")
    parser.add_argument("--b", type=Path, required=True, help="another checkpoint, same architecture")
    parser.add_argument("--model", default="rtrl-tiny")
    parser.add_argument("--swaps", type=int, default=5)
    parser.add_argument("--clients", type=int, default=2)
    args = parser.parse_args()

    settings = Settings(deployer=DeployerSettings(pause_mode="wait"))
    targets = []
    for version, path in ((2, args.b), (1, args.a)):
        probe = build_probe(path)
        targets.append(Target(version, path, probe, reference_logprobs(path, probe), None))

    counts = {"ok": 0, "failed": 0}
    stop = threading.Event()
    threads = [
        threading.Thread(target=load, args=(args.url, args.model, stop, counts)) for _ in range(args.clients)
    ]
    for thread in threads:
        thread.start()
    raw_ms: list[float] = []
    rtrl_ms: list[float] = []
    probe_diffs: list[float] = []
    try:
        with VllmServer(args.url, model=args.model) as server:
            for i in range(args.swaps * 2):
                want = targets[i % 2]
                start = time.perf_counter()
                server.pause("wait")
                try:
                    server.reload_weights(want.path)
                finally:
                    server.resume()
                raw_ms.append((time.perf_counter() - start) * 1000)
            for i in range(args.swaps * 2):
                step, _ = swap_server(server, targets[i % 2], settings, restore=None)
                if not step.verified:
                    raise SystemExit(f"swap not verified: {step.error}")
                rtrl_ms.append(step.pause_ms)
                probe_diffs.append(step.max_abs_logprob_diff or 0.0)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    raw, rtrl = statistics.median(raw_ms), statistics.median(rtrl_ms)
    print(
        json.dumps(
            {
                "raw_pause_reload_resume_ms_p50": round(raw, 1),
                "rtrl_pause_window_ms_p50": round(rtrl, 1),
                "ratio": round(rtrl / raw, 2),
                "probe_max_abs_logprob_diff": max(probe_diffs),
                "client_requests_ok": counts["ok"],
                "client_requests_failed": counts["failed"],
                "swaps": len(raw_ms) + len(rtrl_ms),
            }
        )
    )


if __name__ == "__main__":
    main()
