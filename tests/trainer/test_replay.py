"""Replay of retention data (trainer/replay.py): the draw per cycle, the rows' tokens against what
vLLM's endpoints give the same conversation, and the loss term, by hand on small tensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from evals import get_task
from schemas.replay import ReplayExample
from schemas.settings import CispoLoss, ReplaySettings, TrainerSettings
from serving.sampler import collate
from trainer.losses import Normaliser, TokenBatch, loss_function
from trainer.replay import batches, draw, replay_loss, replay_row

pytestmark = pytest.mark.unit


def example(question: str, completion: str) -> ReplayExample:
    return ReplayExample.model_validate(
        {"messages": [{"role": "user", "content": question}], "completion": completion}
    )


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from services.tinymodel import build

    return build(tmp_path_factory.mktemp("tiny"), task=None)  # the tokenizer and template; no tuning


# ---- the draw --------------------------------------------------------------------------------------


def test_the_draw_is_seeded_by_the_cycle_without_replacement_in_file_order() -> None:
    examples = [example(f"What comes after {n}?", f" {n + 1}.") for n in range(20)]
    first = draw(examples, 5, seed=0, cycle_id=1)
    assert len(first) == len(set(first)) == 5
    assert first == draw(examples, 5, seed=0, cycle_id=1)  # the same in every process
    assert [examples.index(e) for e in first] == sorted(examples.index(e) for e in first)
    assert first != draw(examples, 5, seed=0, cycle_id=2) and first != draw(examples, 5, seed=1, cycle_id=1)
    assert draw(examples, 50, seed=0, cycle_id=1) == examples  # fewer than per_cycle: all of them


# ---- the rows' tokens ------------------------------------------------------------------------------


def test_a_row_is_the_chat_rendered_prompt_then_the_completion_and_eos(tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    row = replay_row(tokenizer, example("What is 3 plus 4?", " It is 7."))
    # The tiny model's template renders the task's completion prompt: the ids vLLM's /v1/completions
    # gives the episodes the trainer learns from (BOS added by the tokenizer).
    prompt = tokenizer(get_task("exclaim").format_prompt("What is 3 plus 4?"))["input_ids"]
    completion = tokenizer.encode(" It is 7.", add_special_tokens=False)
    assert row.input_ids == [*prompt, *completion, tokenizer.eos_token_id]
    assert row.prompt_len == len(prompt) and row.input_ids[0] == tokenizer.bos_token_id
    assert row.input_ids.count(tokenizer.bos_token_id) == 1  # the template's BOS, not a second one
    assert tokenizer.decode(row.input_ids[row.prompt_len :]) == " It is 7.</s>"
    assert row.advantage == 0.0 and row.behaviour_logprobs == [0.0] * (len(completion) + 1)
    mb = collate([row], pad_id=0)
    assert mb.tokens == len(completion) + 1  # every completion token and </s> is a target, no prompt token


def test_a_cycles_batches_hold_its_draw_and_count_its_tokens(tokenizer_dir: Path) -> None:
    examples = [example(f"What comes after {n}?", f" {n + 1}.") for n in range(10)]
    cfg = TrainerSettings(micro_batch=2, replay=ReplaySettings(path=Path("r.jsonl"), weight=0.3, per_cycle=5))
    out = batches(cfg, examples, 7, tokenizer_dir=tokenizer_dir)
    assert out is not None and out.rows == 5 and out.weight == 0.3
    assert [b.input_ids.shape[0] for b in out.batches] == [2, 2, 1]
    assert out.tokens == sum(b.tokens for b in out.batches) > 0
    assert batches(cfg, None, 7, tokenizer_dir=tokenizer_dir) is None  # replay off


# ---- the loss term ---------------------------------------------------------------------------------


def policy_loss() -> torch.Tensor:
    b = TokenBatch(
        logprobs=torch.tensor([[-1.0, -0.5, 0.0]], requires_grad=True),
        old_logprobs=torch.tensor([[-1.0, -0.5, 0.0]]),
        behaviour_logprobs=torch.tensor([[-1.0, -0.5, 0.0]]),
        advantages=torch.tensor([0.5]),
        mask=torch.tensor([[1.0, 1.0, 0.0]]),
    )
    return loss_function(CispoLoss())(b, CispoLoss(), Normaliser(tokens=2, sequences=1)).loss


@pytest.mark.parametrize("weight", [0.0, 0.3])
def test_the_replay_term_adds_weight_times_the_mean_token_nll(weight: float) -> None:
    # Two micro-batches of one step: 3 + 2 replay tokens, NLL 0.5 + 1 + 2 and 1 + 0.5 (= 5 in all).
    parts = [
        (torch.tensor([[-0.5, -1.0, -2.0, -9.0]], requires_grad=True), torch.tensor([[1.0, 1.0, 1.0, 0.0]])),
        (
            torch.tensor([[-1.0, -0.5], [-7.0, -7.0]], requires_grad=True),
            torch.tensor([[1.0, 1.0], [0.0, 0.0]]),
        ),
    ]
    plain = policy_loss()
    total, nll = plain, 0.0
    for logprobs, mask in parts:
        loss, part = replay_loss(logprobs, mask, weight, tokens=5)
        total, nll = total + loss, nll + part
    assert nll == pytest.approx(5.0)
    value, plain_value = float(total.detach()), float(plain.detach())
    assert value == pytest.approx(plain_value + weight * 5.0 / 5)  # weight · mean token NLL
    if weight == 0.0:
        assert value == plain_value
    total.backward()
    # d/d log π of each replay token: −weight / tokens; 0 off the mask (the prompt, padding).
    assert parts[0][0].grad is not None and parts[1][0].grad is not None
    assert parts[0][0].grad.flatten().tolist() == pytest.approx([-weight / 5] * 3 + [0.0])
    assert parts[1][0].grad.flatten().tolist() == pytest.approx([-weight / 5] * 2 + [0.0, 0.0])


# ---- rows that cannot be built are not the episodes' fault --------------------------------------


def test_a_replay_row_longer_than_the_model_is_refused_and_not_counted_against_the_episodes(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    """A row past the model's positions would crash the forward pass after the episodes are claimed;
    it is refused before training, with an error the cycle does not count against them."""
    from trainer.cycle import NOT_THE_DATAS
    from trainer.replay import ReplayUnusable

    positions = json.loads((tokenizer_dir / "config.json").read_text())["max_position_embeddings"]
    cfg = TrainerSettings(replay=ReplaySettings(path=tmp_path / "replay.jsonl"))
    long = example("What is 3 plus 4?", " seven" * positions)
    with pytest.raises(ReplayUnusable, match="longer than the model's") as caught:
        batches(cfg, [long], 1, tokenizer_dir=tokenizer_dir)
    assert isinstance(caught.value, NOT_THE_DATAS)
    assert batches(cfg, [example("What is 3 plus 4?", " 7.")], 1, tokenizer_dir=tokenizer_dir) is not None


def test_a_checkpoint_without_a_chat_template_is_refused_for_replay(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    from trainer.replay import ReplayUnusable

    bare = Path(shutil.copytree(tokenizer_dir, tmp_path / "bare"))
    config = bare / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    settings.pop("chat_template", None)
    config.write_text(json.dumps(settings))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    cfg = TrainerSettings(replay=ReplaySettings(path=tmp_path / "replay.jsonl"))
    with pytest.raises(ReplayUnusable, match="chat template"):
        batches(cfg, [example("What is 3 plus 4?", " 7.")], 1, tokenizer_dir=bare)
