"""What rtrl will do with a checkpoint, and every problem that would stop it: ``rtrl model check DIR``.

Users bring their own Hugging Face checkpoint (``RTRL_VLLM__MODEL_DIR``, ``rtrl demo --model-dir``).
`check` reads it the way rtrl's parts will, without loading a weight:

- config.json: vLLM picks its implementation by ``architectures``, the trainer its class by
  ``model_type`` (transformers' AutoModelForCausalLM);
- the safetensors headers: dtype, tensor names and shapes (parameters, tied embeddings, rows);
- the tokenizer, with transformers' AutoTokenizer as vLLM and the trainer load it: its size against
  the model's vocabulary, eos / pad / bos, the chat template;
- generation_config.json: the sampling defaults the gateway writes into requests that set none
  (schemas/sampling.py), and whether requests under them are trainable.

It returns a `Report`: one fact a line, and each problem with its one-line fix. Errors are what rtrl
would fail on (no config, an architecture nothing implements, no tokenizer, no weights, token ids
past the embedding, a context longer than the model's); warnings are what works, but not as a user
may expect (no chat template: completions only; greedy defaults: nothing trained; no
generation_config.json: vLLM's temperature 1).

`rtrl run`, `rtrl demo` and `rtrl services up` call `require_usable` before they use
``vllm.model_dir``: a checkpoint with errors is refused in one line naming the first and
``rtrl model check DIR``. A missing or empty folder is not checked: that is where the tiny model is
built (`services.vllm.ensure_model`).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
import math
import struct
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from schemas.errors import OperatorError
from schemas.sampling import (
    MIN_TRAINABLE_TEMPERATURE,
    SamplingConfigError,
    generation_defaults,
    unreproducible,
)
from serving.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, is_adapter

if TYPE_CHECKING:
    from schemas.settings import Settings

log = logging.getLogger("services.modelcheck")

# Any one of these is a tokenizer (as trainer/checkpoint.check_source has it); tokenizer_config.json
# alone is not: transformers then builds an almost empty tokenizer of the model_type's class.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".gguf")
# The trainer loads every checkpoint in float32 and saves its cycles' checkpoints so (trainer/engine.py).
TRAINER_DTYPE = "float32"
_FLOAT_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
# vLLM's tables of generative architectures, in vllm/model_executor/models/registry.py.
_VLLM_TABLES = ("_TEXT_GENERATION_MODELS", "_MULTIMODAL_MODELS", "_TRANSFORMERS_SUPPORTED_MODELS")

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Problem:
    severity: Severity
    code: str  # a stable short name: no_tokenizer, unknown_architecture, no_chat_template, ...
    message: str
    fix: str

    def line(self) -> str:
        return f"{self.severity:<14}{self.message}; fix: {self.fix}"


@dataclass
class Report:
    """What `check` found. None: not known (the file it comes from is missing or broken)."""

    directory: Path
    kind: Literal["model", "adapter", "missing"] = "model"
    architecture: str | None = None
    model_type: str | None = None
    transformers_version: str | None = None
    architecture_known: bool | None = None  # vLLM or transformers has a class of that name
    transformers_knows: bool | None = None  # AutoModelForCausalLM has a class for model_type
    vllm_implements: bool | None = None  # None: vLLM's registry could not be read here
    dtype: str | None = None  # the weights' (most parameters'), e.g. bfloat16
    other_dtypes: tuple[str, ...] = ()
    parameters: int | None = None
    weight_files: int = 0
    tied_embeddings: bool | None = None
    vocab_size: int | None = None  # config.json: the embedding's rows
    tokenizer_size: int | None = None  # len(tokenizer), added tokens included
    eos_token: str | None = None
    pad_token: str | None = None
    bos_token: str | None = None
    chat_template: bool | None = None
    max_positions: int | None = None
    max_model_len: int | None = None  # what rtrl's servers start with (vllm.max_model_len)
    sampling: dict[str, Any] | None = None  # written into requests that set none ({}: vLLM's defaults)
    sampling_source: str | None = None
    untrainable: str | None = None  # greedy / near_greedy: requests under the defaults are not trained on
    adapter: dict[str, Any] | None = None
    problems: list[Problem] = field(default_factory=list)

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "warning"]

    @property
    def ok(self) -> bool:
        """rtrl can serve and train it (warnings aside)."""
        return not self.errors

    def error(self, code: str, message: str, fix: str) -> None:
        self.problems.append(Problem("error", code, message, fix))

    def warning(self, code: str, message: str, fix: str) -> None:
        self.problems.append(Problem("warning", code, message, fix))

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["directory"] = str(self.directory)
        data["ok"] = self.ok
        return data

    def lines(self) -> list[str]:
        """One line per fact, then one per problem, then the verdict (what ``rtrl model check`` prints)."""
        facts = [("checkpoint", str(self.directory))]
        if self.adapter is not None:
            facts.append(
                (
                    "adapter",
                    f"LoRA (PEFT) of rank {self.adapter.get('r')} on "
                    f"{self.adapter.get('base_model_name_or_path') or 'an unnamed base model'}",
                )
            )
        if self.architecture is not None:
            facts.append(("architecture", self._architecture()))
        if self.dtype is not None:
            others = f" (and {', '.join(self.other_dtypes)})" if self.other_dtypes else ""
            loaded = "" if self.dtype == TRAINER_DTYPE else f"; the trainer loads them as {TRAINER_DTYPE}"
            facts.append(
                (
                    "weights",
                    f"{self.dtype}{others}, {self.parameters:,} parameters in {self.weight_files} "
                    f"safetensors file{'s' if self.weight_files != 1 else ''}{loaded}",
                )
            )
        if self.tied_embeddings is not None:
            facts.append(
                (
                    "embeddings",
                    "tied: lm_head is the input embedding"
                    if self.tied_embeddings
                    else "untied: lm_head has weights of its own",
                )
            )
        if self.vocab_size is not None or self.tokenizer_size is not None:
            rows = "?" if self.vocab_size is None else f"{self.vocab_size:,}"
            tokens = (
                "no tokenizer"
                if self.tokenizer_size is None
                else f"the tokenizer has {self.tokenizer_size:,} tokens"
            )
            facts.append(("vocabulary", f"{rows} embedding rows; {tokens}"))
        if self.tokenizer_size is not None:
            facts.append(
                (
                    "special",
                    ", ".join(
                        f"{name} {token or 'none'}"
                        for name, token in (
                            ("eos", self.eos_token),
                            ("pad", self.pad_token),
                            ("bos", self.bos_token),
                        )
                    ),
                )
            )
        if self.chat_template is not None:
            facts.append(
                (
                    "chat",
                    "template present: /v1/chat/completions is served and captured"
                    if self.chat_template
                    else "no template: /v1/completions only",
                )
            )
        if self.max_positions is not None:
            served = (
                ""
                if self.max_model_len is None
                else f"; rtrl's servers use {self.max_model_len} (RTRL_VLLM__MAX_MODEL_LEN)"
            )
            facts.append(("context", f"{self.max_positions:,} positions{served}"))
        if self.sampling is not None:
            facts.append(("sampling", self._sampling()))
        out = [f"{name:<14}{text}" for name, text in facts]
        out += [p.line() for p in self.problems]
        if self.errors:
            refused = "" if self.kind == "missing" else "; rtrl run and rtrl demo refuse it"
            verdict = f"rejected: {len(self.errors)} error{'s' if len(self.errors) != 1 else ''}{refused}"
        else:
            warned = (
                f" ({len(self.warnings)} warning{'s' if len(self.warnings) != 1 else ''})"
                if self.warnings
                else ""
            )
            verdict = f"usable: rtrl can serve and train it{warned}"
        return out + [f"{'result':<14}{verdict}"]

    def _architecture(self) -> str:
        if not self.architecture_known:
            return f"{self.architecture} (model_type {self.model_type}): neither vLLM nor transformers has it"
        vllm = {
            True: "vLLM implements it",
            False: "vLLM has no implementation of its own",
            None: "vLLM checks it when the server loads it",
        }[self.vllm_implements]
        trainer = (
            f"transformers {self.transformers_version} trains it"
            if self.transformers_knows
            else f"transformers {self.transformers_version} cannot train it"
        )
        return f"{self.architecture} (model_type {self.model_type}): {vllm}, {trainer}"

    def _sampling(self) -> str:
        assert self.sampling is not None
        values = (
            ", ".join(f"{k} {v}" for k, v in self.sampling.items())
            or "none: vLLM's (temperature 1, untruncated)"
        )
        source = f" ({self.sampling_source})" if self.sampling_source else ""
        verdict = (
            "trainable" if self.untrainable is None else f"captured, never trained on ({self.untrainable})"
        )
        return f"{values}{source}: requests under them are {verdict}"


class CheckpointRejected(OperatorError, ValueError):
    """A checkpoint rtrl would fail on (`check` found errors); the message names the first."""


def check(
    directory: Path, *, sampling_defaults: Mapping[str, Any] | None = None, max_model_len: int | None = None
) -> Report:
    """Read the checkpoint in `directory` (see the module docstring). `sampling_defaults`
    (``vllm.sampling_defaults``) replaces its generation_config.json, as it does in the gateway;
    `max_model_len` (``vllm.max_model_len``) is checked against the model's positions."""
    directory = Path(directory)
    report = Report(directory=directory, max_model_len=max_model_len)
    if not directory.is_dir() or not any(directory.iterdir()):
        report.kind = "missing"
        what = (
            "is empty"
            if directory.is_dir()
            else "is not a folder"
            if directory.exists()
            else "does not exist"
        )
        report.error(
            "no_checkpoint",
            f"{directory} {what}",
            "give the folder of a Hugging Face checkpoint (config.json, *.safetensors, tokenizer files); "
            "`rtrl services up` and `rtrl demo` build the tiny model in a missing or empty one",
        )
        return report
    if is_adapter(directory):
        _adapter(directory, report)
        return report
    config = _config(directory, report)
    if config is not None:
        _architecture(config, report)
    _weights(directory, config, report)
    _tokenizer(directory, report)
    if config is not None:
        _vocabulary(config, report)
        _context(config, report)
    _sampling(directory, sampling_defaults, report)
    return report


