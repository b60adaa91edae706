"""A converged policy survives its next cycle.

The loop runs in this process with the production trainer settings (`TrainerSettings()`: CISPO,
4 steps, lr 1e-3, AdamW carried across cycles, min_signal, the trust region) and real MLflow:
each cycle samples the champion's own traffic with transformers at the served defaults (T = 1,
nothing truncated, the processed logprobs vLLM would report), gives the exclaim task's simulated
user's feedback, settles it with the labeler's own store code, trains, and promotes the
challenger (the gate is not what this test is about). Once the champion meets the preference at
least 95 % of the time on held-out prompts, one more cycle on its own traffic must not lower that
rate by more than 5 points (docs/algorithms.md, Stable updates).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from factories import Feeder, at, feedback, interaction

from evals import get_task
from registry import CHAMPION, Registry
from schemas.events import FeedbackEvent, FeedbackKind, InteractionEvent, SamplingParams
from schemas.settings import Settings, TrainerSettings
from store import Store

pytestmark = pytest.mark.integration

TASK = get_task("exclaim")
EPISODES = 96  # what `rtrl demo` sends per cycle
EVAL_SAMPLES = 300  # held-out completions per rate: standard error about 1.2 points at 0.95
CONVERGED = 0.95
MAX_CYCLES = 10


def generate(
    model_dir: Path, prompts: list[str], seed: int
) -> list[tuple[list[int], list[int], list[float], str]]:
    """(prompt ids, completion ids, their logprobs, completion text) per prompt, sampled at T = 1."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    torch.manual_seed(seed)
    out = []
    for start in range(0, len(prompts), 50):
        ids = [tokenizer(p)["input_ids"] for p in prompts[start : start + 50]]
        width = max(map(len, ids))
        input_ids = torch.tensor([[pad] * (width - len(i)) + i for i in ids])  # left-padded
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
        with torch.no_grad():
            gen = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=TASK.max_tokens,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=pad,
            )
        logprobs = torch.log_softmax(torch.stack(gen.logits, dim=1).float(), dim=-1)  # (B, T, V)
        for b, prompt_ids in enumerate(ids):
            # As vLLM ends a request: at EOS, or at the task's stop string (the token that completed
            # it is the last one sampled; the text ends before the stop string).
            tokens: list[int] = []
            text = ""
            for token in gen.sequences[b, width:].tolist():
                tokens.append(token)
                text = str(tokenizer.decode(tokens, skip_special_tokens=True))
                if token == eos or any(stop in text for stop in TASK.stop):
                    break
            for stop in TASK.stop:
                text = text.split(stop, 1)[0]
            lps = [float(logprobs[b, t, token]) for t, token in enumerate(tokens)]
            out.append((prompt_ids, tokens, lps, text))
    return out


def preference_rate(model_dir: Path) -> float:
    """Share of held-out completions the simulated user accepts (same prompts and seed every time)."""
    heldout = TASK.heldout_prompts(len(TASK.heldout_questions()))
    prompts = (heldout * (EVAL_SAMPLES // len(heldout) + 1))[:EVAL_SAMPLES]
    accepted = sum(
        any(s.kind == FeedbackKind.accepted for s in TASK.preference(prompt, text))
        for prompt, (*_, text) in zip(prompts, generate(model_dir, prompts, seed=1234), strict=True)
    )
    return accepted / EVAL_SAMPLES


def traffic(model_dir: Path, version: int, seed: int) -> list[InteractionEvent | FeedbackEvent]:
    """One cycle of users: the champion's completions on training prompts, and their feedback."""
    prompts = TASK.train_prompts(EPISODES, seed)
    sampling = SamplingParams(temperature=1.0, max_tokens=TASK.max_tokens, logprobs_mode="processed")
    events: list[InteractionEvent | FeedbackEvent] = []
    for i, (prompt, (prompt_ids, tokens, lps, text)) in enumerate(
        zip(prompts, generate(model_dir, prompts, seed), strict=True)
    ):
        event = interaction(
            f"ep-{seed}-{i}",
            version=f"v{version}",
            prompt=prompt,
            prompt_token_ids=prompt_ids,
            completion=text,
            completion_token_ids=tokens,
            completion_logprobs=lps,
            sampling=sampling,
        )
        events.append(event)
        events.extend(feedback(event.request_id, s.kind.value) for s in TASK.preference(prompt, text))
    return events


def test_a_converged_champion_keeps_its_preference_rate_through_one_more_cycle(
    settings: Settings, registry: Registry, champion: int, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from trainer.cycle import end_cycle, run_cycle

    production = settings.model_copy(
        update={"trainer": TrainerSettings(checkpoint_dir=tmp_path / "checkpoints")}
    )
    store = Store(production.store.url)
    store.migrate()
    feeder = Feeder(store)

    def cycle(version: int, model_dir: Path, seed: int) -> tuple[int, Path]:
        written, settled = feeder.send(*traffic(model_dir, version, seed))
        # The tiny model sometimes samples a NUL: stored as U+FFFD, its token ids exact, as in production
        # (schemas.events.storable_text); no interaction is lost to its text.
        assert written.rejected == [], written.rejected
        # Rejections settle at once; acceptances when the settle window has passed (tab-v1).
        stored = len(written.interactions)
        assert settled.settled_terminal + feeder.settle_window(at(31), 30) == stored == EPISODES
        result = run_cycle(production, store, registry, owner="stability")
        print(
            f"cycle {seed}: v{version} -> v{result.challenger_version}, reward {result.mean_reward}, "
            f"KL {[round(s.kl_k3, 4) for s in result.steps]}, stopped at {result.kl_stopped_at_step}"
        )
        assert result.status == "registered" and result.challenger_version is not None, result
        end_cycle(production, store, result.cycle_id or 0, "promoted")  # the gate passed it
        registry.set_alias(CHAMPION, result.challenger_version)
        store.record_promotion(
            registry.model_name, result.challenger_version, "force", "test", "the gate passed it"
        )
        return result.challenger_version, registry.download_checkpoint(result.challenger_version)

    try:
        version, model_dir = champion, tiny_model_dir
        rates = [preference_rate(model_dir)]
        for seed in range(1, MAX_CYCLES + 1):
            if rates[-1] >= CONVERGED:
                break
            version, model_dir = cycle(version, model_dir, seed)
            rates.append(preference_rate(model_dir))
        print("preference rate per version:", rates)
        assert rates[-1] >= CONVERGED, f"the loop did not converge in {MAX_CYCLES} cycles: {rates}"

        _, next_dir = cycle(version, model_dir, seed=100)
        after = preference_rate(next_dir)
    finally:
        store.close()
    print(f"converged champion v{version}: {rates[-1]:.3f}; one more cycle: {after:.3f}")
    assert after >= rates[-1] - 0.05, (rates, after)
