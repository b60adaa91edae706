"""The parts of a checkpoint that ``rtrl model check`` (`services.modelcheck.check`) reads, each into
the `Report` (`services.modelreport`), the way rtrl's parts will read them, without loading a weight:

- `check_adapter`: a LoRA adapter's folder, refused (the servers start on a full checkpoint);
- `read_config` and `check_architecture`: config.json, the architecture vLLM picks its implementation
  by (`vllm_architectures`) and the model_type the trainer picks its class by;
- `check_weights`: the safetensors headers (`safetensors_header`): dtype, parameters, tied embeddings,
  the embedding's rows;
- `check_tokenizer`: the tokenizer as transformers' AutoTokenizer loads it, eos / pad / bos and the
  chat template; `check_vocabulary`: its size against the model's rows;
- `check_context`: the model's positions against ``vllm.max_model_len``;
- `check_sampling`: the sampling defaults (generation_config.json or ``vllm.sampling_defaults``) and
  whether requests under them are trainable.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import struct
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from schemas.sampling import (
    MIN_TRAINABLE_TEMPERATURE,
    SamplingConfigError,
    generation_defaults,
    unreproducible,
)
from serving.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS

from .modelreport import Report

# Any one of these is a tokenizer (as trainer/checkpoint.check_source has it); tokenizer_config.json
# alone is not: transformers then builds an almost empty tokenizer of the model_type's class.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".gguf")
_FLOAT_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
# vLLM's tables of generative architectures, in vllm/model_executor/models/registry.py.
_VLLM_TABLES = ("_TEXT_GENERATION_MODELS", "_MULTIMODAL_MODELS", "_TRANSFORMERS_SUPPORTED_MODELS")


def check_adapter(directory: Path, report: Report) -> None:
    report.kind = "adapter"
    try:
        config = json.loads((directory / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError):
        config = {}
    report.adapter = {
        k: config.get(k)
        for k in ("peft_type", "r", "lora_alpha", "target_modules", "base_model_name_or_path")
    }
    base = config.get("base_model_name_or_path") or "the base model"
    report.error(
        "adapter_not_model",
        f"{ADAPTER_CONFIG}: a LoRA adapter ({ADAPTER_WEIGHTS}), not a model; the "
        "servers start on a full checkpoint",
        f"point at the folder of {base}; rtrl trains adapters of its own on it with "
        "RTRL_TRAINER__ADAPTER=lora (docs/lora.md)",
    )


def read_config(directory: Path, report: Report) -> dict[str, Any] | None:
    path = directory / "config.json"
    if not path.is_file():
        report.error(
            "no_config",
            "no config.json: vLLM and the trainer read the model's shape from it",
            "copy the model's config.json into the folder",
        )
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        report.error(
            "bad_config",
            f"config.json cannot be read ({_first_line(exc)})",
            "copy the model's config.json again",
        )
        return None
    if not isinstance(config, dict):
        report.error("bad_config", "config.json is not a JSON object", "copy the model's config.json again")
        return None
    return config


def check_architecture(config: dict[str, Any], report: Report) -> None:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    report.transformers_version = transformers.__version__
    report.model_type = config.get("model_type")
    names = config.get("architectures")
    if not isinstance(names, list) or not names or not isinstance(names[0], str):
        report.error(
            "no_architecture",
            'config.json names no architecture ("architectures"): vLLM cannot pick an implementation',
            'add "architectures": ["<Name>ForCausalLM"], the class the model was saved from, to config.json',
        )
        return
    arch = report.architecture = names[0]
    # The trainer loads by model_type (AutoModelForCausalLM); vLLM by the architecture's name.
    classes = {
        name
        for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
        for name in ((value,) if isinstance(value, str) else value)
    }
    report.transformers_knows = report.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    vllm = vllm_architectures()
    report.vllm_implements = None if vllm is None else arch in vllm
    report.architecture_known = arch in classes or bool(report.vllm_implements)
    if not report.architecture_known:
        report.error(
            "unknown_architecture",
            f"unknown architecture {arch}: neither vLLM nor transformers "
            f"{transformers.__version__} has a causal LM of that name",
            "use a checkpoint of a causal-LM architecture they implement (e.g. Qwen2ForCausalLM, "
            'LlamaForCausalLM), or correct "architectures" in config.json',
        )
    elif report.vllm_implements is False:
        report.warning(
            "vllm_fallback",
            f"vLLM has no implementation of {arch} of its own: it serves it through its "
            "Transformers backend when the model supports that (slower)",
            "if `rtrl services up` cannot start vLLM on it, use a checkpoint of an architecture vLLM "
            "implements",
        )
    if not report.transformers_knows:
        what = "no model_type" if report.model_type is None else f"model_type {report.model_type!r}"
        report.error(
            "untrainable_model_type",
            f"config.json has {what}, for which transformers "
            f"{transformers.__version__} has no causal LM: the trainer cannot load it",
            "use a checkpoint whose model_type transformers knows (e.g. qwen2, llama), or upgrade transformers",
        )


def vllm_architectures() -> frozenset[str] | None:
    """The generative architectures vLLM implements, or None when vLLM is not installed or its
    registry has moved. Read from the registry's source: importing vLLM takes seconds (torch, its
    platform detection) and its registry is dict literals."""
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "model_executor" / "models" / "registry.py"
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    names = {
        key.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Dict)
        and any(isinstance(t, ast.Name) and t.id in _VLLM_TABLES for t in node.targets)
        for key in node.value.keys
        if isinstance(key, ast.Constant) and isinstance(key.value, str)
    }
    return frozenset(names) or None


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (tensor name → dtype, shape, data offsets), checked
    against the file's size: 8 bytes of its length (little-endian), then the JSON. ValueError when
    the file is not one, or is truncated."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError("shorter than a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise ValueError(f"header of {length} bytes in a file of {size}")
        header = json.loads(fh.read(length))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    try:
        end = max(
            (int(t["data_offsets"][1]) for name, t in header.items() if name != "__metadata__"), default=0
        )
    except (KeyError, TypeError, IndexError) as exc:
        raise ValueError(f"malformed tensor entry ({exc!r})") from None
    if 8 + length + end > size:
        raise ValueError(f"truncated: {size} bytes, its header needs {8 + length + end}")
    return header


def check_weights(directory: Path, config: dict[str, Any] | None, report: Report) -> None:
    """The weights' safetensors headers: their dtype and parameters, quantization, and (with a config)
    the tied embeddings and the embedding's rows."""
    files = _weight_files(directory, report)
    if not files:
        return
    counts, shapes = _tensors(files, report)
    if not counts:
        return
    report.weight_files, report.parameters = len(files), sum(counts.values())
    ranked = [_FLOAT_DTYPES.get(d, d) for d, _ in counts.most_common()]
    report.dtype, report.other_dtypes = ranked[0], tuple(ranked[1:])
    quantised = config is not None and config.get("quantization_config")
    if quantised or counts.most_common(1)[0][0] not in _FLOAT_DTYPES:
        method = quantised.get("quant_method", "?") if isinstance(quantised, dict) else report.dtype
        report.error(
            "quantized",
            f"quantized weights ({method}): rtrl trains and hot-swaps full-precision weights",
            "use the model's unquantized checkpoint (bfloat16, float16 or float32)",
        )
    if config is not None:
        _embeddings(config, shapes, report)


