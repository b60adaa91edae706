"""The deterministic tiny model: a 2-layer Llama in HF format that vLLM's CPU server, transformers
and the DeepSpeed trainer all load, so the whole loop runs on one CPU machine in seconds.

Started by ``rtrl model init DIR [--task exclaim|none] [--seed N]`` (`rtrl/commands/model.py`).
`build` trains a byte-level BPE tokenizer on the corpus shipped in ``services/data/corpus.txt``,
initialises the model from the seed and, for a task, runs a supervised fine-tune so the model
answers the task's prompts in the task's shape and already satisfies the task's preference some of
the time (about one sample in five for ``exclaim``). Two recipes (``--recipe``):

- ``v1`` (the default): 200 steps at 5e-3. The model learns the shapes, not the answers (for
  ``exclaim``: 11 % of the training questions right when sampled, 9 % of the held-out ones).
- ``v2``: 1,000 steps at 1e-3. It knows the answers (95.5 % and 61 %; 100 % of the training
  questions greedily), so capability retention is measurable. Not the default yet: the trainer's
  default update (lr 1e-3) costs such a model a quarter of its answers in one cycle, and the gate
  rightly rejects every such challenger (docs/algorithms.md, Calibration on the tiny model).

`measure_preference` and `measure_correct` sample the model to check; `replay_examples` and
`write_replay` make a replay file of the training questions for ``trainer.replay``. Same seed, same software,
same bytes: the tokenizer trainer is deterministic, the model is
initialised and tuned under a fixed seed on one thread, and every file is written in a fixed
order with sorted keys. A different CPU or torch build may differ in the last bits of the weights.

Files written: config.json, generation_config.json, model.safetensors (float32, lm_head not tied
to the embeddings: vLLM's digest checks cover lm_head), tokenizer.json, tokenizer_config.json
(with a chat template in the task's Q:/A: format), special_tokens_map.json and rtrl_model.json
(the recipe and the supervised loss, read by `info`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from evals import Task, get_task

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    from evals.tasks import Question
    from schemas.replay import ReplayExample

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (BOS, EOS, PAD)  # ids 0, 1, 2
VOCAB_SIZE = 384
RECIPE = "rtrl-tiny-llama"

# head_dim = hidden / heads must be 64: vLLM's CPU attention rejects 16 (docs/platform.md, vLLM on CPU).
MODEL_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}

# The chat template renders a conversation in the task's completion format, so
# /v1/chat/completions and /v1/completions see the same text. With `tools` it adds one line that
# lists them, an assistant's tool calls in vLLM's pythonic format (``[lookup(item="red box")]``, read
# by ``--tool-call-parser pythonic``, which needs no special tokens) and a tool's result as ``R: ...``
# (docs/methods.md, Tool calls). A conversation without tools renders as it always did, byte for byte
# (tests/services/test_tinytools.py). Newlines after block tags are written as {{ '\n' }}: the
# renderers (transformers, vLLM) trim the first newline after a block tag.
TOOLS_LINE = (
    "{% if tools %}Tools: "
    "{% for tool in tools %}{% set fn = tool['function'] if tool['function'] is defined else tool %}"
    "{{ fn['name'] }}("
    "{% if fn['parameters'] is defined and fn['parameters']['properties'] is defined %}"
    "{{ fn['parameters']['properties'] | list | join(', ') }}{% endif %})"
    "{% if not loop.last %}, {% endif %}{% endfor %}{{ '\n' }}"
    "{% endif %}"
)
TOOL_CALLS = (
    "A: [{% for call in message['tool_calls'] %}"
    "{% set fn = call['function'] if call['function'] is defined else call %}{{ fn['name'] }}("
    "{% for key, value in fn['arguments'].items() %}{{ key }}={{ value | tojson }}"
    "{% if not loop.last %}, {% endif %}{% endfor %})"
    "{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}\n"
)
CHAT_TEMPLATE = (
    "{# tool_call_parser: pythonic #}"
    "{{ bos_token }}" + TOOLS_LINE + "{% for message in messages %}"
    "{% if message['role'] == 'user' %}Q: {{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}" + TOOL_CALLS + ""
    "{% elif message['role'] == 'assistant' %}A: {{ message['content'] | trim }}{{ eos_token }}\n"
    "{% elif message['role'] == 'tool' %}R: {{ message['content'] }}\n"
    "{% else %}{{ message['content'] }}\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)
# The template of every build before tool calls: what a conversation without tools must still render as.
CHAT_TEMPLATE_BEFORE_TOOLS = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}Q: {{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}A: {{ message['content'] | trim }}{{ eos_token }}\n"
    "{% else %}{{ message['content'] }}\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)


@dataclass(frozen=True)
class SftConfig:
    """The supervised fine-tune of `build` (the v1 recipe's values; `RECIPES` has the others)."""

    steps: int = 200
    batch_size: int = 32
    lr: float = 5e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20


# v1: about 14 s on two CPU cores, learns the shapes only; v2: about 45 s, learns the answers too.
# tools (for --task lookup): 80 s of CPU, 99 s wall on a loaded 2-core machine; the model calls the
# tool with the right item for 99 % of the training questions and 94 % of the held-out ones at
# temperature 1, and states the tool's result in 9 answers in 10 (docs/methods.md, Tool calls).
RECIPES: dict[str, SftConfig] = {
    "v1": SftConfig(),
    "v2": SftConfig(steps=1000, lr=1e-3),
    "tools": SftConfig(steps=600, lr=3e-3),
}


def corpus_lines() -> list[str]:
    """The shipped tokenizer corpus, one sentence or Q/A line per element."""
    text = resources.files("services.data").joinpath("corpus.txt").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def train_tokenizer() -> Tokenizer:
    """Byte-level BPE on the corpus; prepends <s> to every encoded sequence like Llama does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_lines(), trainer)
    bos_id = _special_id(tokenizer, BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def _special_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ValueError(f"tokenizer has no {token} token")
    return token_id


@contextlib.contextmanager
def _deterministic_torch(seed: int) -> Iterator[None]:
    """One thread, deterministic kernels and a fixed seed; restores the caller's settings."""
    import torch

    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def _encode_examples(
    tokenizer: Tokenizer, examples: list[tuple[str, str]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, labels); loss only on completion tokens and </s>."""
    import torch

    eos_id, pad_id = _special_id(tokenizer, EOS), _special_id(tokenizer, PAD)
    rows: list[tuple[list[int], list[int]]] = []
    for prompt, completion in examples:
        prompt_ids = tokenizer.encode(prompt).ids
        completion_ids = tokenizer.encode(completion, add_special_tokens=False).ids + [eos_id]
        rows.append((prompt_ids + completion_ids, [-100] * len(prompt_ids) + completion_ids))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (B, T)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, T)
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        mask[i, : len(ids)] = 1
    return input_ids, mask, labels


def supervise(
    model: LlamaForCausalLM,
    tokenizer: Tokenizer,
    task: Task,
    seed: int,
    cfg: SftConfig,
    example: Callable[[Question, random.Random], tuple[str, str]] | None = None,
) -> float:
    """Fine-tune `model` on the task's training questions; returns the mean loss of the last 20 steps.
    `example` makes each question's (prompt, completion); default: the task's prompt and a supervised
    completion in one of its shapes (`Task.sft_example`; a tool task's is the tool call half the time)."""
    import torch

    rng = random.Random(seed)
    questions = task.train_questions()
    make = example or task.sft_example
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / cfg.warmup_steps) * (1 - step / cfg.steps)
    )
    model.train()
    recent: list[float] = []
    for _ in range(cfg.steps):
        batch = [make(q, rng) for q in rng.choices(questions, k=cfg.batch_size)]
        input_ids, mask, labels = _encode_examples(tokenizer, batch)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        recent = (recent + [loss.item()])[-20:]
    model.eval()
    return sum(recent) / len(recent)


def build(
    out_dir: Path,
    task: str | None = "exclaim",
    seed: int = 0,
    sft_steps: int | None = None,
    recipe: str = "v1",
) -> Path:
    """Write the tiny checkpoint for `seed` (tuned on `task` unless None) into `out_dir`; returns it.

    Existing files of the same names are overwritten; `rtrl model init` refuses non-empty folders.
    """
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    started, cpu_started = time.monotonic(), time.process_time()
    task_obj = get_task(task) if task is not None else None
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; known: {', '.join(sorted(RECIPES))}")
    cfg = RECIPES[recipe] if sft_steps is None else dataclasses.replace(RECIPES[recipe], steps=sft_steps)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer()
    bos_id, eos_id, pad_id = (_special_id(tokenizer, t) for t in SPECIAL_TOKENS)
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        **MODEL_SHAPE,
        hidden_act="silu",
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
        architectures=["LlamaForCausalLM"],
    )
    sft_loss: float | None = None
    with _deterministic_torch(seed):
        model = LlamaForCausalLM(config)
        if task_obj is not None and cfg.steps > 0:
            sft_loss = supervise(model, tokenizer, task_obj, seed, cfg)

    # ---- write the checkpoint -----------------------------------------------------------------
    tensors = {name: t.detach().contiguous().clone() for name, t in sorted(model.state_dict().items())}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "model.safetensors").chmod(0o644)  # safetensors creates it 0600; servers may run as others
    config.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id).save_pretrained(out_dir)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "model_max_length": MODEL_SHAPE["max_position_embeddings"],
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(out_dir / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD})
    _write_json(
        out_dir / "rtrl_model.json",
        {
            "recipe": f"{RECIPE}-{recipe}",
            "sft_lr": cfg.lr,
            "task": task,
            "seed": seed,
            "sft_steps": cfg.steps if task_obj is not None else 0,
            "sft_final_loss": None if sft_loss is None else round(sft_loss, 6),
        },
    )
    # Build time goes to the caller's log, not into the files (they must not depend on it).
    _last_build_seconds[str(out_dir)] = (time.monotonic() - started, time.process_time() - cpu_started)
    return out_dir


