"""The tiny model: same seed same bytes, loads in transformers, answers in the task's shape.

One full build (default recipe) per module; the determinism checks use 3-step fine-tunes, which run
the same code path in a fraction of the time. Build times are printed (`pytest -s`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from evals import get_task
from rtrl.cli import app
from services import tinymodel

pytestmark = pytest.mark.unit

FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "rtrl_model.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


def digests(directory: Path) -> dict[str, str]:
    return {name: tinymodel.sha256_file(directory / name) for name in FILES}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    started = time.monotonic()
    directory = tinymodel.build(tmp_path_factory.mktemp("tiny"), task="exclaim", seed=0)
    print(f"\nfull tiny-model build: {time.monotonic() - started:.1f} s")
    return directory


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    started = time.monotonic()
    first = digests(tinymodel.build(tmp_path / "a", seed=0, sft_steps=3))
    print(f"\n3-step build: {time.monotonic() - started:.1f} s")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted(FILES)
    assert digests(tinymodel.build(tmp_path / "b", seed=0, sft_steps=3)) == first
    other = digests(tinymodel.build(tmp_path / "c", seed=1, sft_steps=3))
    assert other["model.safetensors"] != first["model.safetensors"]
    assert other["rtrl_model.json"] != first["rtrl_model.json"]  # records the seed
    # The tokenizer comes from the shipped corpus alone, not from the seed.
    assert other["tokenizer.json"] == first["tokenizer.json"]


def test_build_leaves_torch_settings_alone(tmp_path: Path) -> None:
    import torch

    threads = torch.get_num_threads()
    tinymodel.build(tmp_path / "m", task=None, seed=0)
    assert torch.get_num_threads() == threads
    assert not torch.are_deterministic_algorithms_enabled()


def test_shape_and_config(tiny: Path) -> None:
    config = json.loads((tiny / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] // config["num_attention_heads"] == 64  # vLLM CPU attention needs 64
    assert (config["num_key_value_heads"], config["num_hidden_layers"]) == (1, 2)
    assert config["tie_word_embeddings"] is False
    assert config["vocab_size"] == tinymodel.VOCAB_SIZE
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (0, 1, 2)
    info = tinymodel.info(tiny)
    # embed + lm_head: 2*384*128; per layer: q,o 128*128, k,v 128*64, mlp 3*128*256, 2 norms 128; final norm.
    layer = 2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 256 + 2 * 128
    assert info["parameters"] == 2 * 384 * 128 + 2 * layer + 128 == 393_856
    assert info["recipe_task"] == "exclaim" and info["recipe_sft_steps"] == 200


def test_loads_in_transformers_and_answers_in_shape(tiny: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny)
    assert next(model.parameters()).dtype == torch.float32
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    ids = tokenizer("Q: What is 3 plus 4?\nA:", return_tensors="pt")["input_ids"]
    assert ids[0, 0].item() == tokenizer.bos_token_id == 0
    out = model.generate(ids, max_new_tokens=16, do_sample=False)
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert out[0, -1].item() == tokenizer.eos_token_id, text  # the answer ends itself with </s>
    assert text.startswith(" ") and text.strip()[-1] in ".!", text

    task = get_task("exclaim")
    completions = tinymodel.sample_completions(tiny, task.heldout_prompts(16), task.max_tokens, seed=0)
    shapes = [c for c in completions if c.strip() and c.strip()[-1] in ".!" and len(c) <= 48]
    assert len(shapes) >= 14, completions


def test_temperature_zero_is_greedy(tiny: Path) -> None:
    # bench_learning's held-out correctness decodes greedily: the argmax, whatever the seed.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    task = get_task("exclaim")
    prompts = task.heldout_prompts(8)
    greedy = tinymodel.sample_completions(tiny, prompts, task.max_tokens, seed=0, temperature=0)
    assert tinymodel.sample_completions(tiny, prompts, task.max_tokens, seed=7, temperature=0) == greedy
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny)
    for prompt, completion in zip(prompts, greedy, strict=True):
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=task.max_tokens, do_sample=False)
        expected = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).split("\n")[0]
        assert completion == expected
    right = tinymodel.answers_correct(tiny, "exclaim", "heldout", temperature=0)
    assert len(right) == len(task.heldout_questions())
    assert tinymodel.measure_correct(tiny, "exclaim", "heldout", temperature=0) == sum(right) / len(right)


def test_preference_rate_in_learnable_band(tiny: Path) -> None:
    # The learning demo needs a base model that meets the preference sometimes, not never or mostly.
    rate = tinymodel.measure_preference(tiny, "exclaim", prompts=48, samples=4, seed=0)
    print(f"\npreference rate at temperature 1: {rate:.3f}")
    assert 0.08 <= rate <= 0.35


def test_the_v2_recipe_knows_its_task(tiny: Path, tmp_path: Path) -> None:
    # Capability retention is only measurable on a model that has something to retain (issue 10).
    capable = tinymodel.build(tmp_path / "v2", task="exclaim", seed=0, recipe="v2")
    train = tinymodel.measure_correct(capable, "exclaim", "train", seed=0)
    heldout = tinymodel.measure_correct(capable, "exclaim", "heldout", seed=0)
    print(f"\nv2 correct at temperature 1: training questions {train:.3f}, held-out {heldout:.3f}")
    assert train >= 0.8 and heldout >= 0.3
    assert tinymodel.info(capable)["recipe_recipe"] == "rtrl-tiny-llama-v2"
    assert tinymodel.measure_correct(tiny, "exclaim", "train", seed=0) < 0.3  # v1 learns the shapes only
    assert (
        tinymodel.measure_preference(capable, "exclaim") >= 0.08
    )  # and still meets the preference sometimes


def test_chat_template_matches_completion_format(tiny: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 3 plus 4?"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<s>" + get_task("exclaim").format_prompt("What is 3 plus 4?")
    two_turns = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": " red!"}],
        tokenize=False,
    )
    assert two_turns == "<s>Q: Name a color.\nA: red!</s>\n"


def test_tokenizer_round_trips_the_corpus(tiny: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    lines = tinymodel.corpus_lines()
    assert len(lines) > 300
    for line in lines + ["Unseen words: zebra, 12345, café ✓"]:
        ids = tokenizer(line)["input_ids"]
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.decode(ids, skip_special_tokens=True) == line
    # The preference hinges on one token: "!" and "." are single tokens after an answer.
    assert tokenizer.tokenize(" It is 7!")[-1] == "!" and tokenizer.tokenize(" It is 7.")[-1] == "."


def test_cli_init_refuses_non_empty_dir_and_info(tiny: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    (tmp_path / "keep.txt").write_text("x")
    result = runner.invoke(app, ["model", "init", str(tmp_path)])
    assert result.exit_code == 2 and "not empty" in result.output
    assert (tmp_path / "keep.txt").read_text() == "x"
    result = runner.invoke(app, ["model", "init", str(tmp_path / "new"), "--task", "nope"])
    assert result.exit_code == 2 and "unknown task" in result.output

    result = runner.invoke(app, ["model", "info", str(tiny)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["model_sha256"] == tinymodel.sha256_file(tiny / "model.safetensors")


def test_the_replay_file_holds_training_questions_only(tiny: Path, tmp_path: Path) -> None:
    from evals.suites import contains_answer
    from schemas.replay import read_replay_file

    task = get_task("exclaim")
    heldout = {q.text for q in task.heldout_questions()}
    answers = {q.text: q.answers for q in task.train_questions()}
    supervised = tinymodel.replay_examples("exclaim", seed=0)
    assert [e.messages[0].content for e in supervised] == [q.text for q in task.train_questions()]
    own = tinymodel.replay_examples("exclaim", model_dir=tiny)  # only what the model answers right
    assert 0 < len(own) < len(supervised)
    for e in supervised + own:
        question = e.messages[0].content
        assert question not in heldout and question in answers
        assert [m.role for m in e.messages] == ["user"]
        assert contains_answer(task.format_prompt(question), e.completion, {"answers": answers[question]})
    path = tinymodel.write_replay(tmp_path / "replay.jsonl", own)
    assert read_replay_file(path) == own
