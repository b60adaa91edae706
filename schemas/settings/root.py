"""The root `Settings` (every section, read from ``RTRL_*`` and .env), the databases' defaults that
depend on other sections, and how a configuration is loaded (`load_settings`) and handed to a
child process (`to_env`). The package docstring (`schemas.settings`) says how to set it.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.errors import OperatorError
from schemas.settings.backends import CelerySettings, MlflowSettings, StoreSettings
from schemas.settings.deployer import AgentSettings, DeployerSettings
from schemas.settings.gate import GateSettings
from schemas.settings.gateway import GatewaySettings, LimitsSettings
from schemas.settings.kafka import KafkaSettings
from schemas.settings.labeler import LabelerSettings
from schemas.settings.services import PostgresSettings, ServicesSettings
from schemas.settings.telemetry import MetricsSettings
from schemas.settings.trainer import TrainerSettings
from schemas.settings.vllm import VllmSettings


class Settings(BaseSettings):
    """All of rtrl's configuration. See the `schemas.settings` package docstring for how to set it."""

    model_config = SettingsConfigDict(
        env_prefix="RTRL_",
        env_nested_delimiter="__",
        env_file=".env",
        env_parse_none_str="null",  # RTRL_TRAINER__MAX_KL=null: an optional setting turned off
        extra="ignore",
        frozen=True,
    )

    services: ServicesSettings = ServicesSettings()
    kafka: KafkaSettings = KafkaSettings()
    store: StoreSettings = StoreSettings()
    postgres: PostgresSettings = PostgresSettings()
    celery: CelerySettings = CelerySettings()
    mlflow: MlflowSettings = MlflowSettings()
    vllm: VllmSettings = VllmSettings()
    gateway: GatewaySettings = GatewaySettings()
    limits: LimitsSettings = LimitsSettings()
    labeler: LabelerSettings = LabelerSettings()
    trainer: TrainerSettings = TrainerSettings()
    gate: GateSettings = GateSettings()
    deployer: DeployerSettings = DeployerSettings()
    agent: AgentSettings = AgentSettings()
    metrics: MetricsSettings = MetricsSettings()

    @model_validator(mode="after")
    def _local_databases(self) -> Settings:
        # Unset databases follow services and postgres: the local PostgreSQL on its port, as its user.
        _default(self, "store", "url", local_postgres_url(self))
        _default(self, "mlflow", "backend_store_uri", local_postgres_url(self, self.postgres.mlflow_database))
        return self

    @model_validator(mode="after")
    def _canary_has_a_server(self) -> Settings:
        if self.gate.canary.enabled and self.vllm.canary_server is None:
            raise ValueError(
                "gate.canary.enabled needs vllm.canary_server (RTRL_VLLM__CANARY_SERVER), the server that serves "
                "the challenger to the canary's share of users"
            )
        if self.gate.canary.enabled and self.gate.canary.max_duration_s >= self.trainer.max_cycle_s:
            raise ValueError(
                f"gate.canary.max_duration_s ({self.gate.canary.max_duration_s:g}) must be below "
                f"trainer.max_cycle_s ({self.trainer.max_cycle_s:g}): the canary runs inside the cycle's job, "
                "which is handed out again after max_cycle_s"
            )
        return self


def local_postgres_url(settings: Settings, database: str | None = None) -> str:
    """SQLAlchemy URL of `database` (default: postgres.database, the store's) on the local PostgreSQL
    that `rtrl services up` runs, as postgres.user (trusted on loopback: no password)."""
    s = settings.services
    return f"postgresql+psycopg://{settings.postgres.user}@{s.host}:{s.postgres_port}/{database or settings.postgres.database}"


def embedded_databases(settings: Settings) -> Settings:
    """`settings` with the store and MLflow's backend, where not set, as SQLite files in the run dir
    (``sqlite:///<services.run_dir>/rtrl.db`` and ``.../mlflow/mlflow.db``) instead of the local
    PostgreSQL's databases: the embedded deployment of ``rtrl demo``, which needs no PostgreSQL.
    What the operator set is left alone."""
    run_dir = settings.services.run_dir
    embedded = settings.model_copy()
    _default(embedded, "store", "url", f"sqlite:///{run_dir / 'rtrl.db'}")
    _default(embedded, "mlflow", "backend_store_uri", f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}")
    return embedded