_last_build_seconds: dict[str, tuple[float, float]] = {}


def build_seconds(out_dir: Path) -> tuple[float, float] | None:
    """(wall, CPU) seconds of the last `build` into `out_dir` in this process, if any."""
    return _last_build_seconds.get(str(Path(out_dir)))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sample_completions(
    model_dir: Path, prompts: list[str], max_tokens: int, seed: int = 0, temperature: float = 1.0
) -> list[str]:
    """One completion per prompt, sampled with transformers at `temperature` (no top-k / top-p);
    temperature 0 is greedy decoding (the argmax token, no draw).

    Generation stops at </s>; the text is cut at the first newline, like the task's stop string.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    encoded = [tokenizer(p)["input_ids"] for p in prompts]
    width = max(len(ids) for ids in encoded)
    # Left-padded so every row's next token sits in the last column.
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in encoded])  # (B, T)
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded])  # (B, T)
    generator = torch.Generator().manual_seed(seed)
    done = torch.zeros(len(prompts), dtype=torch.bool)
    out: list[list[int]] = [[] for _ in prompts]
    with torch.no_grad():
        for _ in range(max_tokens):
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(
                input_ids=input_ids, attention_mask=mask, position_ids=positions
            ).logits  # (B, T, V)
            if temperature == 0:
                nxt = logits[:, -1].argmax(dim=-1)  # (B,)
            else:
                probs = torch.softmax(logits[:, -1] / temperature, dim=-1)  # (B, V)
                nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)
            for i, token in enumerate(nxt.tolist()):
                if not done[i]:
                    if token == eos_id:
                        done[i] = True
                    else:
                        out[i].append(token)
            if bool(done.all()):
                break
            input_ids = torch.cat([input_ids, nxt[:, None]], dim=-1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
    texts = [str(tokenizer.decode(ids, skip_special_tokens=True)) for ids in out]
    return [text.split("\n")[0] for text in texts]


def measure_preference(
    model_dir: Path, task: str, prompts: int = 48, samples: int = 4, seed: int = 0
) -> float:
    """Fraction of sampled completions (temperature 1) on held-out prompts (at most `prompts`) that the
    task's user accepts."""
    from schemas.events import FeedbackKind

    task_obj = get_task(task)
    prompts = min(prompts, len(task_obj.heldout_questions()))  # a small task (lookup: 9) has fewer
    batch = [p for p in task_obj.heldout_prompts(prompts) for _ in range(samples)]
    completions = sample_completions(model_dir, batch, task_obj.max_tokens, seed=seed)
    accepted = sum(
        any(s.kind == FeedbackKind.accepted for s in task_obj.preference(p, c))
        for p, c in zip(batch, completions, strict=True)
    )
    return accepted / len(batch)


