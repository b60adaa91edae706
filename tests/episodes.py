"""Training data for the trainer's and the gate's tests (not a test module): episodes sampled from a
model the way vLLM samples them, fed through the labeler's own store code, and copies of the tiny
model tuned to answer in given shapes."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import torch
from factories import Feeder, feedback, interaction

from schemas.events import FeedbackEvent, InteractionEvent, SamplingParams
from store import Store


def sample_episodes(
    model_dir: Path,
    n: int,
    seed: int,
    version: str = "v1",
    sampling: SamplingParams | None = None,
    alternate: bool = False,
) -> list[tuple[InteractionEvent, FeedbackEvent]]:
    """n single-segment episodes sampled from the model; pairs of episodes share a prompt (groups).

    Sampled as vLLM samples under `sampling` (default: T = 1, nothing truncated), with the
    processed logprobs it would report. Reward: thumbs_up when the completion contains "!" (the
    exclaim task's preference), else thumbs_down; with `alternate`, up and down in turn (so that
    every pair sharing a prompt has a signal); both settle the episode at once under tab-v1.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from evals import get_task
    from serving.sampler import Sampling, processed_log_softmax

    sampling = sampling or SamplingParams(logprobs_mode="processed")
    how = Sampling.of(sampling)
    transform = [torch.tensor([v]) for v in (how.temperature, how.top_k, how.top_p, how.min_p)]

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = get_task("exclaim").train_prompts((n + 1) // 2, seed)
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = prompts[i // 2]
        ids = tokenizer(prompt)["input_ids"]
        tokens: list[int] = []
        logprobs: list[float] = []
        with torch.no_grad():
            for _ in range(8):
                logits = model(input_ids=torch.tensor([ids + tokens])).logits[:, -1:]  # (1, 1, V)
                logp = processed_log_softmax(logits, *transform)[0, 0]
                token = int(torch.multinomial(logp.exp(), 1, generator=generator))
                tokens.append(token)
                logprobs.append(float(logp[token]))
                if token == tokenizer.eos_token_id:
                    break
        completion = tokenizer.decode(tokens, skip_special_tokens=True)
        episode = f"ep-{seed}-{i}"
        event = interaction(
            episode,
            version=version,
            prompt=prompt,
            prompt_token_ids=ids,
            completion=completion,
            completion_token_ids=tokens,
            completion_logprobs=logprobs,
            sampling=sampling,
        )
        up = i % 2 == 0 if alternate else "!" in completion
        kind = "thumbs_up" if up else "thumbs_down"
        out.append((event, feedback(event.request_id, kind)))
    return out


def feed(store: Store, pairs: list[tuple[InteractionEvent, FeedbackEvent]]) -> None:
    """Store and settle the events with the labeler's own write/join/settle code (no Kafka)."""
    feeder = Feeder(store)
    feeder.offsets.update(
        {"interactions": store.stats()["interactions"], "feedback": store.stats()["feedback"]}
    )
    written, _ = feeder.send(*[event for pair in pairs for event in pair])
    assert not written.rejected, [r.reason for r in written.rejected]


def tuned_copy(base: Path, out: Path, shapes: tuple[str, ...], steps: int = 60) -> Path:
    """The base model fine-tuned to answer every question in one of `shapes`."""
    import dataclasses

    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from evals import get_task
    from services.tinymodel import SftConfig, supervise

    shutil.copytree(base, out)
    task = dataclasses.replace(get_task("exclaim"), plain_shapes=shapes, preferred_shapes=shapes)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    supervise(
        model,
        Tokenizer.from_file(str(out / "tokenizer.json")),
        task,
        seed=5,
        cfg=SftConfig(steps=steps, lr=5e-3),
    )
    model.save_pretrained(out, safe_serialization=True)
    return out


# A self-editing agent's regression that single calls never show: asked to prune its context, it
# thinks aloud instead of naming chunks, and the prune runs past max_tokens (the episode is unfinished).
RAMBLING_PRUNE = " Let me think about which of these chunks to drop, one by one, carefully, before I name any"


def rambling_prune_copy(base: Path, out: Path, steps: int = 120) -> Path:
    """The base model fine-tuned to answer plain questions as before (85 % of the examples, in the
    task's own shapes) and to ramble when a self-editing agent asks it to prune (15 %)."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from evals import get_task
    from evals.agents import context_prompt, make_chunks, prune_prompt
    from evals.tasks import Question
    from services.tinymodel import SftConfig, supervise

    shutil.copytree(base, out)
    task = get_task("exclaim")

    def example(question: Question, rng: random.Random) -> tuple[str, str]:
        prompt = task.format_prompt(question.text)
        if rng.random() < 0.85:
            return prompt, task.sft_completion(question, rng)
        first = context_prompt(make_chunks(task, prompt, rng), prompt)
        return prune_prompt(first, task.sft_completion(question, rng)), RAMBLING_PRUNE

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    supervise(model, tokenizer, task, seed=5, cfg=SftConfig(steps=steps, lr=3e-3), example=example)
    model.save_pretrained(out, safe_serialization=True)
    return out
