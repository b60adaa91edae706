"""Settings of the local services `rtrl services up` runs: where they keep their data, their ports,
and the PostgreSQL that holds the store and MLflow's backend by default.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from schemas.settings.section import Section


class ServicesSettings(Section):
    """Where `rtrl services` keeps its data and logs, and the loopback ports it starts on."""

    run_dir: Path = Field(Path(".rtrl/run"), description="Data, logs and pid files of the local services.")
    cache_dir: Path = Field(
        Path.home() / ".cache" / "rtrl",
        description="Downloads shared between checkouts (Kafka jars from Maven Central).",
    )
    host: str = Field("127.0.0.1", description="Interface the local services bind to.")
    kafka_port: int = Field(19092, description="Kafka broker (PLAINTEXT listener).")
    kafka_controller_port: int = Field(19093, description="Kafka KRaft controller listener.")
    kafka_sasl_port: int = Field(
        19094,
        description="Kafka's SASL_PLAINTEXT listener (SCRAM-SHA-512, one principal per component with its "
        "ACLs; credentials in <run_dir>/kafka/scram.json): what a secured cluster looks like (docs/security.md).",
    )
    kafka_version: str = Field("4.4.0", description="org.apache.kafka:kafka_2.13 version from Maven Central.")
    postgres_port: int = Field(15432, description="PostgreSQL server.")
    redis_port: int = Field(16379, description="Redis server (Celery broker and result backend).")
    mlflow_port: int = Field(15000, description="MLflow tracking server.")
    vllm_port: int = Field(18000, description="vLLM OpenAI-compatible server (the serving fleet of one).")
    vllm_staging_port: int | None = Field(
        18001, description="Second vLLM server the eval gate and swap verification use; None to not start it."
    )
    vllm_canary_port: int | None = Field(
        None,
        description="Third local vLLM server, the live canary's (set vllm.canary_server to its URL and "
        "gate.canary.enabled); None (the default) to not start it.",
    )
    start_timeout_s: float = Field(
        600.0, description="How long `services up` waits for a service to be healthy."
    )
    restart_vllm: bool = Field(
        True,
        description="The fleet reconciler (`rtrl deploy reconcile`, `rtrl run`) restarts a vLLM server this run dir "
        "started when its process exits (vLLM exits when its engine dies) or its health check keeps failing; "
        "the restarted server is out of rotation until it serves @champion again.",
    )
    vllm_unhealthy_restart_s: float = Field(
        120.0,
        gt=0,
        description="How long a running vLLM server's health check may fail before the reconciler restarts it.",
    )
    enabled: tuple[str, ...] = Field(
        ("kafka", "postgres", "redis", "mlflow", "vllm"),
        description="Services `rtrl services up` starts.",
    )
    log_max_bytes: int = Field(
        50 * 1024 * 1024,
        ge=0,
        description="`rtrl run` rotates a log in <run_dir>/logs/ (its processes' and the local services') once it "
        "is larger than this (copy-truncate, services/logs.py); 0 turns rotation off.",
    )
    log_backups: int = Field(
        5, ge=0, description="Rotated copies kept per log (name.log.1 is the newest); 0 keeps none."
    )


class PostgresSettings(Section):
    """The local PostgreSQL server that `rtrl services` runs: the store and MLflow's backend by default."""

    user: str = Field("rtrl", description="Role created for rtrl (owner of both databases).")
    database: str = Field("rtrl", description="Database created for rtrl's store.")
    mlflow_database: str = Field(
        "mlflow", description="Database created for the local MLflow server's backend."
    )
