"""The report of ``rtrl model check`` (`services.modelcheck`): what it found in a checkpoint, each
problem with its one-line fix, and the lines it prints.

`Report` holds one field per fact (None: not known, the file it comes from is missing or broken) and
the `Problem` list: errors are what rtrl would fail on, warnings what works, but not as a user may
expect. `Report.lines` prints one line per known fact, one per problem, then the verdict.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

# The trainer loads every checkpoint in float32 and saves its cycles' checkpoints so (trainer/engine.py).
TRAINER_DTYPE = "float32"

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
    """What `services.modelcheck.check` found. None: not known (the file it comes from is missing or broken)."""

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
    tools_rendered: bool | None = None  # the chat template reads `tools`
    tool_parser: str | None = (
        None  # vLLM's parser for the template's tool-call format (services/toolparsers.py)
    )
    tool_family: str | None = None  # whose format that is
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
        facts = [
            ("checkpoint", str(self.directory)),
            ("adapter", self._adapter_fact()),
            ("architecture", self._architecture_fact()),
            ("weights", self._weights_fact()),
            ("embeddings", self._embeddings_fact()),
            ("vocabulary", self._vocabulary_fact()),
            ("special", self._special_fact()),
            ("chat", self._chat_fact()),
            ("tools", self._tools_fact()),
            ("context", self._context_fact()),
            ("sampling", self._sampling_fact()),
        ]
        out = [f"{name:<14}{text}" for name, text in facts if text is not None]
        out += [p.line() for p in self.problems]
        return out + [f"{'result':<14}{self._verdict()}"]

    # Each fact's line, or None when it is not known (and is not printed).

    def _adapter_fact(self) -> str | None:
        if self.adapter is None:
            return None
        return (
            f"LoRA (PEFT) of rank {self.adapter.get('r')} on "
            f"{self.adapter.get('base_model_name_or_path') or 'an unnamed base model'}"
        )

    def _architecture_fact(self) -> str | None:
        if self.architecture is None:
            return None
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

    def _weights_fact(self) -> str | None:
        if self.dtype is None:
            return None
        others = f" (and {', '.join(self.other_dtypes)})" if self.other_dtypes else ""
        loaded = "" if self.dtype == TRAINER_DTYPE else f"; the trainer loads them as {TRAINER_DTYPE}"
        return (
            f"{self.dtype}{others}, {self.parameters:,} parameters in {self.weight_files} "
            f"safetensors file{'s' if self.weight_files != 1 else ''}{loaded}"
        )

    def _embeddings_fact(self) -> str | None:
        if self.tied_embeddings is None:
            return None
        return (
            "tied: lm_head is the input embedding"
            if self.tied_embeddings
            else "untied: lm_head has weights of its own"
        )

    def _vocabulary_fact(self) -> str | None:
        if self.vocab_size is None and self.tokenizer_size is None:
            return None
        rows = "?" if self.vocab_size is None else f"{self.vocab_size:,}"
        tokens = (
            "no tokenizer"
            if self.tokenizer_size is None
            else f"the tokenizer has {self.tokenizer_size:,} tokens"
        )
        return f"{rows} embedding rows; {tokens}"

    def _special_fact(self) -> str | None:
        if self.tokenizer_size is None:
            return None
        return ", ".join(
            f"{name} {token or 'none'}"
            for name, token in (("eos", self.eos_token), ("pad", self.pad_token), ("bos", self.bos_token))
        )

    def _chat_fact(self) -> str | None:
        if self.chat_template is None:
            return None
        return (
            "template present: /v1/chat/completions is served and captured"
            if self.chat_template
            else "no template: /v1/completions only"
        )

    def _tools_fact(self) -> str | None:
        if self.tools_rendered is None:
            return None
        if not self.tools_rendered:
            return "the chat template does not render `tools`: the model is shown none"
        if self.tool_parser is None:
            return (
                "the chat template renders tools; set vllm.tool_call_parser to vLLM's parser for its "
                "format (docs/methods.md, Tool calls)"
            )
        return (
            f"the chat template renders tools in the format of {self.tool_family}: serve with "
            f"vllm.tool_call_parser={self.tool_parser} (RTRL_VLLM__TOOL_CALL_PARSER)"
        )

    def _context_fact(self) -> str | None:
        if self.max_positions is None:
            return None
        served = (
            ""
            if self.max_model_len is None
            else f"; rtrl's servers use {self.max_model_len} (RTRL_VLLM__MAX_MODEL_LEN)"
        )
        return f"{self.max_positions:,} positions{served}"

    def _sampling_fact(self) -> str | None:
        if self.sampling is None:
            return None
        values = (
            ", ".join(f"{k} {v}" for k, v in self.sampling.items())
            or "none: vLLM's (temperature 1, untruncated)"
        )
        source = f" ({self.sampling_source})" if self.sampling_source else ""
        verdict = (
            "trainable" if self.untrainable is None else f"captured, never trained on ({self.untrainable})"
        )
        return f"{values}{source}: requests under them are {verdict}"

    def _verdict(self) -> str:
        if self.errors:
            refused = "" if self.kind == "missing" else "; rtrl run and rtrl demo refuse it"
            return f"rejected: {len(self.errors)} error{'s' if len(self.errors) != 1 else ''}{refused}"
        warned = (
            f" ({len(self.warnings)} warning{'s' if len(self.warnings) != 1 else ''})"
            if self.warnings
            else ""
        )
        return f"usable: rtrl can serve and train it{warned}"
