"""Settings of the stateful backends besides Kafka: the SQL store, the trainer's Celery queue, and
MLflow (experiment tracking and the model registry).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, model_validator

from schemas.settings.section import Section


class StoreSettings(Section):
    """The SQL store of events and labelled episodes."""

    url: str = Field(
        "postgresql+psycopg://rtrl@127.0.0.1:15432/rtrl",
        description="SQLAlchemy URL: sqlite:///path or postgresql+psycopg://user@host:port/db. Unset: the "
        "postgres.database database of the local PostgreSQL (`rtrl services up`) at "
        "services.host:services.postgres_port as postgres.user (the default shown is that with the default "
        "ports); `rtrl demo` makes it sqlite:///<services.run_dir>/rtrl.db instead.",
    )


class CelerySettings(Section):
    """The trainer's task queue."""

    broker_url: str = Field("redis://127.0.0.1:16379/0", description="Celery broker URL.")
    result_backend: str = Field("redis://127.0.0.1:16379/1", description="Celery result backend URL.")


class MlflowSettings(Section):
    """Experiment tracking and the model registry."""

    tracking_uri: str = Field("http://127.0.0.1:15000", description="MLflow tracking server URI.")
    backend_store_uri: str = Field(
        "postgresql+psycopg://rtrl@127.0.0.1:15432/mlflow",
        description="Database of the local MLflow server (SQLAlchemy URL). Unset: the postgres.mlflow_database "
        "database of the local PostgreSQL (`rtrl services up` starts MLflow once it is up; the default shown is "
        "that with the default ports); `rtrl demo` makes it sqlite:///<services.run_dir>/mlflow/mlflow.db instead.",
    )
    artifact_root: Path = Field(
        Path(".rtrl/run/mlflow/artifacts"), description="Artifact root of the local server."
    )
    username: str | None = Field(
        None,
        description="MLflow user rtrl signs in as (MLflow's basic-auth app). Unset with the local services: "
        "the admin credentials `rtrl services up` made in <services.run_dir>/mlflow/auth.json.",
    )
    password: SecretStr | None = Field(None, description="Password of `username` (never printed).")
    experiment: str = Field("rtrl", description="Experiment that training cycles log to.")
    model_name: str = Field("rtrl-policy", description="Registered model name.")

    @model_validator(mode="after")
    def _credentials_complete(self) -> MlflowSettings:
        if (self.username is None) != (self.password is None):
            raise ValueError(
                "set both RTRL_MLFLOW__USERNAME and RTRL_MLFLOW__PASSWORD, or neither (the local services' own)"
            )
        return self
