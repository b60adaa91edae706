"""Every Kafka client rtrl builds comes from here, with the connection and security settings of
``settings.kafka``: bootstrap servers, security protocol, SASL mechanism and credentials, TLS files.

kafka-python's clients are created lazily by the callers (importing this module does not import
Kafka). Callers add what is theirs (a client id, a group, acks) as keyword arguments. A client
that cannot bootstrap from the brokers raises `BrokersUnreachable`, which says what to check; any
other kafka-python error while a client is created arrives as its `streams.errors.BrokerError`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from schemas.settings import KafkaSettings
from streams.errors import BrokersUnreachable, kafka_errors
from streams.joins import fix_join_race


@contextmanager
def _bootstrapping(kafka: KafkaSettings) -> Iterator[None]:
    from kafka.errors import KafkaConnectionError, KafkaTimeoutError

    try:
        yield
    except (KafkaTimeoutError, KafkaConnectionError) as exc:
        raise BrokersUnreachable(
            f"cannot reach Kafka at {kafka.bootstrap_servers} ({' '.join(str(exc).split())}); is it up? "
            "(`rtrl services status`, RTRL_KAFKA__BOOTSTRAP_SERVERS, RTRL_KAFKA__SECURITY_PROTOCOL)"
        ) from exc


def _create(kafka: KafkaSettings, factory: Callable[..., Any], *args: Any, **options: Any) -> Any:
    config = {**connection_config(kafka), **options}  # the caller's options win (the gateway's timeouts)
    with kafka_errors(), _bootstrapping(kafka):  # unreachable brokers first, other Kafka errors after
        return factory(*args, **config)


def connection_config(kafka: KafkaSettings) -> dict[str, Any]:
    """The keyword arguments every kafka-python client needs to reach and authenticate to the brokers."""
    config: dict[str, Any] = {
        "bootstrap_servers": [
            server.strip() for server in kafka.bootstrap_servers.split(",") if server.strip()
        ],
        "security_protocol": kafka.security_protocol,
        "reconnect_backoff_max_ms": kafka.reconnect_backoff_max_ms,
        "bootstrap_timeout_ms": kafka.bootstrap_timeout_ms,
    }
    if kafka.sasl_mechanism is not None:
        assert kafka.sasl_password is not None  # KafkaSettings validates SASL settings as a set
        config.update(
            sasl_mechanism=kafka.sasl_mechanism,
            sasl_plain_username=kafka.sasl_username,
            sasl_plain_password=kafka.sasl_password.get_secret_value(),
        )
    for key, path in (
        ("ssl_cafile", kafka.ssl_cafile),
        ("ssl_certfile", kafka.ssl_certfile),
        ("ssl_keyfile", kafka.ssl_keyfile),
    ):
        if path is not None:
            config[key] = str(path)
    return config


def producer(kafka: KafkaSettings, client_id: str, **options: Any) -> Any:
    """A `kafka.KafkaProducer`: acks from all in-sync replicas, idempotent retries and records up to
    ``kafka.max_message_bytes`` unless overridden."""
    from kafka import KafkaProducer

    options = {
        "acks": "all",
        "enable_idempotence": True,
        "max_request_size": kafka.max_message_bytes,
        **options,
    }
    return _create(kafka, KafkaProducer, client_id=client_id, **options)


def consumer(kafka: KafkaSettings, client_id: str, *topics: str, **options: Any) -> Any:
    """A `kafka.KafkaConsumer` (subscribed to `topics` when given) that can fetch records of
    ``kafka.max_message_bytes``. Offsets are never auto-committed unless the caller says so: rtrl
    commits after its own writes. kafka-python's group join is fixed first (streams/joins.py)."""
    from kafka import KafkaConsumer

    fix_join_race()
    options = {"enable_auto_commit": False, "max_partition_fetch_bytes": kafka.max_message_bytes, **options}
    return _create(kafka, KafkaConsumer, *topics, client_id=client_id, **options)


def admin(kafka: KafkaSettings, client_id: str, **options: Any) -> Any:
    """A `kafka.admin.KafkaAdminClient`."""
    from kafka.admin import KafkaAdminClient

    return _create(kafka, KafkaAdminClient, client_id=client_id, **options)
