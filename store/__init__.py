"""The SQL store of events, labelled episodes and training cycles: the only code that speaks SQL.

PostgreSQL or SQLite by URL (``settings.store.url``: by default the local PostgreSQL of
``rtrl services up`` for ``rtrl run`` and the operator commands, a SQLite file for ``rtrl demo``);
the schema is the Alembic migrations in ``store/migrations``. A typed store per consumer, each a
context manager on the process's one engine of its URL (store/base.py, store/engines.py), and
`Store`, all of them in one (store/db.py):

- the labeler writes a batch through `LabellingStore.labelling` (events, dead letters, join, settle);
- the trainer leases cycles (`CycleStore.acquire_cycle`, ...) and reads batches
  (`EpisodeStore.select_episodes`, `EpisodeStore.mark_used`); an episode of too many failed cycles
  is quarantined, and operators list and release it (`EpisodeStore.quarantined`, `release_quarantined`);
- the deployer takes servers out of rotation and the gateways read it (`DeployStore.set_rotation`,
  `DeployStore.rotation`), holds its locks across hosts (`DeployStore.exclusive`, store/locks.py)
  and keeps the weight digests it verifies swaps against (`DeployStore.record_digests`);
- the deployer records the live canary (`CanaryStore.start_canary`, one running at a time,
  `CanaryStore.end_canary`) and reads the rated live episodes it judges (`CanaryStore.live_episodes`);
  operators ask it to stop (`CanaryStore.request_canary_stop`); the gateways record what they
  saw of its requests per arm (`CanaryStore.record_canary_traffic`, read by `CanaryStore.canary_traffic`);
- the gateways load API keys (`TenantStore.api_keys`);
- operators read `ReportStore.stats`, ``rtrl report``'s numbers (`ReportStore.report`),
  `CycleStore.recent_cycles`, the reconciliation counts, and prune (`RetentionStore.prune`).

Importing this package imports SQLAlchemy but neither torch nor Kafka.
"""

from store.base import StoreBase
from store.canaries import ArmTraffic, CanaryRecord, CanaryStore, LiveEpisode
from store.caps import Caps
from store.cycles import CycleRecord, CycleStore
from store.db import Store
from store.deploys import DeployStore, LockHolder, RotationRecord
from store.episodes import Correction, EpisodeStore, QuarantinedEpisode, TrainingEpisode, TrainingSegment
from store.errors import (
    CanaryRunning,
    DatabaseError,
    DatabaseUnavailable,
    EpisodesUnavailable,
    LeaseLost,
    LockBusy,
    StoreError,
    StoreNotMigrated,
    UnsupportedStoreUrl,
)
from store.events import BatchWrite, Rejected, SourceRecord
from store.labelling import DeadLetterEntry, Labelling, LabellingStore
from store.promotions import PromotionRecord, PromotionStore
from store.reports import CycleRow, ReportRows, ReportStore, TenantRow, VersionRow
from store.retention import RetentionStore
from store.settle import Settled, SettleReport
from store.tenants import ApiKeyRecord, TenantRecord, TenantStore

__all__ = [
    "ApiKeyRecord",
    "ArmTraffic",
    "BatchWrite",
    "CanaryRecord",
    "CanaryRunning",
    "CanaryStore",
    "Caps",
    "Correction",
    "CycleRecord",
    "CycleRow",
    "CycleStore",
    "DatabaseError",
    "DatabaseUnavailable",
    "DeadLetterEntry",
    "DeployStore",
    "EpisodeStore",
    "EpisodesUnavailable",
    "Labelling",
    "LabellingStore",
    "LeaseLost",
    "LiveEpisode",
    "LockBusy",
    "LockHolder",
    "PromotionRecord",
    "PromotionStore",
    "QuarantinedEpisode",
    "Rejected",
    "ReportRows",
    "ReportStore",
    "RetentionStore",
    "RotationRecord",
    "SettleReport",
    "Settled",
    "SourceRecord",
    "Store",
    "StoreBase",
    "StoreError",
    "StoreNotMigrated",
    "TenantRecord",
    "TenantRow",
    "TenantStore",
    "TrainingEpisode",
    "TrainingSegment",
    "UnsupportedStoreUrl",
    "VersionRow",
]
