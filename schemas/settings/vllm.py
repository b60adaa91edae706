"""Settings of the vLLM fleet rtrl serves from and hot-swaps, and the sampling parameters a model's
generation_config.json may set (`GENERATION_CONFIG_KEYS`, used by `schemas.sampling`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from schemas.settings.section import Section

# vLLM reads these from a model's generation_config.json (vllm.config.ModelConfig.get_diff_sampling_param).
# They are here, not in schemas.sampling (which reads that file), because `sampling_defaults` is
# validated against them and schemas.sampling imports the settings: one arrow, sampling -> settings.
GENERATION_CONFIG_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


class VllmSettings(Section):
    """The vLLM fleet rtrl serves from and hot-swaps."""

    servers: tuple[str, ...] = Field(
        ("http://127.0.0.1:18000",), description="Base URLs of the vLLM OpenAI servers (the fleet)."
    )
    model_dir: Path = Field(
        Path(".rtrl/models/tiny"), description="HF-format checkpoint the local server starts on."
    )
    staging_server: str | None = Field(
        "http://127.0.0.1:18001",
        description="vLLM server for eval-gate generation and for recording a checkpoint's digests; never serves users.",
    )
    canary_server: str | None = Field(
        None,
        description="vLLM server that serves the challenger to `gate.canary.share` of users while a live canary "
        "runs (docs/gate.md, Live canary); out of the gateways' rotation otherwise. Neither a fleet server nor "
        "the staging server. None: no live canary.",
    )
    served_model_name: str = Field("rtrl-tiny", description="Model name clients send.")
    tool_call_parser: str | None = Field(
        None,
        description="vLLM's tool-call parser for the served model (--tool-call-parser): rtrl's servers then start "
        "with --enable-auto-tool-choice, and chat requests with `tools` and tool_choice auto come back with "
        "parsed `tool_calls`. Which parser fits which model family: docs/methods.md, Tool calls (`rtrl model "
        "check` names it for a checkpoint it recognises): pythonic for rtrl's tiny model built with --recipe "
        "tools, hermes for Qwen2.5 / Qwen3 / Hermes, llama3_json for Llama 3.1+, mistral for Mistral. None: no "
        "parser; a request with `tools` and tool_choice auto is refused by vLLM.",
    )
    max_loras: int = Field(
        1,
        ge=1,
        le=64,
        description="--max-loras of LoRA servers (trainer.adapter=lora): adapters served side by side in one batch. "
        "At least 1 + the tenants with an adapter of their own (`rtrl tenants set T --adapter` refuses one more; "
        "docs/lora.md, An adapter per tenant).",
    )
    logprobs_mode: Literal["processed", "raw"] = Field(
        "processed",
        description="What the fleet's servers report as logprobs: processed (vLLM --logprobs-mode processed_logprobs, "
        "after temperature and truncation; rtrl starts its servers so) or raw (a fleet started without it: only "
        "requests sampled at temperature 1 without truncation, or greedy, are then trainable).",
    )
    sampling_defaults: dict[str, float] | None = Field(
        None,
        description="Sampling defaults the gateway writes into requests that leave them out (temperature, top_p, "
        "top_k, min_p, penalties). None: the model's generation_config.json in model_dir (none there: vLLM's "
        "neutral defaults). rtrl's servers run with --generation-config vllm, so these are the only defaults applied.",
    )
    weights_agents: dict[str, str] = Field(
        default_factory=dict,
        description="Server URL -> URL of the weights agent (`rtrl agent`) on that server's host, for servers "
        "that cannot see the deployer's files: the deployer asks the agent to download the version from the "
        "registry's artifact store and hands vLLM the agent's path. A server without one is handed the "
        "deployer's own download (one host, or a volume every host mounts). JSON: "
        '\'{"http://vllm-0:8000": "http://vllm-0:18090"}\'.',
    )
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32",
        description="--dtype of the vLLM servers, and the dtype the swap probe's tolerance follows "
        "(deployer.probe_tolerance). float32 (the default, for CPU): vLLM then matches the trainer's float32 "
        "transformers reference to about 1e-6; bfloat16 or float16 on a GPU; auto: the checkpoint's own dtype "
        "from config.json (a float32 checkpoint is served in bfloat16: vLLM's rule). A fleet rtrl does not "
        "start must run with the dtype named here.",
    )
    kv_cache_gib: int = Field(1, description="VLLM_CPU_KVCACHE_SPACE for the local CPU server.")
    max_model_len: int = Field(512, description="Context length of the local server.")
    request_timeout_s: float = Field(120.0, description="Timeout of one request to a vLLM server.")

    @field_validator("sampling_defaults")
    @classmethod
    def _known_sampling_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        unknown = sorted(set(value or {}) - set(GENERATION_CONFIG_KEYS))
        if unknown:
            raise ValueError(f"unknown sampling parameters {unknown}; known: {list(GENERATION_CONFIG_KEYS)}")
        return value

    @model_validator(mode="after")
    def _canary_server_apart(self) -> VllmSettings:
        if self.canary_server is None:
            return self
        canary = self.canary_server.rstrip("/")
        if canary in {u.rstrip("/") for u in self.servers}:
            raise ValueError(
                f"vllm.canary_server {canary} is also in vllm.servers; the canary needs its own server"
            )
        if self.staging_server is not None and canary == self.staging_server.rstrip("/"):
            raise ValueError(f"vllm.canary_server {canary} is the staging server, which never serves users")
        return self

    @field_validator("tool_call_parser")
    @classmethod
    def _parser_name(cls, value: str | None) -> str | None:
        # A name of vLLM's registry (vllm/tool_parsers/__init__.py); checked by vLLM when it starts,
        # here only for shape, so a typo of a flag's value is not passed on as a second flag.
        if value is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", value):
            raise ValueError(
                f"tool_call_parser must be a parser name such as pythonic or hermes, got {value!r}"
            )
        return value

    @field_validator("staging_server", "canary_server", "tool_call_parser", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        # RTRL_VLLM__STAGING_SERVER= (empty) means "no staging server", not a server at "" (and
        # RTRL_VLLM__TOOL_CALL_PARSER= no parser).
        return None if isinstance(value, str) and not value.strip() else value
