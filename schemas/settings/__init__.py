"""rtrl settings: one pydantic-settings model, read from the environment once at start-up.

Every variable is prefixed ``RTRL_`` and nested with ``__``; for example
``RTRL_KAFKA__BOOTSTRAP_SERVERS=broker:9092`` or ``RTRL_TRAINER__MIN_SAMPLES=256``.
The value ``null`` sets an optional setting to None (``RTRL_TRAINER__MAX_KL=null``). A ``.env``
file in the working directory is read too. The defaults are the one-machine deployment that
``rtrl services up`` starts on loopback under ``.rtrl/``: the store and MLflow's backend are its
PostgreSQL's databases (:func:`local_postgres_url`), which ``rtrl run`` and the operator commands
use; ``rtrl demo`` swaps the ones left unset for SQLite files (:func:`embedded_databases`).

Nothing else in rtrl reads the environment: processes build ``Settings()`` at start-up and pass
it (or the section they need) down.

One module per section (or a few small related ones), each a frozen `Section`; the root
`Settings`, `load_settings` and `to_env` are in `schemas.settings.root`. Import from here:
``from schemas.settings import Settings, TrainerSettings``.

- `services`: `ServicesSettings`, `PostgresSettings` (the local services of `rtrl services`).
- `kafka`: `KafkaSettings`.
- `backends`: `StoreSettings`, `CelerySettings`, `MlflowSettings`.
- `vllm`: `VllmSettings` (and `GENERATION_CONFIG_KEYS`, which `schemas.sampling` uses).
- `gateway`: `GatewaySettings`, `LimitsSettings`.
- `labeler`: `LabelerSettings`; `judge`: `JudgeSettings` (the labeler's and the gate's judge).
- `losses`: the `LossSettings` union (`CispoLoss`, `PpoLoss`, ...); `trainer`: `TrainerSettings`,
  `LoraSettings`, `ReplaySettings`.
- `gate`: `GateSettings` and its `OpeSettings`, `TrafficSettings`, `EpisodeSuiteSettings`, `AlarmSettings`, `OfflineSuiteSettings`,
  `RetentionSuiteSettings`.
- `deployer`: `DeployerSettings` (with `RetentionSettings`), `AgentSettings`; `telemetry`: `MetricsSettings`.

The package imports nothing else of rtrl but `schemas.errors`: `schemas.sampling` and the rest
import it, never the reverse.
"""

from schemas.settings.backends import CelerySettings, MlflowSettings, StoreSettings
from schemas.settings.deployer import AgentSettings, DeployerSettings, RetentionSettings
from schemas.settings.gate import (
    AlarmSettings,
    EpisodeSuiteSettings,
    GateSettings,
    GateSuite,
    OfflineSuiteSettings,
    OpeSettings,
    RetentionSuiteSettings,
    TrafficSettings,
)
from schemas.settings.gateway import GatewaySettings, LimitsSettings
from schemas.settings.judge import DEFAULT_RUBRIC, JudgeSettings
from schemas.settings.kafka import KafkaSettings
from schemas.settings.labeler import LabelerSettings
from schemas.settings.losses import (
    LOSS_TYPES,
    CispoLoss,
    DapoLoss,
    DpoLoss,
    DrGrpoLoss,
    GrpoLoss,
    GspoLoss,
    LossSettings,
    PpoLoss,
    RftLoss,
)
from schemas.settings.root import (
    Settings,
    SettingsError,
    embedded_databases,
    load_settings,
    local_postgres_url,
    to_env,
)
from schemas.settings.section import Section
from schemas.settings.services import PostgresSettings, ServicesSettings
from schemas.settings.telemetry import MetricsSettings
from schemas.settings.trainer import MAX_KL_DEFAULT, LoraSettings, ReplaySettings, TrainerSettings
from schemas.settings.vllm import VllmSettings

__all__ = [
    "DEFAULT_RUBRIC",
    "LOSS_TYPES",
    "MAX_KL_DEFAULT",
    "AgentSettings",
    "AlarmSettings",
    "CelerySettings",
    "CispoLoss",
    "DapoLoss",
    "DeployerSettings",
    "DpoLoss",
    "DrGrpoLoss",
    "GateSettings",
    "GateSuite",
    "GatewaySettings",
    "GrpoLoss",
    "GspoLoss",
    "JudgeSettings",
    "KafkaSettings",
    "LabelerSettings",
    "LimitsSettings",
    "LoraSettings",
    "ReplaySettings",
    "LossSettings",
    "MetricsSettings",
    "MlflowSettings",
    "OfflineSuiteSettings",
    "OpeSettings",
    "PostgresSettings",
    "PpoLoss",
    "RetentionSettings",
    "RetentionSuiteSettings",
    "RftLoss",
    "Section",
    "ServicesSettings",
    "Settings",
    "SettingsError",
    "StoreSettings",
    "TrafficSettings",
    "EpisodeSuiteSettings",
    "TrainerSettings",
    "VllmSettings",
    "embedded_databases",
    "load_settings",
    "local_postgres_url",
    "to_env",
]
