"""The SQL store of events, labelled episodes and training cycles: the only code that speaks SQL.

PostgreSQL or SQLite by URL (``settings.store.url``: by default the local PostgreSQL of
``rtrl services up`` for ``rtrl run`` and the operator commands, a SQLite file for ``rtrl demo``);
the schema is the Alembic migrations in ``store/migrations``. Open one `Store` per process and pass it down:

- the labeler writes a batch through `Store.labelling` (events, dead letters, join, settle);
- the trainer leases cycles and reads batches (`Store.acquire_cycle`, `Store.select_episodes`, ...);
- the deployer takes servers out of rotation and the gateways read it (`Store.set_rotation`,
  `Store.rotation`), holds its locks across hosts (`Store.exclusive`, store/locks.py) and keeps
  the weight digests it verifies swaps against (`Store.record_digests`);
- operators read `Store.stats`, `Store.recent_cycles` and the reconciliation counts.

Importing this package imports SQLAlchemy but neither torch nor Kafka.
"""

from store.db import (
    ApiKeyRecord,
    CycleRecord,
    DeadLetterEntry,
    LockHolder,
    RotationRecord,
    Store,
    TenantRecord,
    TrainingEpisode,
    TrainingSegment,
)
from store.errors import (
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
from store.settle import Settled, SettleReport

__all__ = [
    "ApiKeyRecord",
    "BatchWrite",
    "CycleRecord",
    "DatabaseError",
    "DatabaseUnavailable",
    "DeadLetterEntry",
    "EpisodesUnavailable",
    "LeaseLost",
    "LockBusy",
    "LockHolder",
    "Rejected",
    "RotationRecord",
    "SettleReport",
    "Settled",
    "SourceRecord",
    "Store",
    "StoreError",
    "StoreNotMigrated",
    "TenantRecord",
    "TrainingEpisode",
    "TrainingSegment",
    "UnsupportedStoreUrl",
]