def _weight_files(directory: Path, report: Report) -> list[Path]:
    """The safetensors files to read: the shards model.safetensors.index.json names that are there,
    else the folder's *.safetensors (an adapter's aside). [] when there are none, each reason reported."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return _shards(directory, index, report)
    files = sorted(p for p in directory.glob("*.safetensors") if p.name != ADAPTER_WEIGHTS)
    if not files:
        other = sorted(p.name for p in directory.iterdir() if p.suffix in OTHER_WEIGHTS)
        if other:
            report.error(
                "no_safetensors",
                f"weights only as {other[0]}: rtrl's servers and trainer load safetensors",
                "convert them: load the model with transformers and save_pretrained() it (safetensors)",
            )
        else:
            report.error(
                "no_weights",
                "no weights (*.safetensors)",
                "copy the model's *.safetensors (and model.safetensors.index.json) into the folder",
            )
    return files


def _shards(directory: Path, index: Path, report: Report) -> list[Path]:
    """The shards `index` names that are in `directory`; an unreadable index or missing shards reported."""
    try:
        shards = sorted({str(f) for f in json.loads(index.read_text())["weight_map"].values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        report.error(
            "bad_weights",
            f"model.safetensors.index.json cannot be read ({_first_line(exc)})",
            "copy the checkpoint's index and shards again",
        )
        return []
    missing = [s for s in shards if not (directory / s).is_file()]
    if missing:
        report.error(
            "missing_weights",
            f"{len(missing)} of {len(shards)} shards named in "
            f"model.safetensors.index.json are missing ({', '.join(missing[:3])})",
            "copy every shard of the checkpoint into the folder",
        )
    return [directory / s for s in shards if s not in missing]


def _tensors(files: list[Path], report: Report) -> tuple[Counter[str], dict[str, list[int]]]:
    """The parameters per dtype and each tensor's shape, from the headers of `files`; a file that is
    not a readable safetensors file is reported and skipped."""
    counts: Counter[str] = Counter()
    shapes: dict[str, list[int]] = {}
    for path in files:
        try:
            header = safetensors_header(path)
        except (OSError, ValueError) as exc:
            report.error(
                "bad_weights",
                f"{path.name} is not a readable safetensors file ({_first_line(exc)})",
                "copy it again (an interrupted download or copy?)",
            )
            continue
        for name, tensor in header.items():
            if name != "__metadata__":
                shapes[name] = [int(d) for d in tensor["shape"]]
                counts[str(tensor["dtype"])] += math.prod(shapes[name])
    return counts, shapes


def _embeddings(config: dict[str, Any], shapes: Mapping[str, list[int]], report: Report) -> None:
    """Tied or not, a missing lm_head config.json says is untied, and the embedding's rows against
    config.json's vocab_size."""
    has_head = any(n.endswith("lm_head.weight") for n in shapes)
    tie = config.get("tie_word_embeddings")
    report.tied_embeddings = bool(tie) if tie is not None else not has_head
    embedding = next((shape for n, shape in shapes.items() if n.endswith("embed_tokens.weight")), None)
    if tie is False and not has_head and embedding is not None:
        report.error(
            "no_lm_head",
            "config.json says tie_word_embeddings false, but the weights have no lm_head: the "
            "output layer would be random",
            "set tie_word_embeddings true in config.json if the model was trained tied; else copy the "
            "checkpoint again",
        )
    rows = _vocab_size(config)
    if embedding is not None and rows is not None and embedding[0] != rows:
        report.error(
            "embedding_rows",
            f"the input embedding has {embedding[0]:,} rows, config.json's vocab_size says {rows:,}",
            "use the config.json that came with these weights",
        )


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers logs its fallbacks while it loads a tokenizer; the report says what matters."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def check_tokenizer(directory: Path, report: Report) -> None:
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        report.error(
            "no_tokenizer",
            f"no tokenizer ({', '.join(TOKENIZER_FILES[:-1])} or {TOKENIZER_FILES[-1]})",
            "copy the model's tokenizer files (tokenizer.json, tokenizer_config.json) into the folder",
        )
        _chat_template(report, present=_template_file(directory))
        return
    from transformers import AutoTokenizer

    with _quiet_transformers():
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(directory))
        except Exception as exc:  # noqa: BLE001 - whatever stops it loading is the finding
            report.error(
                "bad_tokenizer",
                f"the tokenizer does not load ({type(exc).__name__}: {_first_line(exc)})",
                "copy the tokenizer files that came with the weights (tokenizer.json, tokenizer_config.json)",
            )
            _chat_template(report, present=_template_file(directory))
            return
    report.tokenizer_size = len(tokenizer)
    report.eos_token, report.pad_token, report.bos_token = (
        None if t is None else str(t) for t in (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token)
    )
    if report.eos_token is None:
        report.warning(
            "no_eos",
            "the tokenizer has no eos token: completions end only at max_tokens or a stop string",
            "set eos_token (the token the model ends its answers with) in tokenizer_config.json",
        )
    if not _chat_template(report, present=bool(tokenizer.chat_template)):
        return
    _tools(report, tokenizer.chat_template)
    try:
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True
        )
    except Exception as exc:  # noqa: BLE001 - a template that does not render is the finding
        report.warning(
            "bad_chat_template",
            f"the chat template does not render a one-message conversation "
            f"({_first_line(exc)}): chat requests fail",
            'correct "chat_template" in tokenizer_config.json',
        )


