"""One optimizer step of the training cycle on DeepSpeed vs a plain PyTorch loop, same model, same batch.

    .venv/bin/python bench/bench_trainer.py [--rows 64] [--steps 6] [--rounds 2] [--zero-stage 0]

Builds the tiny model (the demo's, in a temporary directory; no services needed) and one batch of
rows as a cycle sees them: prompts of the exclaim task with completions sampled from the model at
T = 1, behaviour logprobs = the model's own, advantages ±1. Then, side by side in one run,
alternating in rounds so that both see the same machine state:

* rtrl: the cycle's own code (`trainer.engine.start_engine` → `token_logprobs` → CISPO loss →
  `engine.backward` → `engine.step`, ZeRO stage from ``--zero-stage``);
* baseline, plain PyTorch: the same model, forward, loss and micro-batches, ``loss.backward()``,
  gradient clipping at 1.0 and ``torch.optim.AdamW`` with the same hyper-parameters.

Reports the median seconds per optimizer step of each, and completion tokens per second.
Target (issue 9): ratio ≤ 1.15. The last line is one JSON object:
``{"name", "value": DeepSpeed s/step, "baseline": plain s/step, "ratio", "tokens_per_s", ...}``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from evals import get_task
from rtrl.services.testing import make_run_dir, services_settings
from rtrl.services.vllm import ensure_model
from schemas.settings import CispoLoss, TrainerSettings
from serving.sampler import MicroBatch, Row, micro_batches, token_logprobs
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
        rows.append(Row(input_ids=ids + tokens, prompt_len=len(ids), behaviour_logprobs=logprobs,
                        advantage=1.0 if i % 2 == 0 else -1.0))  # fmt: skip
    return rows


def one_step(model: torch.nn.Module, batches: list[MicroBatch], norm: Normaliser, cfg: CispoLoss,
             backward: Callable[[torch.Tensor], None], step: Callable[[bool], None]) -> None:  # fmt: skip
    """The cycle's inner loop for one optimizer step (π_old = π_θ detached: the first step's case)."""
    for k, mb in enumerate(batches):
        logprobs, possible, _ = token_logprobs(model, mb)
        out = cispo(TokenBatch(logprobs, logprobs.detach(), mb.behaviour_logprobs, mb.advantages,
                               mb.mask * possible), cfg, norm)  # fmt: skip
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


def time_deepspeed(model_dir: Path, cfg: TrainerSettings, batches: list[MicroBatch], norm: Normaliser, steps: int) -> list[float]:
    engine = start_engine(model_dir, cfg, accumulation=len(batches))
    try:
        def backward(loss: torch.Tensor) -> None:
            engine.backward(loss, scale_wrt_gas=False)

        def step(_last: bool) -> None:
            engine.step()  # DeepSpeed steps the optimizer at the accumulation boundary itself

        return timed(lambda: one_step(engine, batches, norm, cfg.loss, backward, step), steps)
    finally:
        close_engine(engine)


def time_plain(model_dir: Path, cfg: TrainerSettings, batches: list[MicroBatch], norm: Normaliser, steps: int) -> list[float]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

    def backward(loss: torch.Tensor) -> None:
        loss.backward()

    def step(last: bool) -> None:
        if last:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return timed(lambda: one_step(model, batches, norm, cfg.loss, backward, step), steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64, help="rows (trainable segments) per optimizer step")
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps per round and method")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each timing DeepSpeed then plain")
    parser.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3])
    args = parser.parse_args()

    run_dir = make_run_dir("rtrl-bench-trainer-")
    try:
        settings = services_settings(run_dir, run_dir / "model", enabled=())
        model_dir = ensure_model(settings)
        cfg = settings.trainer.model_copy(update={"zero_stage": args.zero_stage, "loss": CispoLoss()})
        rows = sample_rows(model_dir, args.rows)
        batches = micro_batches(rows, cfg.micro_batch, pad_id=0)
        norm = Normaliser(tokens=sum(b.tokens for b in batches), sequences=len(rows))
        print(f"{len(rows)} rows, {norm.tokens} completion tokens, {len(batches)} micro-batches of <= {cfg.micro_batch}, "
              f"ZeRO {args.zero_stage}, CPU threads {torch.get_num_threads()}", flush=True)  # fmt: skip
        deepspeed: list[float] = []
        plain: list[float] = []
        for round_ in range(args.rounds):
            deepspeed += time_deepspeed(model_dir, cfg, batches, norm, args.steps)
            plain += time_plain(model_dir, cfg, batches, norm, args.steps)
            print(f"round {round_ + 1}: DeepSpeed {statistics.median(deepspeed):.4f} s/step, "
                  f"plain {statistics.median(plain):.4f} s/step", flush=True)  # fmt: skip
        value, baseline = statistics.median(deepspeed), statistics.median(plain)
        print(f"DeepSpeed {value:.4f} s/step vs plain PyTorch {baseline:.4f} s/step: ratio {value / baseline:.3f} "
              f"(target <= 1.15); {norm.tokens / value:.0f} tokens/s", flush=True)  # fmt: skip
        print(json.dumps({
            "name": "trainer_step_s", "value": round(value, 5), "baseline": round(baseline, 5),
            "ratio": round(value / baseline, 4), "tokens_per_s": round(norm.tokens / value, 1),
            "tokens_per_s_plain": round(norm.tokens / baseline, 1), "tokens_per_step": norm.tokens,
            "rows": len(rows), "micro_batches": len(batches), "zero_stage": args.zero_stage,
            "steps_timed": len(deepspeed), "deepspeed_p90_s": round(sorted(deepspeed)[int(0.9 * (len(deepspeed) - 1))], 5),
            "plain_p90_s": round(sorted(plain)[int(0.9 * (len(plain) - 1))], 5),
        }))  # fmt: skip
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
