"""One optimizer step of the training cycle on DeepSpeed vs a plain PyTorch loop, same model, same batch.

    .venv/bin/python bench/bench_trainer.py [--rows 64] [--steps 6] [--rounds 2] [--zero-stage 0] [--model-dir DIR]

Builds the tiny model (the demo's, in a temporary directory; no services needed), or takes the
checkpoint in ``--model-dir`` (refused when `rtrl model check` rejects it), and one batch of
rows as a cycle sees them: prompts of the exclaim task with completions sampled from the model at
T = 1, behaviour logprobs = the model's own, advantages ±1. Then, side by side in one run,
alternating in rounds so that both see the same machine state:

* rtrl: the cycle's own code (`trainer.engine.start_engine` → `token_logprobs` → CISPO loss →
  `engine.backward` → `engine.step`, ZeRO stage from ``--zero-stage``);
* baseline, plain PyTorch: the same model, forward, loss and micro-batches, ``loss.backward()``,
  gradient clipping at 1.0 and ``torch.optim.AdamW`` with the same hyper-parameters.

Reports the median seconds per optimizer step of each, and completion tokens per second.
Target (issue 9): ratio ≤ 1.15.

Then peak memory at a real vocabulary (issue 35): a Qwen2-shaped checkpoint with 151,936
vocabulary rows (`simulation.checkpoints`, the tiny size: the vocabulary is what matters here), two rows
of 1,024 tokens (512 prompt, 512 completion) sampled as Qwen's generation_config.json says
(T 0.7, top-p 0.8, top-k 20), one warm-up and one measured optimizer step, each side in a process
of its own:

* rtrl: `start_engine` → `token_logprobs` (selective, chunked) → CISPO with its KL penalty →
  `engine.backward` → `engine.step`;
* baseline, plain PyTorch: the same checkpoint, ``model(input_ids, labels=...)`` (transformers'
  cross-entropy on the completion tokens), ``loss.backward()``, ``torch.optim.AdamW``.

``peak_mem_ratio`` = rtrl's peak resident memory / the baseline's (target ≤ 1.3); ``peak_step_mb``
is each side's growth over its resident memory just before the first step. The last line is one
JSON object: ``{"name", "value": DeepSpeed s/step, "baseline": plain s/step, "ratio",
"tokens_per_s", "peak_mem_ratio", ...}``.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from evals import get_task
from schemas.settings import CispoLoss, TrainerSettings
from services.testing import make_run_dir, services_settings
from services.vllm import ensure_model
from serving.sampler import MicroBatch, Row, Sampling, micro_batches, token_logprobs
from trainer.engine import close_engine, start_engine
from trainer.losses import Normaliser, TokenBatch, cispo


def sample_rows(model_dir: Path, n: int, max_tokens: int = 16) -> list[Row]:
    """n rows: task prompts, completions sampled from the model at T = 1, its own logprobs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    rows = []
    for i, prompt in enumerate(get_task("exclaim").train_prompts(n, seed=0)):
        ids = tokenizer(prompt)["input_ids"]
        tokens: list[int] = []
        logprobs: list[float] = []
        with torch.no_grad():
            for _ in range(max_tokens):
                logp = torch.log_softmax(model(input_ids=torch.tensor([ids + tokens])).logits[0, -1], dim=-1)
                token = int(torch.multinomial(logp.exp(), 1, generator=generator))
                tokens.append(token)
                logprobs.append(float(logp[token]))
                if token == tokenizer.eos_token_id:
                    break
        rows.append(
            Row(
                input_ids=ids + tokens,
                prompt_len=len(ids),
                behaviour_logprobs=logprobs,
                advantage=1.0 if i % 2 == 0 else -1.0,
            )
        )
    return rows


