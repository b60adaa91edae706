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

The report is `services.modelreport`'s (`Report`, `Problem`); what reads each part of the checkpoint
into it is `services.modelparts`. Their public names are importable from here too.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas.errors import OperatorError
from serving.adapters import is_adapter

from .modelparts import (
    OTHER_WEIGHTS,
    TOKENIZER_FILES,
    check_adapter,
    check_architecture,
    check_context,
    check_sampling,
    check_tokenizer,
    check_vocabulary,
    check_weights,
    read_config,
    safetensors_header,
    vllm_architectures,
)
from .modelreport import TRAINER_DTYPE, Problem, Report, Severity

if TYPE_CHECKING:
    from schemas.settings import Settings

__all__ = [
    "OTHER_WEIGHTS",
    "TOKENIZER_FILES",
    "TRAINER_DTYPE",
    "CheckpointRejected",
    "Problem",
    "Report",
    "Severity",
    "check",
    "require_usable",
    "safetensors_header",
    "vllm_architectures",
]

log = logging.getLogger("services.modelcheck")


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
        check_adapter(directory, report)
        return report
    config = read_config(directory, report)
    if config is not None:
        check_architecture(config, report)
    check_weights(directory, config, report)
    check_tokenizer(directory, report)
    if config is not None:
        check_vocabulary(config, report)
        check_context(config, report)
    check_sampling(directory, sampling_defaults, report)
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
