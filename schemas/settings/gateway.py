"""Settings of the capture gateway (`rtrl gateway`) and the limits on what events rtrl accepts."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from schemas.settings.section import Section

# The per-tenant cap must leave the upstream pool to at least this many tenants at their cap at once,
# so that a few hostile tenants cannot take every connection (docs/security.md).
TENANTS_TO_FILL_THE_POOL = 4

# The request fields of /v1/chat/completions and /v1/completions the gateway forwards to vLLM by
# default: what OpenAI's clients send for a text generation (docs/security.md, Forwarded fields and
# token budgets). Each belongs to the endpoints that take it (ingest/forwarding.py).
FORWARDED_FIELDS = (
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "user",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
)
# Set by the gateway, never taken from a client (ingest/forwarding.py).
GATEWAY_SET_FIELDS = ("cache_salt",)


class GatewaySettings(Section):
    """The OpenAI-compatible capture gateway in front of the vLLM fleet."""

    host: str = Field("127.0.0.1", description="Bind address of `rtrl gateway`.")
    port: int = Field(18080, description="Bind port of `rtrl gateway`.")
    workers: int = Field(
        1,
        ge=1,
        le=64,
        description="Gateway processes serving the port (ingest/prefork.py). 1: one process, no supervisor. "
        "More: a supervisor binds the port once and runs this many workers on it, each with its own vLLM "
        "connection pool, Kafka producer and spool (spool_dir/worker-<i>); the per-tenant and per-key "
        "limits below are then enforced by each worker (docs/scaling.md, Gateway).",
    )
    access_log: bool = Field(
        False,
        description="Log one line per request (uvicorn's access log). Off by default: it costs 0.1-0.3 ms "
        "of CPU per request on 2 cores, and rtrl_gateway_requests_total{endpoint,status} counts every answer.",
    )
    spool_dir: Path = Field(
        Path(".rtrl/run/spool"), description="On-disk spool for events Kafka did not take."
    )
    spool_max_bytes: int = Field(
        256 * 1024 * 1024,
        description="Spool bound; past it new records go to the overflow file (spool_dir/overflow.jsonl), "
        "and feedback is answered 503 (alert RtrlGatewaySpoolFilling past 80%).",
    )
    overflow_max_bytes: int = Field(
        64 * 1024 * 1024,
        ge=0,
        description="Bound of the overflow file (spool_dir/overflow.jsonl, dead letters to requeue by hand); past "
        "it records are dropped, each logged as DROPPED with its reason and counted "
        '(rtrl_gateway_publish_total{outcome="dropped"}).',
    )
    shutdown_grace_s: float = Field(
        10.0,
        ge=0,
        le=300,
        description="On SIGTERM, how long the gateway waits for requests in flight and their captures to finish "
        "before it flushes its publisher (what Kafka does not take then is spooled) and exits.",
    )
    publish_timeout_s: float = Field(
        5.0,
        gt=0,
        description="How long an event may wait for Kafka's acknowledgement before it is spooled to disk "
        "(a producer that does not settle its events within this plus 1 s is replaced). A feedback request "
        "waits this plus 1.25 s for its events to be on Kafka or in the spool, else it is answered 503.",
    )
    auth: Literal["keys", "open"] = Field(
        "keys",
        description="keys: every call needs an API key (`rtrl keys create`); open: no keys, one tenant "
        "'default', for local experiments only (logged loudly, shown by /readyz).",
    )
    keys_refresh_s: float = Field(
        5.0, gt=0, description="How often the gateway reloads the keys from the store."
    )
    rotation_refresh_s: float = Field(
        0.25,
        gt=0,
        le=5,
        description="How often the gateway reads which servers the deployer took out of rotation.",
    )
    request_id_secret: SecretStr | None = Field(
        None,
        description="Secret that signs request ids for their tenant; the same on every gateway replica. "
        "Unset: one is made in <services.run_dir>/gateway.secret (enough for gateways on one host).",
    )
    rate_limit_per_s: float = Field(
        20.0, ge=0, description="Requests a second per key (0 = unlimited); a key may have its own rate."
    )
    rate_limit_burst: float = Field(
        40.0, ge=1, description="Requests a key may send at once before it is limited."
    )
    max_request_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        description="Largest completion request body; larger is 413, refused unread.",
    )
    max_feedback_bytes: int = Field(
        1024 * 1024, ge=1024, description="Largest feedback request body; larger is 413, refused unread."
    )
    upstream_connections: int = Field(
        1024,
        ge=8,
        le=65_536,
        description="Connections the gateway holds to its vLLM servers at most, all servers together "
        "(each request or stream in flight holds one). At least "
        f"{TENANTS_TO_FILL_THE_POOL} x max_concurrent_per_tenant.",
    )
    upstream_acquire_timeout_s: float = Field(
        10.0,
        gt=0,
        le=300,
        description="How long a request may wait for a connection to vLLM (a free one of the pool, or a "
        "new one being made) before it is answered 503 with Retry-After.",
    )
    max_concurrent_per_tenant: int = Field(
        64,
        ge=0,
        description="Completion requests and streams one tenant may have in flight at this gateway at once "
        "(0 = no cap); past it 429 with Retry-After. At most upstream_connections / "
        f"{TENANTS_TO_FILL_THE_POOL}.",
    )
    max_inflight_tokens_per_tenant: int = Field(
        16384,
        ge=0,
        description="Tokens one tenant's completion requests and streams in flight at this gateway may ask for "
        "together (each request's max_tokens times n; 0 = no budget); past it 429 with Retry-After. A request "
        "alone is always let through, so the budget never refuses a tenant's only request.",
    )
    feedback_events_per_s: float = Field(
        100.0,
        ge=0,
        description="Feedback events a second one tenant may send through this gateway (0 = unlimited); a body "
        "spends its event count, past it 429 with Retry-After.",
    )
    feedback_events_burst: float = Field(
        1000.0,
        ge=1,
        description="Feedback events a tenant may send at once before feedback_events_per_s limits it (at least "
        "one full body of 1,000 events to send it whole).",
    )
    stream_write_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="A stream whose client does not take a chunk within this many seconds is ended, its "
        "vLLM request released, and it is captured truncated (never trained on).",
    )
    socket_send_buffer_bytes: int = Field(
        256 * 1024,
        ge=0,
        le=16 * 1024 * 1024,
        description="Kernel send buffer (SO_SNDBUF, which Linux doubles) of each client connection: what a "
        "client that does not read holds in kernel memory, and how far a stream runs ahead of it before "
        "stream_write_timeout_s counts; 0 = the kernel's autotuning (up to net.ipv4.tcp_wmem, ~3 MB a "
        "connection measured).",
    )
    client_stall_timeout_s: float = Field(
        60.0,
        ge=0,
        le=3600,
        description="A client connection that takes no byte for this long while the gateway has data for "
        "it (TCP_USER_TIMEOUT) is aborted by the kernel, freeing the socket and its buffers: a client that "
        "never reads keeps nothing after its stream was ended; 0 = the kernel's default (never).",
    )
    forwarded_fields: tuple[str, ...] = Field(
        FORWARDED_FIELDS,
        description="Request fields of /v1/chat/completions and /v1/completions forwarded to vLLM; any other "
        "field is a 400 naming it (a null one is dropped). Penalties are left out: presence_penalty, "
        "frequency_penalty and repetition_penalty are accepted only at their neutral value (0, 0, 1) unless "
        "listed here. The gateway's own fields (rtrl, return_token_ids, return_prompt_text) are always "
        "accepted; cache_salt never is (the gateway sets it per tenant). docs/security.md, Forwarded fields "
        "and token budgets.",
    )
    max_tokens_per_request: int = Field(
        4096,
        ge=1,
        le=1_000_000,
        description="Most tokens one completion request may ask vLLM to generate: a max_tokens or "
        "max_completion_tokens above it is a 400; a request that sets neither gets this (or "
        "vllm.max_model_len when smaller) before it is forwarded.",
    )
    max_top_logprobs: int = Field(
        5,
        ge=0,
        le=20,
        description="Most alternatives per token a request may ask for (top_logprobs of a chat request, "
        "logprobs of a completion request); more is a 400. Each one is an entry per generated token in "
        "vLLM's answer, which the gateway reads whole.",
    )
    redaction: tuple[str, ...] = Field(
        ("email", "phone", "api_key"),
        description="Detectors masking text in events before they leave the gateway: email, phone, api_key "
        "or module:function (see ingest/redaction.py); [] turns redaction off.",
    )

    @field_validator("forwarded_fields")
    @classmethod
    def _clients_do_not_set_the_gateways_fields(cls, fields: tuple[str, ...]) -> tuple[str, ...]:
        owned = sorted(set(fields) & set(GATEWAY_SET_FIELDS))
        if owned:
            raise ValueError(
                f"{', '.join(owned)} cannot be forwarded from clients: the gateway sets it itself (one "
                "prefix-cache salt per tenant, docs/security.md)"
            )
        if any(not f or not f.isidentifier() for f in fields):
            raise ValueError(f"forwarded_fields must be request field names, got {list(fields)!r}")
        return fields

    @model_validator(mode="after")
    def _pool_outlasts_a_few_tenants(self) -> GatewaySettings:
        cap, pool = self.max_concurrent_per_tenant, self.upstream_connections
        if cap * TENANTS_TO_FILL_THE_POOL > pool:
            raise ValueError(
                f"max_concurrent_per_tenant {cap} lets {pool // cap} tenants take all {pool} "
                f"upstream_connections; lower it to at most {pool // TENANTS_TO_FILL_THE_POOL} or raise "
                f"upstream_connections to at least {cap * TENANTS_TO_FILL_THE_POOL}"
            )
        return self


class LimitsSettings(Section):
    """What events rtrl accepts at all: checked by the gateway (refused) and the labeler (dead-lettered)."""

    max_future_skew_s: float = Field(
        300.0,
        ge=0,
        description="An event's created_at may be at most this far ahead of the receiver's clock.",
    )
    max_event_age_s: float = Field(
        30 * 24 * 3600.0,
        gt=0,
        description="An event's created_at may be at most this old (the data's retention).",
    )
    max_segments_per_episode: int = Field(
        256,
        ge=1,
        le=10_001,
        description="Segments (served calls) one episode may have; the labeler dead-letters each segment past "
        "it (`cap: ...`), the episode keeps its first ones: the work of settling, judging and training one "
        "episode stays bounded whatever a tenant sends (docs/security.md, Caps per episode).",
    )
    max_feedback_per_episode: int = Field(
        64,
        ge=1,
        le=100_000,
        description="Feedback events one episode may receive (and one request whose episode is not known yet); "
        "the labeler dead-letters each past it (`cap: ...`), so a flooded episode still settles by its window "
        "and its feedback is read at most this many rows at a time.",
    )
    max_prompt_bytes: int = Field(
        256 * 1024,
        ge=1024,
        description="Largest prompt text of an interaction (UTF-8 bytes); the labeler dead-letters a larger one "
        "(`cap: ...`): settling compares an episode's prompts with each other, so their size is its cost.",
    )
