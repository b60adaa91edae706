"""Settings of the event stream: brokers, topics, the labeler's consumer group and client security."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator

from schemas.settings.section import Section


class KafkaSettings(Section):
    """The event stream."""

    bootstrap_servers: str = Field("127.0.0.1:19092", description="Comma-separated host:port list.")
    interactions_topic: str = Field("rtrl.interactions.v1", description="InteractionEvent topic.")
    feedback_topic: str = Field("rtrl.feedback.v1", description="FeedbackEvent topic.")
    dlq_topic: str = Field("rtrl.dlq.v1", description="Dead-letter topic (DeadLetterRecord).")
    partitions: int = Field(3, ge=1, description="Partitions per topic when rtrl creates them.")
    replication_factor: int = Field(
        1,
        ge=1,
        description="Replicas per partition of the topics rtrl creates (3 on a production cluster; the local "
        "broker of `rtrl services` has one, and its topics are made with 1 whatever this says).",
    )
    min_insync_replicas: int | None = Field(
        None,
        ge=1,
        description="min.insync.replicas of the topics rtrl creates (with acks=all, a write needs this many "
        "replicas; 2 with replication_factor 3); None: the broker's default.",
    )
    labeler_group: str = Field("rtrl-labeler", description="Consumer group of the feedback labeler.")
    max_message_bytes: int = Field(
        17 * 1024 * 1024,
        ge=64 * 1024,
        description="Largest record rtrl produces: the producers' max_request_size, max.message.bytes of the "
        "topics rtrl creates and of the local broker, the consumers' fetch size. A record over it is "
        "dead-lettered where it is produced. Default: the 16 MiB event limit plus room for key and headers.",
    )
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="How clients connect to the brokers."
    )
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = Field(
        None, description="SASL mechanism (with SASL_PLAINTEXT / SASL_SSL)."
    )
    sasl_username: str | None = Field(None, description="SASL user name.")
    sasl_password: SecretStr | None = Field(None, description="SASL password (never printed).")
    ssl_cafile: Path | None = Field(
        None, description="CA bundle that signed the brokers' certificates (SSL)."
    )
    ssl_certfile: Path | None = Field(None, description="Client certificate, PEM (mutual TLS).")
    ssl_keyfile: Path | None = Field(None, description="Private key of the client certificate, PEM.")
    reconnect_backoff_max_ms: int = Field(
        2000,
        ge=50,
        description="Longest wait between a client's attempts to reconnect to a broker. kafka-python's own "
        "default (30 s) can keep a labeler idle for half a minute after a broker comes back.",
    )
    bootstrap_timeout_ms: int = Field(
        10_000,
        ge=500,
        le=300_000,
        description="How long a new client waits for a first answer from the brokers before it reports "
        "them unreachable (a CLI command's one-line error; a daemon's restart by its supervisor). "
        "kafka-python's own default is 30 s.",
    )

    @model_validator(mode="after")
    def _security_complete(self) -> KafkaSettings:
        if self.security_protocol.startswith("SASL_"):
            if self.sasl_mechanism is None or not self.sasl_username or self.sasl_password is None:
                raise ValueError(
                    f"security_protocol {self.security_protocol} needs sasl_mechanism, sasl_username and sasl_password"
                )
        elif self.sasl_mechanism is not None:
            raise ValueError(f"sasl_mechanism is set but security_protocol is {self.security_protocol}")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile and ssl_keyfile go together (mutual TLS)")
        return self
