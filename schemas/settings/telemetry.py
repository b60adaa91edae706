"""Settings of each process's Prometheus metrics, health and readiness endpoints (telemetry/)."""

from __future__ import annotations

from pydantic import Field, SecretStr

from schemas.settings.section import Section


class MetricsSettings(Section):
    """Prometheus metrics, health and readiness of each process (telemetry/; docs/metrics.md).

    Each process serves ``/metrics``, ``/healthz`` and ``/readyz`` on its own port (0: none); the
    gateway serves them on its own port. Two replicas of a process on one host need two ports
    (``RTRL_METRICS__LABELER_PORT=...`` per replica)."""

    host: str = Field(
        "127.0.0.1",
        description="Bind address of every process's endpoint (0.0.0.0 for a Prometheus elsewhere; "
        "then set a token).",
    )
    token: SecretStr | None = Field(
        None,
        description="When set, /metrics asks for `Authorization: Bearer <token>` (health endpoints never do).",
    )
    supervisor_port: int = Field(
        19100, ge=0, le=65535, description="`rtrl run` / `rtrl demo` (the supervisor)."
    )
    labeler_port: int = Field(19101, ge=0, le=65535, description="`rtrl labeler`.")
    worker_port: int = Field(
        19102, ge=0, le=65535, description="`rtrl worker` (training cycles, gate, swaps)."
    )
    beat_port: int = Field(19103, ge=0, le=65535, description="`rtrl beat`.")
    reconciler_port: int = Field(19104, ge=0, le=65535, description="`rtrl deploy reconcile --forever`.")