def _tools(report: Report, chat_template: object) -> None:
    """Whether the template renders tools, and which of vLLM's parsers reads its tool calls."""
    from .toolparsers import renders_tools, suggest_tool_parser

    # A dict: several named templates (e.g. "default" and "tool_use"); the tools are in one of them.
    named = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
    template = "\n".join(t for t in named if isinstance(t, str)) or None
    report.tools_rendered = renders_tools(template)
    suggestion = suggest_tool_parser(template) if report.tools_rendered else None
    if suggestion is not None:
        report.tool_parser, report.tool_family = suggestion


def _template_file(directory: Path) -> bool:
    """Whether the folder has a chat template (where transformers looks), for a tokenizer that does not load."""
    if (directory / "chat_template.jinja").is_file() or (directory / "chat_template.json").is_file():
        return True
    path = directory / "tokenizer_config.json"
    try:
        return path.is_file() and bool(_reads(path).get("chat_template"))
    except (OSError, ValueError):
        return False


def _chat_template(report: Report, present: bool) -> bool:
    report.chat_template = present
    if not present:
        report.warning(
            "no_chat_template",
            "no chat template: vLLM refuses /v1/chat/completions, so only "
            "/v1/completions traffic is served, captured and trained on",
            'add "chat_template" (the model\'s Jinja template) to tokenizer_config.json',
        )
    return present