def answers_correct(
    model_dir: Path, task: str, split: str = "train", seed: int = 0, temperature: float = 1.0
) -> list[bool]:
    """Per question of the task's `split` ("train" or "heldout"), in the split's order: whether one
    completion (sampled at `temperature`, 0 = greedy) answers it correctly, an answer appearing as a
    whole word (the gate's retention scorer)."""
    from evals.suites import contains_answer

    task_obj = get_task(task)
    questions = task_obj.train_questions() if split == "train" else task_obj.heldout_questions()
    prompts = [task_obj.format_prompt(q.text) for q in questions]
    completions = sample_completions(
        model_dir, prompts, task_obj.max_tokens, seed=seed, temperature=temperature
    )
    return [
        bool(contains_answer(p, c, {"answers": q.answers}))
        for p, c, q in zip(prompts, completions, questions, strict=True)
    ]


def measure_correct(
    model_dir: Path, task: str, split: str = "train", seed: int = 0, temperature: float = 1.0
) -> float:
    """Fraction of the task's `split` ("train" or "heldout") questions answered correctly by one
    completion each (`answers_correct`)."""
    right = answers_correct(model_dir, task, split, seed=seed, temperature=temperature)
    return sum(right) / len(right)


def info(model_dir: Path) -> dict[str, Any]:
    """What `rtrl model info` prints: shape, parameter count, vocabulary, recipe and digest."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    weights = model_dir / "model.safetensors"
    params = 0
    with safe_open(str(weights), framework="pt") as fh:
        for name in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
            shape = fh.get_slice(name).get_shape()
            count = 1
            for dim in shape:
                count *= dim
            params += count
    recipe_path = model_dir / "rtrl_model.json"
    recipe = json.loads(recipe_path.read_text()) if recipe_path.exists() else {}
    return {
        "dir": str(model_dir),
        "architecture": (config.get("architectures") or ["?"])[0],
        "parameters": params,
        "vocab_size": config.get("vocab_size"),
        "hidden_size": config.get("hidden_size"),
        "layers": config.get("num_hidden_layers"),
        "tie_word_embeddings": config.get("tie_word_embeddings"),
        "model_sha256": sha256_file(weights),
        **{f"recipe_{k}": v for k, v in sorted(recipe.items())},
    }


def replay_examples(task: str, model_dir: Path | None = None, seed: int = 0) -> list[ReplayExample]:
    """Replay examples (``trainer.replay``, schemas/replay.py) of the task's *training* questions
    only, never the held-out ones the gate's retention suite measures: the user's question as a chat
    message and a correct answer. With `model_dir`, the model's own greedy answer to each question
    it answers correctly (what it knows, in its own words; the others are left out); without, the
    supervised completion `build` tuned it on (`Task.sft_completion`, drawn with `seed`)."""
    from evals.suites import contains_answer
    from schemas.replay import ReplayExample

    task_obj = get_task(task)
    questions = task_obj.train_questions()
    if model_dir is None:
        rng = random.Random(seed)
        answers = [task_obj.sft_completion(q, rng) for q in questions]
    else:
        prompts = [task_obj.format_prompt(q.text) for q in questions]
        completions = sample_completions(model_dir, prompts, task_obj.max_tokens, seed=seed, temperature=0)
        answers = [
            c if contains_answer(p, c, {"answers": q.answers}) else ""
            for p, c, q in zip(prompts, completions, questions, strict=True)
        ]
    return [
        ReplayExample.model_validate(
            {"messages": [{"role": "user", "content": q.text}], "completion": answer}
        )
        for q, answer in zip(questions, answers, strict=True)
        if answer.strip()
    ]


def write_replay(path: Path, examples: list[ReplayExample]) -> Path:
    """The examples as a replay file, one JSON object a line, in order; returns `path`."""
    lines = [json.dumps(e.model_dump(mode="json"), sort_keys=True) for e in examples]
    Path(path).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return Path(path)