def require_usable(settings: Settings) -> Report | None:
    """Raise CheckpointRejected, in one line, when the checkpoint in ``vllm.model_dir`` has errors;
    else log its warnings and return the report. A missing or empty folder is not checked (the tiny
    model is built there): None."""
    directory = settings.vllm.model_dir.expanduser().resolve()
    if not directory.is_dir() or not any(directory.iterdir()):
        return None
    report = check(
        directory,
        sampling_defaults=settings.vllm.sampling_defaults,
        max_model_len=settings.vllm.max_model_len,
    )
    if report.errors:
        first, more = report.errors[0], len(report.errors) - 1
        also = f" (and {more} more)" if more else ""
        raise CheckpointRejected(
            f"checkpoint {directory} rejected: {first.message}{also}; "
            f"`rtrl model check {directory}` lists every problem with its fix"
        )
    for problem in report.warnings:
        log.warning("model %s: %s; fix: %s", directory, problem.message, problem.fix)
    return report


# ---- the parts ----------------------------------------------------------------------------------


def _adapter(directory: Path, report: Report) -> None:
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


def _config(directory: Path, report: Report) -> dict[str, Any] | None:
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


def _architecture(config: dict[str, Any], report: Report) -> None:
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


def _weights(directory: Path, config: dict[str, Any] | None, report: Report) -> None:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted({str(f) for f in json.loads(index.read_text())["weight_map"].values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            report.error(
                "bad_weights",
                f"model.safetensors.index.json cannot be read ({_first_line(exc)})",
                "copy the checkpoint's index and shards again",
            )
            return
        missing = [s for s in shards if not (directory / s).is_file()]
        if missing:
            report.error(
                "missing_weights",
                f"{len(missing)} of {len(shards)} shards named in "
                f"model.safetensors.index.json are missing ({', '.join(missing[:3])})",
                "copy every shard of the checkpoint into the folder",
            )
        files = [directory / s for s in shards if s not in missing]
    else:
        files = sorted(p for p in directory.glob("*.safetensors") if p.name != ADAPTER_WEIGHTS)
    if not files:
        if not index.is_file():
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
        return
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
    if config is None:
        return
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


def _tokenizer(directory: Path, report: Report) -> None:
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


def _vocabulary(config: dict[str, Any], report: Report) -> None:
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


def _context(config: dict[str, Any], report: Report) -> None:
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


def _sampling(directory: Path, override: Mapping[str, Any] | None, report: Report) -> None:
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
