"""Settings of the capture gateway (`rtrl gateway`) and the limits on what events rtrl accepts."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr

from schemas.settings.section import Section


class GatewaySettings(Section):
    """The OpenAI-compatible capture gateway in front of the vLLM fleet."""

    host: str = Field("127.0.0.1", description="Bind address of `rtrl gateway`.")
    port: int = Field(18080, description="Bind port of `rtrl gateway`.")
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
        description="Spool bound; past it new records go to the overflow file (spool_dir/overflow.jsonl).",
    )
    publish_timeout_s: float = Field(
        5.0,
        gt=0,
        description="How long an event may wait for Kafka's acknowledgement before it is spooled to disk "
        "(a producer that does not settle its events within this plus 1 s is replaced).",
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
    redaction: tuple[str, ...] = Field(
        ("email", "phone", "api_key"),
        description="Detectors masking text in events before they leave the gateway: email, phone, api_key "
        "or module:function (see ingest/redaction.py); [] turns redaction off.",
    )


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
