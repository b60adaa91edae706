"""How a request was sampled (schemas/sampling.py): the model's defaults written into requests,
what the trainer cannot reproduce, and which recorded logprobs compare with its recomputation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from schemas.events import SamplingParams
from schemas.sampling import (
    SamplingConfigError,
    apply_defaults,
    generation_defaults,
    served_defaults,
    trainer_can_reproduce,
    unreproducible,
    untrainable_sampling,
)
from schemas.settings import Settings, VllmSettings

pytestmark = pytest.mark.unit


def test_a_models_generation_config_gives_its_sampling_defaults(tmp_path: Path) -> None:
    assert generation_defaults(tmp_path) == {}  # no generation_config.json: vLLM's neutral defaults
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": 1,
                "do_sample": True,
                "temperature": 0.7,
                "top_p": 0.8,
                "top_k": 20,
                "repetition_penalty": 1.05,
                "max_new_tokens": 512,
                "min_p": None,
            }
        )
    )
    assert generation_defaults(tmp_path) == {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
    }
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(SamplingConfigError, match="generation_config.json"):
        generation_defaults(tmp_path)


def test_settings_defaults_win_over_the_models_and_unknown_keys_are_refused(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7}))
    settings = Settings(vllm=VllmSettings(model_dir=tmp_path))
    assert served_defaults(settings) == {"temperature": 0.7}
    settings = Settings(vllm=VllmSettings(model_dir=tmp_path, sampling_defaults={"top_p": 0.9}))
    assert served_defaults(settings) == {"top_p": 0.9}
    with pytest.raises(ValidationError, match="unknown sampling parameters"):
        VllmSettings(sampling_defaults={"temp": 0.7})


def test_defaults_fill_only_what_the_client_left_out() -> None:
    body: dict[str, Any] = {"temperature": 0.2, "top_p": None}
    apply_defaults(body, {"temperature": 0.7, "top_p": 0.8, "top_k": 20})
    assert body == {"temperature": 0.2, "top_p": 0.8, "top_k": 20}


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({}, None),
        ({"temperature": 0.3, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 7}, None),
        ({"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"tools": [{"type": "function"}], "tool_choice": "auto"}, None),
        (
            {"repetition_penalty": 1.05, "presence_penalty": 0.5, "frequency_penalty": -0.1},
            None,
        ),  # reproduced
        ({"logit_bias": {"50256": -100}}, "logit_bias"),
        ({"allowed_token_ids": [1, 2]}, "token_restriction"),
        ({"bad_words": ["x"]}, "token_restriction"),
        ({"response_format": {"type": "json_object"}}, "guided_decoding"),
        ({"structured_outputs": {"regex": "a+"}}, "guided_decoding"),
        ({"guided_json": {"type": "object"}}, "guided_decoding"),
        ({"tools": [{"type": "function"}], "tool_choice": "required"}, "guided_decoding"),
        (
            {"tools": [{"type": "function"}], "tool_choice": {"type": "function", "function": {"name": "f"}}},
            "guided_decoding",
        ),
        ({"min_tokens": 4}, "min_tokens"),
        ({"logits_processors": ["m:f"]}, "logits_processors"),
        ({"use_beam_search": True}, "beam_search"),
    ],
)
def test_what_the_trainer_cannot_reproduce_is_named(extra: dict[str, Any], reason: str | None) -> None:
    assert unreproducible({"model": "m", "prompt": "p", "max_tokens": 4, **extra}) == reason


@pytest.mark.parametrize(
    ("params", "raw_ok"),
    [
        ({}, True),
        ({"temperature": 0.7}, False),
        ({"top_p": 0.9}, False),
        ({"top_k": 5}, False),
        ({"min_p": 0.1}, False),
        ({"top_k": 0}, True),
        ({"repetition_penalty": 1.1}, False),  # raw logprobs are taken before the penalties
    ],
)
def test_raw_logprobs_compare_with_the_trainers_only_where_sampling_was_neutral(
    params: dict[str, Any], raw_ok: bool
) -> None:
    assert trainer_can_reproduce(SamplingParams(**params, logprobs_mode="raw")) is raw_ok
    assert trainer_can_reproduce(SamplingParams(**params, logprobs_mode="processed"))


@pytest.mark.parametrize("mode", ["raw", "processed"])
@pytest.mark.parametrize(
    ("params", "reason"),
    [
        ({"temperature": 0.0, "top_p": 0.5}, "greedy"),
        ({"temperature": 0.0, "presence_penalty": 0.5}, "greedy"),
        ({"temperature": 0.05}, "near_greedy"),
        ({"temperature": 0.1, "top_k": 20}, None),
    ],
)
def test_greedy_and_near_greedy_samples_are_never_trained_on(
    params: dict[str, Any], reason: str | None, mode: str
) -> None:
    """A greedy token is the argmax, not a sample of the softmax vLLM reports: training on it (or
    weighting it) as one biases the gradient, and its importance weight reads ≈ 1 (issue 35)."""
    sampling = SamplingParams(**params, logprobs_mode=mode)
    if mode == "raw" and reason is None:
        reason = "raw_logprobs"  # T = 0.1 with top-k is not neutral: raw logprobs are not comparable
    assert untrainable_sampling(sampling) == reason
    assert trainer_can_reproduce(sampling) is (reason is None)
    body = {"model": "m", "prompt": "p", **params}
    assert unreproducible(body) == (None if reason in (None, "raw_logprobs") else reason)


def test_events_recorded_before_the_logprobs_mode_existed_read_as_raw() -> None:
    assert SamplingParams.model_validate({"temperature": 0.7}).logprobs_mode == "raw"