def _default(settings: Settings, section: str, field: str, value: str) -> None:
    """Give `section.field` a default that depends on other sections, unless the operator set it.

    The field still counts as not set (the section's ``model_fields_set``), so that a later default
    (:func:`embedded_databases`) may replace it. Settings are frozen: this is the one place a
    section is replaced, while they are validated or on a copy no one holds yet.
    """
    current = getattr(settings, section)
    if field in current.model_fields_set:
        return
    values = {**dict(current), field: value}
    settings.__dict__[section] = type(current).model_construct(
        _fields_set=set(current.model_fields_set), **values
    )


def to_env(settings: Settings) -> dict[str, str]:
    """The ``RTRL_*`` environment that makes ``Settings()`` in a child process equal ``settings``.

    One JSON document per section (``RTRL_KAFKA={...}``), which pydantic-settings reads like the
    nested ``RTRL_KAFKA__...`` form; secrets are written in clear, as the child needs them. Used
    to hand a configuration to the processes rtrl starts (``services.launch.child_env``).
    """
    env = {}
    for name, value in settings.model_dump(mode="python").items():
        env[f"RTRL_{name.upper()}"] = json.dumps(value, default=_plain)
    return env


def _plain(value: object) -> object:
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot hand {type(value).__name__} to a child process")


class SettingsError(OperatorError):
    """The environment (or .env) holds a setting rtrl cannot use; the message names the variable."""


# What infra/deploy/k8s/secrets.yaml and env.example hold until the operator replaces it.
PLACEHOLDER = "CHANGE-ME"


def placeholders(settings: Settings) -> list[str]:
    """The ``RTRL_*`` variables whose value (a secret, or a URL with a password in it) still holds
    the `PLACEHOLDER` of the manifests: a cluster applied as shipped would run on credentials that
    anyone who read the repository knows (docs/security.md, Least privilege in the manifests)."""
    found: list[str] = []

    def walk(model: BaseModel, prefix: str) -> None:
        for name in type(model).model_fields:
            value, variable = getattr(model, name), f"{prefix}__{name.upper()}"
            if isinstance(value, BaseModel):
                walk(value, variable)
                continue
            text = value.get_secret_value() if isinstance(value, SecretStr) else value
            if isinstance(text, str) and PLACEHOLDER.lower() in text.lower():
                found.append(variable)

    walk(settings, "RTRL")
    return [variable.replace("RTRL__", "RTRL_", 1) for variable in found]


def load_settings() -> Settings:
    """``Settings()`` from the environment and .env, with a one-line error naming the variable;
    a setting that still holds the manifests' `PLACEHOLDER` is refused the same way.

    What every entry point calls once at start-up.
    """
    try:
        settings = Settings()
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            variable = "RTRL_" + "__".join(str(part).upper() for part in error["loc"])
            value = error.get("input")
            if error["type"] == "union_tag_invalid":  # a tagged union (trainer.loss): name its tag
                context = error.get("ctx", {})
                variable += "__" + str(context.get("discriminator", "type")).strip("'").upper()
                error = {**error, "msg": f"Input should be one of {context.get('expected_tags')}"}
                value = context.get("tag")
            # A whole section (a model validator's error) may hold a secret; a secret never shows.
            shown = "" if isinstance(value, dict) or "PASSWORD" in variable else f" (got {value!r:.80})"
            problems.append(f"{variable}: {error['msg']}{shown}")
        raise SettingsError(
            "bad setting: " + "; ".join(problems) + " (fix the environment or .env)"
        ) from None
    unset = placeholders(settings)
    if unset:  # the value is never shown: it is (part of) a secret
        raise SettingsError(
            f"placeholder secret: {', '.join(unset)} still {'holds' if len(unset) == 1 else 'hold'} {PLACEHOLDER}; set a real value in the "
            "component's Secret (infra/deploy/k8s/secrets.yaml), infra/deploy/.env or the environment"
        )
    return settings
