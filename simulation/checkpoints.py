"""Random checkpoints in the shape of real ones, made locally: for tests, benches and the GPU check.

Real users bring a pretrained Hugging Face checkpoint, not the tiny Llama of `services/tinymodel.py`:
another architecture, bf16 safetensors, tied embeddings, attention biases, GQA, a tokenizer with
added special tokens and a chat template, and sampling defaults in ``generation_config.json``.
Nothing can be downloaded from a model hub here, so `build` writes such a checkpoint with random
weights from a local recipe; every file is the format a hub checkpoint uses, and rtrl loads it
through exactly the code that would load a real one (vLLM, transformers, the trainer).

Started by ``rtrl model random DIR --arch qwen2|llama [--size tiny|0.5b]`` (`rtrl/commands/model.py`).
Two families (`ARCHS`):

- ``qwen2``: Qwen2ForCausalLM, attention biases, tied embeddings, bf16 weights, a byte-level BPE
  tokenizer (GPT-2/Qwen pre-tokenizer, no BOS) with ChatML special tokens (``<|im_start|>``,
  ``<|im_end|>``, ``<|endoftext|>``) and the ChatML template; sampling defaults temperature 0.7,
  top-p 0.8, top-k 20 (Qwen2.5's own generation_config.json).
- ``llama``: LlamaForCausalLM, untied, fp32, a SentencePiece-style BPE (``▁`` word boundaries,
  byte fallback, BOS ``<s>``), the ``[INST]`` template of Llama-2/Mistral; sampling defaults
  temperature 0.6, top-p 0.9.

The model's vocabulary is the tokenizer's rounded up to a multiple of 64 (real checkpoints pad it:
Qwen2.5 has 151,665 tokens and 151,936 rows), or ``vocab_size`` when given (the GPU check uses
Qwen's 151,936). head_dim is 64 in every size: vLLM's CPU attention rejects smaller heads
(docs/platform.md, vLLM on CPU).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.tinymodel import corpus_lines

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

INST_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}[INST] {{ message['content'] | trim }} [/INST]"
    "{% elif message['role'] == 'assistant' %} {{ message['content'] | trim }}{{ eos_token }}"
    "{% elif message['role'] == 'system' %}<<SYS>>\n{{ message['content'] | trim }}\n<</SYS>>\n\n"
    "{% endif %}"
    "{% endfor %}"
)


@dataclass(frozen=True)
class Size:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int


# tiny: loads in vLLM on CPU in seconds. 0.5b: Qwen2.5-0.5B's shape (with vocab_size 151,936).
SIZES: dict[str, Size] = {
    "tiny": Size(128, 2, 2, 1, 256, 1024),
    "0.5b": Size(896, 24, 14, 2, 4864, 4096),
}

ARCHS = ("qwen2", "llama")


def _qwen_tokenizer(vocab: int) -> tuple[Any, dict[str, Any]]:
    """Byte-level BPE with Qwen's pre-tokenizer split and ChatML added tokens (no BOS)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = Tokenizer(models.BPE())
    split = Regex(
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(split, behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - len(specials),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus_lines(), trainer)
    tokenizer.add_special_tokens(specials)  # after the vocabulary, as Qwen's added tokens are
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
    }
    return tokenizer, config


def _sentencepiece_tokenizer(vocab: int) -> tuple[Any, dict[str, Any]]:
    """SentencePiece-style BPE (Llama-2/Mistral): ``▁`` for spaces, byte fallback, BOS prepended."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - 256, min_frequency=2, show_progress=False, special_tokens=specials
    )
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    base.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    base.train_from_iterator(corpus_lines(), trainer)
    # Byte fallback needs <0xNN> in the model's vocabulary (not as added tokens): ids 3..258, as in Llama-2.
    data = json.loads(base.to_str())
    learnt = sorted(((i, t) for t, i in data["model"]["vocab"].items() if t not in specials))
    vocab_map = {t: i for i, t in enumerate(specials)}
    for token in byte_tokens + [t for _, t in learnt]:
        vocab_map.setdefault(token, len(vocab_map))
    data["model"].update(vocab=vocab_map, byte_fallback=True, fuse_unk=True)
    data["pre_tokenizer"] = None
    for added in data["added_tokens"]:
        added["id"] = vocab_map[added["content"]]
    tokenizer = Tokenizer.from_str(json.dumps(data))
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab_map["<s>"])]
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": None,
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "legacy": False,
        "chat_template": INST_TEMPLATE,
    }
    return tokenizer, config


@dataclass(frozen=True)
class _Family:
    """A family's model config and class, and what its generation_config.json holds."""

    config: Any  # Qwen2Config or LlamaConfig
    model_cls: Any
    dtype: str
    sampling: dict[str, Any]  # the sampling defaults
    generation: dict[str, Any]  # eos / bos / pad token ids


