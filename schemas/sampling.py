"""How a completion was sampled, and whether the trainer can reproduce its behaviour logprobs.

The contract between the gateway (which records it) and the trainer (which recomputes it):

* vLLM serves with ``--logprobs-mode processed_logprobs``: the logprob it reports for a sampled
  token is log-softmax of the logits *after* temperature, min-p, top-k and top-p, i.e. the
  probability the token was really drawn with (docs/platform.md, "Behaviour logprobs"). With the
  default raw mode it is the untempered, untruncated softmax, which is not the behaviour policy
  of a request sampled at T = 0.7 or with top-p.
* The trainer recomputes π_old and π_θ with the same transformation (`trainer.engine`),
  penalties included (repetition on prompt and output tokens, presence and frequency on output
  tokens so far, before the temperature, as vLLM applies them), so the three logprobs of a token
  are comparable.
* rtrl's servers run with ``--generation-config vllm`` (vLLM's neutral defaults), and the gateway
  writes every sampling parameter a client left out into the request it forwards, from the
  model's own ``generation_config.json`` (`generation_defaults`) — so the parameters recorded in
  the event are exactly those vLLM sampled with, not guesses at the server's defaults.
* What the trainer cannot reproduce (logit bias, token restrictions, guided decoding,
  ``min_tokens``, custom logits processors, beam search) changes the distribution in ways a
  forward pass does not see: such a completion is captured but not trainable, and
  `unreproducible` names the reason (counted by the gateway).

Greedy and near-greedy requests are captured but never trained on (reason ``greedy``, or
``near_greedy`` below `MIN_TRAINABLE_TEMPERATURE`): a greedy token is the argmax, not a sample of
the softmax vLLM reports for it (temperature 1, untruncated), so neither a policy gradient nor an
importance weight may treat it as one — its behaviour probability is 1, and a ratio against the
reported logprob is meaningless. Near-greedy sampling is a sample, but of a distribution so sharp
that the score function is scaled by 1/T and a tiny weight change moves a token's probability by
orders of magnitude: the importance ratios of such tokens are noise (docs/algorithms.md, Greedy and
near-greedy requests).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

from schemas.events import SamplingParams
from schemas.settings import Settings
from schemas.settings.vllm import GENERATION_CONFIG_KEYS

GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it is greedy
# Below this temperature a sampled request is not trained on (`untrainable_sampling`): at T = 0.1
# the score function is already scaled by 10 (docs/algorithms.md, Greedy and near-greedy requests).
MIN_TRAINABLE_TEMPERATURE = 0.1

_GUIDED = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


class SamplingConfigError(ValueError):
    """A model's generation_config.json cannot be read."""


def generation_defaults(model_dir: Path) -> dict[str, Any]:
    """The sampling defaults a model ships in ``generation_config.json`` ({} when it has none),
    the ones vLLM would apply with ``--generation-config auto``."""
    path = model_dir / "generation_config.json"
    if not path.exists():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SamplingConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise SamplingConfigError(f"{path} is not a JSON object")
    return {key: config[key] for key in GENERATION_CONFIG_KEYS if config.get(key) is not None}


def served_defaults(settings: Settings) -> dict[str, Any]:
    """The sampling defaults of the served model: ``settings.vllm.sampling_defaults`` when set,
    else its generation_config.json in ``settings.vllm.model_dir`` (may be {})."""
    if settings.vllm.sampling_defaults is not None:
        return dict(settings.vllm.sampling_defaults)
    return generation_defaults(settings.vllm.model_dir.expanduser())


def apply_defaults(body: MutableMapping[str, Any], defaults: Mapping[str, Any]) -> None:
    """Write each default the client left out (absent or null) into the request body."""
    for key, value in defaults.items():
        if body.get(key) is None:
            body[key] = value


def unreproducible(body: Mapping[str, Any]) -> str | None:
    """Why the trainer could not recompute this request's behaviour logprobs, or None if it can.

    The reason is a short stable name (a metric label): logit_bias, token_restriction,
    guided_decoding, min_tokens, logits_processors, beam_search, greedy, near_greedy (the module
    docstring). A request without a temperature samples at vLLM's default, 1.
    """
    if body.get("logit_bias"):
        return "logit_bias"
    if body.get("allowed_token_ids") or body.get("bad_words"):
        return "token_restriction"
    if any(body.get(key) is not None for key in _GUIDED):
        return "guided_decoding"
    response_format = body.get("response_format")
    if isinstance(response_format, Mapping) and response_format.get("type") not in (None, "text"):
        return "guided_decoding"
    tool_choice = body.get("tool_choice")
    if body.get("tools") and (tool_choice == "required" or isinstance(tool_choice, Mapping)):
        return "guided_decoding"  # vLLM forces a tool call with a grammar
    if body.get("min_tokens"):
        return "min_tokens"
    if body.get("logits_processors"):
        return "logits_processors"
    if body.get("use_beam_search"):
        return "beam_search"
    temperature = body.get("temperature")
    if isinstance(temperature, int | float) and not isinstance(temperature, bool):
        return _temperature_reason(float(temperature))
    return None


def _temperature_reason(temperature: float) -> str | None:
    if temperature < GREEDY_EPS:
        return "greedy"
    if temperature < MIN_TRAINABLE_TEMPERATURE:
        return "near_greedy"
    return None


def is_greedy(sampling: SamplingParams) -> bool:
    return sampling.temperature < GREEDY_EPS


def neutral(sampling: SamplingParams) -> bool:
    """Raw and processed logprobs coincide: no penalty, and greedy or temperature 1 with nothing
    truncated."""
    if not (
        sampling.repetition_penalty == 1.0
        and sampling.presence_penalty == 0.0
        and sampling.frequency_penalty == 0.0
    ):
        return False  # raw logprobs are taken before the penalties
    if is_greedy(sampling):
        return True
    return (
        math.isclose(sampling.temperature, 1.0)
        and sampling.top_p >= 1.0
        and sampling.top_k in (-1, 0)
        and sampling.min_p <= 0.0
    )


def untrainable_sampling(sampling: SamplingParams) -> str | None:
    """Why a captured segment's sampling rules out training on it (and weighting it in an
    off-policy estimate), or None: ``greedy`` / ``near_greedy`` (the module docstring), or
    ``raw_logprobs`` — raw behaviour logprobs (events captured before processed mode, or a fleet
    started without it) of sampling where raw and processed differ."""
    reason = _temperature_reason(sampling.temperature)
    if reason is not None:
        return reason
    if sampling.logprobs_mode != "processed" and not neutral(sampling):
        return "raw_logprobs"
    return None


def trainer_can_reproduce(sampling: SamplingParams) -> bool:
    """Whether recorded behaviour logprobs are samples the trainer can weigh (`untrainable_sampling`)."""
    return untrainable_sampling(sampling) is None
