"""Planted challengers and logged traffic, made locally from the tiny model: for the gate's tests and
bench/bench_gate.py.

A *planted* challenger is a checkpoint whose effect on the simulated users is known because it was
made so: the base fine-tuned to answer in given shapes (`tuned_copy`: the exclaim users' preferred
shapes make a better model, its plain shapes a worse one, `ASKING` a non-answer hack, `RAMBLING`
answers cut off by max_tokens), the base with noise added (`perturbed_copy`; std 0 is the same
weights), or a self-editing agent's regression that single calls never show
(`rambling_prune_copy`).

*Logged traffic* is what the gate's off-policy suite reads: `sample_episodes` samples a checkpoint's
completions of the exclaim task's training prompts as vLLM samples them (with the processed
logprobs it would report), rated by exclaim users (thumbs up when the completion contains "!");
`feed` stores and settles them through the labeler's own store path (`Store.labelling`, the same
validation, write, join and settle as the labeler's; no Kafka, no gateway).
"""

from __future__ import annotations

import dataclasses
import random
import shutil
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

from evals import get_task
from evals.agents import context_prompt, make_chunks, prune_prompt
from evals.tasks import Question
from feedback.records import Checks, parse_record
from schemas.events import FeedbackEvent, InteractionEvent, SamplingParams
from schemas.rewards import TAB_V1, RewardSpec
from schemas.settings import LimitsSettings
from store import SourceRecord, Store

# Cursor's two reward hacks, planted: a model that answers with a clarifying question (users give no
# feedback to a non-answer, so it is never rejected), and one that never finishes its answer.
ASKING = ("Do you mean {answer}?", "Which one?", "Which one do you mean?")
RAMBLING = (
    "Let me think about this question step by step, carefully, before I answer it with {answer} "
    "and then explain why that is so",
)
# A self-editing agent's regression that single calls never show: asked to prune its context, it
# thinks aloud instead of naming chunks, and the prune runs past max_tokens (the episode is unfinished).
RAMBLING_PRUNE = " Let me think about which of these chunks to drop, one by one, carefully, before I name any"

LOGGED_AT = datetime(2026, 1, 1, tzinfo=UTC)  # the logged events' created_at, fixed: runs repeat

_Example = Callable[[Question, random.Random], tuple[str, str]]  # a question -> (prompt, completion)


def perturbed_copy(base: Path, out: Path, std: float, seed: int) -> Path:
    """The base checkpoint with Gaussian noise of `std` added to every weight (same shapes, same tokenizer)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, out)
    generator = torch.Generator().manual_seed(seed)
    for path in out.glob("*.safetensors"):
        tensors = load_file(path)
        noisy = {
            k: (v + std * torch.randn(v.shape, generator=generator, dtype=v.dtype)).contiguous()
            for k, v in tensors.items()
        }
        save_file(noisy, path, metadata={"format": "pt"})
    return out


def tuned_copy(base: Path, out: Path, shapes: tuple[str, ...], steps: int = 60) -> Path:
    """The base model fine-tuned to answer every question in one of `shapes`."""
    task = dataclasses.replace(get_task("exclaim"), plain_shapes=shapes, preferred_shapes=shapes)
    return _supervised(
        base, out, steps, 5e-3, lambda q, rng: (task.format_prompt(q.text), task.sft_completion(q, rng))
    )


def rambling_prune_copy(base: Path, out: Path, steps: int = 120) -> Path:
    """The base model fine-tuned to answer plain questions as before (85 % of the examples, in the
    task's own shapes) and to ramble when a self-editing agent asks it to prune (15 %)."""
    task = get_task("exclaim")

    def example(question: Question, rng: random.Random) -> tuple[str, str]:
        prompt = task.format_prompt(question.text)
        if rng.random() < 0.85:
            return prompt, task.sft_completion(question, rng)
        first = context_prompt(make_chunks(task, prompt, rng), prompt)
        return prune_prompt(first, task.sft_completion(question, rng)), RAMBLING_PRUNE

    return _supervised(base, out, steps, 3e-3, example)


def _supervised(base: Path, out: Path, steps: int, lr: float, example: _Example) -> Path:
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    from services.tinymodel import SftConfig, supervise

    shutil.copytree(base, out)
    model = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)  # the tiny model's class
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    supervise(
        model, tokenizer, get_task("exclaim"), seed=5, cfg=SftConfig(steps=steps, lr=lr), example=example
    )
    model.save_pretrained(out, safe_serialization=True)
    return out


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
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
        event = InteractionEvent(
            event_id=f"i-{episode}-0",
            request_id=f"r-{episode}-0",
            episode_id=episode,
            segment_index=0,
            model="tiny",
            policy_version=version,
            prompt=prompt,
            prompt_token_ids=ids,
            completion=completion,
            completion_token_ids=tokens,
            completion_logprobs=logprobs,
            sampling=sampling,
            created_at=LOGGED_AT,
        )
        up = i % 2 == 0 if alternate else "!" in completion
        kind = "thumbs_up" if up else "thumbs_down"
        rated = FeedbackEvent(
            event_id=f"f-{event.request_id}-{kind}",
            request_id=event.request_id,
            kind=kind,
            value=1.0,
            created_at=LOGGED_AT,
        )
        out.append((event, rated))
    return out


def feed(
    store: Store,
    pairs: Sequence[tuple[InteractionEvent, FeedbackEvent]],
    holdout_key: bytes,
    spec: RewardSpec = TAB_V1,
    now: datetime = LOGGED_AT,
) -> None:
    """Store and settle the events with the labeler's own write, join and settle (no Kafka): offsets
    continue the store's counts, as one partition per topic would. Raises ValueError when an event
    is refused (it never is for `sample_episodes`' events)."""
    stats = store.stats()
    offsets = {"interactions": stats["interactions"], "feedback": stats["feedback"]}
    checks = Checks(spec=spec, limits=LimitsSettings(), vocab_size=None)
    records = []
    for event in (e for pair in pairs for e in pair):
        topic = "interactions" if isinstance(event, InteractionEvent) else "feedback"
        record = SourceRecord(topic, 0, offsets[topic], event.model_dump_json().encode())
        offsets[topic] += 1
        records.append((record, parse_record(record, type(event), checks, now)))
    with store.labelling(now) as tx:
        written = tx.write_events(records, "accept", None)
        tx.join_and_settle(spec, written.interactions, written.feedback, holdout_key=holdout_key)
    if written.rejected:
        raise ValueError(
            f"{len(written.rejected)} events refused: {[r.reason for r in written.rejected][:3]}"
        )