def build(
    out_dir: Path,
    arch: str = "qwen2",
    size: str = "tiny",
    *,
    dtype: str | None = None,
    tie_word_embeddings: bool | None = None,
    vocab_size: int | None = None,
    tokenizer_vocab: int = 512,
    generation_config: dict[str, Any] | None = None,
    seed: int = 0,
) -> Path:
    """Write a random checkpoint of `arch` and `size` into `out_dir` (see the module docstring).

    `dtype`, `tie_word_embeddings` and `generation_config` (the sampling defaults; {} writes none)
    override the family's own; returns `out_dir`."""
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; known: {', '.join(SIZES)}")
    shape = SIZES[size]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer, tok_config = (_qwen_tokenizer if arch == "qwen2" else _sentencepiece_tokenizer)(
        tokenizer_vocab
    )
    tokens = tokenizer.get_vocab_size()
    rows = vocab_size if vocab_size is not None else -(-tokens // 64) * 64
    if rows < tokens:
        raise ValueError(f"vocab_size {rows} < the tokenizer's {tokens} tokens")
    ids = {name: tokenizer.token_to_id(name) for name in ("<|endoftext|>", "<|im_end|>", "<s>", "</s>")}
    family = (_qwen2 if arch == "qwen2" else _llama)(_common(shape, rows), ids, dtype, tie_word_embeddings)
    _save_model(family, out_dir, seed, generation_config)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tok_config["model_max_length"] = shape.max_position_embeddings
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n")
    return out_dir


def _common(shape: Size, rows: int) -> dict[str, Any]:
    """The config fields both families share: the size's shape and `rows` embedding rows."""
    return dict(
        vocab_size=rows,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=shape.max_position_embeddings,
        hidden_act="silu",
    )


def _qwen2(common: dict[str, Any], ids: dict[str, int], dtype: str | None, tie: bool | None) -> _Family:
    """Qwen2.5's: bf16, tied, rope theta 1e6, ChatML's eos; temperature 0.7, top-p 0.8, top-k 20."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    dtype = dtype or "bfloat16"
    config = Qwen2Config(
        **common,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        use_sliding_window=False,
        tie_word_embeddings=True if tie is None else tie,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        dtype=dtype,
        architectures=["Qwen2ForCausalLM"],
    )
    generation = {
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "bos_token_id": ids["<|endoftext|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    sampling = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    return _Family(config, Qwen2ForCausalLM, dtype, sampling, generation)


def _llama(common: dict[str, Any], ids: dict[str, int], dtype: str | None, tie: bool | None) -> _Family:
    """Llama-2's: fp32, untied, rope theta 1e4, <s> and </s>; temperature 0.6, top-p 0.9."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dtype = dtype or "float32"
    config = LlamaConfig(
        **common,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        tie_word_embeddings=False if tie is None else tie,
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
        dtype=dtype,
        architectures=["LlamaForCausalLM"],
    )
    generation = {"eos_token_id": [ids["</s>"]], "bos_token_id": ids["<s>"]}
    sampling = {"temperature": 0.6, "top_p": 0.9}
    return _Family(config, LlamaForCausalLM, dtype, sampling, generation)


def _save_model(family: _Family, out_dir: Path, seed: int, sampling: dict[str, Any] | None) -> None:
    """The model's random weights (seeded) as safetensors, its config.json and generation_config.json
    (`sampling`, or the family's defaults when None)."""
    import torch
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    model = family.model_cls(family.config).to(getattr(torch, family.dtype)).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    for weights in out_dir.glob("*.safetensors"):
        weights.chmod(0o644)  # safetensors writes 0600; servers may run as another user
    sampling = family.sampling if sampling is None else sampling
    GenerationConfig(do_sample=bool(sampling), **family.generation, **sampling).save_pretrained(out_dir)