def one_step(
    model: torch.nn.Module,
    batches: list[MicroBatch],
    norm: Normaliser,
    cfg: CispoLoss,
    backward: Callable[[torch.Tensor], None],
    step: Callable[[bool], None],
) -> None:
    """The cycle's inner loop for one optimizer step (π_old = π_θ detached: the first step's case)."""
    for k, mb in enumerate(batches):
        logprobs, possible, _ = token_logprobs(model, mb)
        out = cispo(
            TokenBatch(logprobs, logprobs.detach(), mb.behaviour_logprobs, mb.advantages, mb.mask * possible),
            cfg,
            norm,
        )
        backward(out.loss)
        step(k == len(batches) - 1)


def timed(run: Callable[[], None], steps: int) -> list[float]:
    """Seconds of each of `steps` runs of `run`, after one untimed warm-up run."""
    run()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times


def time_deepspeed(
    model_dir: Path, cfg: TrainerSettings, batches: list[MicroBatch], norm: Normaliser, steps: int
) -> list[float]:
    engine = start_engine(model_dir, cfg, accumulation=len(batches))
    try:

        def backward(loss: torch.Tensor) -> None:
            engine.backward(loss, scale_wrt_gas=False)

        def step(_last: bool) -> None:
            engine.step()  # DeepSpeed steps the optimizer at the accumulation boundary itself

        return timed(lambda: one_step(engine, batches, norm, cfg.loss, backward, step), steps)
    finally:
        close_engine(engine)


def time_plain(
    model_dir: Path, cfg: TrainerSettings, batches: list[MicroBatch], norm: Normaliser, steps: int
) -> list[float]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0
    )

    def backward(loss: torch.Tensor) -> None:
        loss.backward()

    def step(last: bool) -> None:
        if last:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return timed(lambda: one_step(model, batches, norm, cfg.loss, backward, step), steps)


MEM_VOCAB = 151_936
MEM_SEQ = 1024


def memory_child(kind: str, model_dir: Path) -> dict[str, float]:
    """One side of the memory comparison, in this (fresh) process: set up, two steps, peak RSS."""
    import psutil

    from schemas.settings import TrainerSettings

    g = torch.Generator().manual_seed(0)
    half = MEM_SEQ // 2
    sampling = Sampling(temperature=0.7, top_p=0.8, top_k=20)
    rows = [
        Row(
            input_ids=torch.randint(10, 500, (MEM_SEQ,), generator=g).tolist(),
            prompt_len=half,
            behaviour_logprobs=(-torch.rand(half, generator=g)).tolist(),
            advantage=a,
            sampling=sampling,
        )
        for a in (1.0, -1.0)
    ]
    cfg = TrainerSettings(micro_batch=2, loss=CispoLoss())
    batches = micro_batches(rows, 2, pad_id=0)
    norm = Normaliser(tokens=sum(b.tokens for b in batches), sequences=len(rows))
    if kind == "rtrl":
        model = start_engine(model_dir, cfg, accumulation=1)

        def step() -> None:
            one_step(
                model,
                batches,
                norm,
                cfg.loss,
                lambda loss: model.backward(loss, scale_wrt_gas=False),
                lambda _last: model.step(),
            )
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        mb = batches[0]
        labels = torch.where(
            torch.arange(MEM_SEQ)[None, :] >= half, mb.input_ids, torch.full_like(mb.input_ids, -100)
        )

        def step() -> None:
            loss = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    before = psutil.Process().memory_info().rss
    started = time.perf_counter()
    for _ in range(2):
        step()
    seconds = (time.perf_counter() - started) / 2
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {"peak_mb": peak / 2**20, "step_mb": (peak - before) / 2**20, "step_s": seconds}