def _vocab_size(config: dict[str, Any]) -> int | None:
    value = config.get("vocab_size")
    if value is None and isinstance(config.get("text_config"), dict):
        value = config["text_config"].get("vocab_size")  # multimodal configs nest the language model's
    return int(value) if isinstance(value, int) else None


def check_vocabulary(config: dict[str, Any], report: Report) -> None:
    report.vocab_size = rows = _vocab_size(config)
    if rows is None:
        report.error(
            "no_vocab_size",
            "config.json has no vocab_size",
            'add "vocab_size" (the rows of the input embedding) to config.json',
        )
    elif report.tokenizer_size is not None and report.tokenizer_size > rows:
        report.error(
            "tokenizer_too_big",
            f"the tokenizer has {report.tokenizer_size:,} tokens, the model "
            f"{rows:,} embedding rows: ids from {rows:,} up index past the embedding",
            "use the tokenizer that came with these weights, or resize the embeddings to the tokenizer "
            "(resize_token_embeddings) and save again",
        )


def check_context(config: dict[str, Any], report: Report) -> None:
    positions = config.get("max_position_embeddings")
    if not isinstance(positions, int):
        return
    report.max_positions = positions
    served = report.max_model_len
    if served is not None and positions < served and not config.get("rope_scaling"):
        report.error(
            "context_too_long",
            f"the model has {positions:,} positions, rtrl's servers start with "
            f"--max-model-len {served:,}: vLLM refuses to start",
            f"set RTRL_VLLM__MAX_MODEL_LEN={positions} (or less)",
        )


def check_sampling(directory: Path, override: Mapping[str, Any] | None, report: Report) -> None:
    path = directory / "generation_config.json"
    if override is not None:
        report.sampling, report.sampling_source = dict(override), "RTRL_VLLM__SAMPLING_DEFAULTS"
    elif not path.is_file():
        report.sampling = {}
        report.warning(
            "no_generation_config",
            "no generation_config.json: requests that set no sampling parameters "
            "sample at vLLM's defaults (temperature 1, no top-p or top-k)",
            "add the model's generation_config.json (its recommended temperature, top_p, top_k), or set "
            "RTRL_VLLM__SAMPLING_DEFAULTS",
        )
    else:
        try:
            report.sampling, report.sampling_source = generation_defaults(directory), "generation_config.json"
        except SamplingConfigError as exc:
            report.error(
                "bad_generation_config", _first_line(exc), "correct generation_config.json or remove it"
            )
            return
    report.untrainable = unreproducible(report.sampling)
    temperature = report.sampling.get("temperature", 1.0)
    if report.untrainable is not None:
        kind = "greedy" if report.untrainable == "greedy" else "near-greedy"
        report.warning(
            "untrainable_defaults",
            f"the sampling defaults are {kind} (temperature {temperature} < "
            f"{MIN_TRAINABLE_TEMPERATURE}): requests that set no temperature are "
            "served and captured, never trained on",
            f"set a temperature of at least {MIN_TRAINABLE_TEMPERATURE} in {report.sampling_source}, or "
            "have clients send one",
        )
    elif override is None and path.is_file() and _reads(path).get("do_sample") is False:
        # transformers' generate() decodes greedily under do_sample false; vLLM and the gateway ignore it.
        report.warning(
            "do_sample_ignored",
            f"generation_config.json says do_sample false (greedy in transformers), "
            f"but vLLM and rtrl's gateway ignore it: requests that set no temperature "
            f"sample at temperature {temperature}",
            "set the temperature you mean in generation_config.json (0 is greedy, never trained on)",
        )


def _reads(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]