def memory_compare(run_dir: Path) -> dict[str, float]:
    from simulation.checkpoints import build

    model_dir = build(run_dir / "vocab-model", "qwen2", "tiny", vocab_size=MEM_VOCAB)
    out = {}
    for kind in ("rtrl", "plain"):
        done = subprocess.run(
            [sys.executable, __file__, "--memory-child", kind, "--model-dir", str(model_dir)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"memory run {kind} failed:\n{done.stderr[-3000:]}")
        out[kind] = json.loads(done.stdout.strip().splitlines()[-1])
        print(
            f"memory, {kind}: peak {out[kind]['peak_mb']:.0f} MB, step +{out[kind]['step_mb']:.0f} MB, "
            f"{out[kind]['step_s']:.2f} s/step",
            flush=True,
        )
    rtrl, plain = out["rtrl"], out["plain"]
    return {
        "peak_mem_ratio": round(rtrl["peak_mb"] / plain["peak_mb"], 4),
        "peak_mem_mb": round(rtrl["peak_mb"], 1),
        "peak_mem_mb_plain": round(plain["peak_mb"], 1),
        "peak_step_mb": round(rtrl["step_mb"], 1),
        "peak_step_mb_plain": round(plain["step_mb"], 1),
        "mem_step_s": round(rtrl["step_s"], 3),
        "mem_step_s_plain": round(plain["step_s"], 3),
        "mem_vocab": MEM_VOCAB,
        "mem_seq_len": MEM_SEQ,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64, help="rows (trainable segments) per optimizer step")
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps per round and method")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each timing DeepSpeed then plain")
    parser.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3])
    parser.add_argument("--memory-child", choices=["rtrl", "plain"], help=argparse.SUPPRESS)
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="checkpoint to time the steps on (default: the tiny model, built)",
    )
    args = parser.parse_args()
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child, args.model_dir)))
        return

    run_dir = make_run_dir("rtrl-bench-trainer-")
    try:
        settings = services_settings(run_dir, args.model_dir or run_dir / "model", enabled=())
        model_dir = ensure_model(settings)
        cfg = settings.trainer.model_copy(update={"zero_stage": args.zero_stage, "loss": CispoLoss()})
        rows = sample_rows(model_dir, args.rows)
        batches = micro_batches(rows, cfg.micro_batch, pad_id=0)
        norm = Normaliser(tokens=sum(b.tokens for b in batches), sequences=len(rows))
        print(
            f"{len(rows)} rows, {norm.tokens} completion tokens, {len(batches)} micro-batches of <= {cfg.micro_batch}, "
            f"ZeRO {args.zero_stage}, CPU threads {torch.get_num_threads()}",
            flush=True,
        )
        deepspeed: list[float] = []
        plain: list[float] = []
        for round_ in range(args.rounds):
            deepspeed += time_deepspeed(model_dir, cfg, batches, norm, args.steps)
            plain += time_plain(model_dir, cfg, batches, norm, args.steps)
            print(
                f"round {round_ + 1}: DeepSpeed {statistics.median(deepspeed):.4f} s/step, "
                f"plain {statistics.median(plain):.4f} s/step",
                flush=True,
            )
        value, baseline = statistics.median(deepspeed), statistics.median(plain)
        print(
            f"DeepSpeed {value:.4f} s/step vs plain PyTorch {baseline:.4f} s/step: ratio {value / baseline:.3f} "
            f"(target <= 1.15); {norm.tokens / value:.0f} tokens/s",
            flush=True,
        )
        memory = memory_compare(run_dir)
        print(
            f"peak memory at vocabulary {MEM_VOCAB:,}, {MEM_SEQ} tokens: rtrl {memory['peak_mem_mb']:.0f} MB vs "
            f"plain {memory['peak_mem_mb_plain']:.0f} MB: ratio {memory['peak_mem_ratio']:.3f} (target <= 1.3)",
            flush=True,
        )
        print(
            json.dumps(
                {
                    "name": "trainer_step_s",
                    "value": round(value, 5),
                    "baseline": round(baseline, 5),
                    "ratio": round(value / baseline, 4),
                    "tokens_per_s": round(norm.tokens / value, 1),
                    "tokens_per_s_plain": round(norm.tokens / baseline, 1),
                    "tokens_per_step": norm.tokens,
                    "rows": len(rows),
                    "micro_batches": len(batches),
                    "zero_stage": args.zero_stage,
                    "steps_timed": len(deepspeed),
                    "deepspeed_p90_s": round(sorted(deepspeed)[int(0.9 * (len(deepspeed) - 1))], 5),
                    "plain_p90_s": round(sorted(plain)[int(0.9 * (len(plain) - 1))], 5),
                }
                | memory
            )
        )
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
