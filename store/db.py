"""The SQL store of events, labelled episodes and training cycles (SQLite default, PostgreSQL by URL).

``Store(settings.store.url)`` opens it; ``Store.migrate()`` brings the schema to the newest Alembic
revision (shipped in ``store/migrations``); commands that only read call ``check_schema()`` instead,
so a read never changes the schema. Several processes share one store: the labeler writes events
and episodes (`Store.labelling`), the trainer leases cycles and reads batches, operators read
stats and cycles. On
SQLite that works through WAL journaling, a busy timeout, and ``BEGIN IMMEDIATE`` transactions
(writers queue up front instead of failing when a read lock cannot be upgraded).

Policy versions are ``int`` in this API and ``"vN"`` in the tables (schemas/versions.py).

The trainer's contract (docs/internals.md):

* ``acquire_cycle`` / ``heartbeat_cycle`` / ``finish_cycle``: at most one *active* cycle (status
  ``running`` or ``registered``, i.e. training, or registered and waiting for gate/deploy). A cycle
  whose lease expired is marked ``failed`` by the next ``acquire_cycle`` and its episodes released.
  A unique ``active_slot`` column makes this hold inside the database, so two workers racing on
  PostgreSQL cannot both win.
* ``select_episodes`` then ``mark_used``: selection only reads; ``mark_used`` claims the episodes
  for the cycle in one conditional UPDATE and fails (claiming none) if any is already claimed, so
  an episode is never used by two cycles. ``finish_cycle(.., "failed")`` releases the claims (the
  data was not learnt from); ``rejected`` keeps them (a model was trained on them and judged), so
  a rejected batch is not retrained forever.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, delete, event, exists, func, select, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, IntegrityError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from schemas.clock import Clock, utcnow
from schemas.events import FeedbackEvent, InteractionEvent, SamplingParams
from schemas.keys import check_tenant, hash_key, key_prefix, new_key
from schemas.rewards import NO_FEEDBACK, RewardSpec
from schemas.versions import format_version, parse_version
from store import events, locks, settle
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
from store.models import (
    ACTIVE_CYCLE_STATUSES,
    FINAL_CYCLE_STATUSES,
    ApiKey,
    Cycle,
    DeadLetter,
    DeployLockHolder,
    Episode,
    Feedback,
    GateDecisionRow,
    Interaction,
    LabelerProgress,
    RecordedDigests,
    ServerRotation,
    Tenant,
    VersionHistory,
)

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
CYCLE_STATUSES = ACTIVE_CYCLE_STATUSES + FINAL_CYCLE_STATUSES
# Which status a cycle may move to from where it is (a final status never changes).
_TRANSITIONS = {
    "running": {"registered", "promoted", "rejected", "failed", "skipped"},
    "registered": {"promoted", "rejected", "failed"},
}
_ACTIVE_SLOT = 1


@dataclass(frozen=True)
class TrainingSegment:
    """One model call of an episode, as the trainer needs it (no torch here)."""

    prompt: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    trainable: bool
    role: str
    policy_version: int
    sampling: SamplingParams = field(default_factory=SamplingParams)  # how it was sampled (schemas/sampling.py)


@dataclass(frozen=True)
class TrainingEpisode:
    """A settled, labelled episode: its reward and its segments ordered by segment_index."""

    episode_id: str
    reward: float
    policy_version: int
    created_at: datetime
    segments: list[TrainingSegment]
    no_feedback: bool = False  # settled by the window with no signal at all (reward component no_feedback)
    components: dict[str, float] = field(default_factory=dict)  # the reward's components (schemas/rewards.py)
    metrics: dict[str, Any] = field(default_factory=dict)  # what its structure says (schemas/episodes.py)


@dataclass(frozen=True)
class CycleRecord:
    """A training cycle as the store holds it (what `rtrl train status` prints)."""

    id: int
    status: str
    owner: str
    lease_expires_at: datetime
    champion: int
    challenger: int | None
    started_at: datetime
    finished_at: datetime | None
    episode_ids: list[str] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    reward_spec: str | None = None  # the spec of the episodes it trained on (`Store.mark_used`)


@dataclass(frozen=True)
class ApiKeyRecord:
    """An API key as the store holds it (never the key itself)."""

    id: int
    key_hash: str
    prefix: str
    role: str  # tenant | admin
    tenant: str | None
    name: str
    rate_per_s: float | None
    created_at: datetime
    revoked_at: datetime | None


@dataclass(frozen=True)
class TenantRecord:
    tenant: str
    trains: bool
    train_redacted: bool
    created_at: datetime


@dataclass(frozen=True)
class RotationRecord:
    url: str
    in_rotation: bool
    reason: str
    updated_at: datetime
    version: int | None = None  # the weight version the deployer says it serves; None: changing or unknown
    epoch: int = 0  # grows on every announcement of `version`


@dataclass(frozen=True)
class LockHolder:
    """Who holds a deploy lock, as it recorded itself (`Store.exclusive`, `Store.lock_holders`)."""

    name: str
    holder: str  # host:pid
    purpose: str
    acquired_at: datetime
    held: bool | None = None  # lock_holders: whether the lock is held now (False: a stale row); None: unknown

    def __str__(self) -> str:
        return f"{self.holder}" + (f" ({self.purpose})" if self.purpose else "") + f" since {self.acquired_at.isoformat()}"


@dataclass(frozen=True)
class DeadLetterEntry:
    """A stored dead letter (what `rtrl dlq` lists and shows)."""

    event_id: str
    source: str
    original_event_id: str | None
    reason: str
    payload: bytes
    created_at: datetime
    source_topic: str | None
    replayed_at: datetime | None


class Labelling:
    """One labeler batch: everything `Store.labelling` commits (or rolls back) together."""

    def __init__(self, session: Session, dialect: str, now: datetime) -> None:
        self._session = session
        self._dialect = dialect
        self.now = now

    def write_events(
        self, parsed: Sequence[tuple[events.SourceRecord, events.Event | events.Rejected]]
    ) -> events.BatchWrite:
        """Insert the valid events idempotently and the dead letters; see store/events.py."""
        return events.write_events(self._session, parsed, self.now)

    def join_and_settle(
        self, spec: RewardSpec, interactions: list[InteractionEvent], feedback: list[FeedbackEvent]
    ) -> settle.SettleReport:
        """Open episodes, join feedback, settle on terminal feedback; see store/settle.py."""
        return settle.join_and_settle(self._session, self._dialect, spec, self.now, interactions, feedback)

    def join_stranded(self, spec: RewardSpec, window_s: float) -> settle.SettleReport:
        """Join feedback left unjoined by two replicas' concurrent writes; see store/settle.py."""
        return settle.join_stranded(self._session, self._dialect, spec, self.now, window_s)

    def settle_expired(self, spec: RewardSpec, window_s: float) -> list[settle.Settled]:
        """Settle open episodes whose last event is older than the window; returns them."""
        return settle.settle_expired(self._session, spec, self.now, window_s)

    def awaiting_judge(self, limit: int) -> list[settle.ToJudge]:
        """Closed episodes waiting for the judge of the reward spec; see store/settle.py."""
        return settle.awaiting_judge(self._session, limit)

    def settle_judged(self, spec: RewardSpec, grades: dict[str, float | None]) -> list[settle.Settled]:
        """Settle judging episodes with their grades (None: the judge failed); see store/settle.py."""
        return settle.settle_judged(self._session, spec, self.now, grades)


class Store:
    """Handle on the SQL store. Thread-safe; open one per process.

    ``clock`` is the time lease expiry and orphan counts are measured on (tests move it).
    """

    def __init__(self, url: str, *, busy_timeout_s: float = 30.0, clock: Clock = utcnow) -> None:
        self.url = url
        self.clock = clock
        try:
            parsed = make_url(url)
        except ArgumentError:
            raise UnsupportedStoreUrl(
                f"store URL {url!r} is not a database URL; set RTRL_STORE__URL to sqlite:///PATH or "
                "postgresql+psycopg://USER@HOST:PORT/DB"
            ) from None
        self.dialect = parsed.get_backend_name()
        if self.dialect == "sqlite":
            if parsed.database and parsed.database != ":memory:":
                Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
            self.engine: Engine = create_engine(url, connect_args={"timeout": busy_timeout_s})
            _configure_sqlite(self.engine, busy_timeout_s)
        elif self.dialect == "postgresql":
            # No server-side prepared statements: a prepared IN-list query gets a generic plan that
            # cannot hash the list and scans the table (the labeler's lookups went from 5 ms to 200 ms
            # as the tables grew; bench/bench_labeler.py), and a pooler in transaction mode (PgBouncer)
            # cannot hold them anyway.
            self.engine = create_engine(url, pool_pre_ping=True, connect_args={"prepare_threshold": None})
            # An executemany INSERT without ON CONFLICT goes as multi-row INSERTs (one statement per
            # page of rows) rather than psycopg's one statement per row, as the psycopg2 dialect does;
            # the labeler's batches (with ON CONFLICT) go through store/bulk.py instead.
            self.engine.dialect.use_insertmanyvalues_wo_returning = True
        else:
            raise UnsupportedStoreUrl(
                f"unsupported store URL {parsed.render_as_string(hide_password=True)!r}; set RTRL_STORE__URL "
                "to sqlite:///PATH or postgresql+psycopg://USER@HOST:PORT/DB"
            )
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._local_locks: dict[str, threading.Lock] = {}  # an in-memory SQLite store's locks (store/locks.py)

    def close(self) -> None:
        self.engine.dispose()

    # ---- schema ---------------------------------------------------------------------------------

    def _alembic_config(self) -> Any:
        from alembic.config import Config

        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS_DIR))
        return config

    def migrate(self, revision: str = "head") -> None:
        """Run the Alembic migrations up to ``revision`` (idempotent; safe from several processes)."""
        from alembic import command

        config = self._alembic_config()
        try:
            with self.engine.begin() as connection:
                if self.dialect == "postgresql":
                    # Two processes starting at once must not both create the tables.
                    connection.exec_driver_sql("SELECT pg_advisory_xact_lock(7215031)")
                config.attributes["connection"] = connection
                command.upgrade(config, revision)
        except DBAPIError as exc:
            raise self._database_error(exc) from exc

    def check_schema(self) -> None:
        """Raise StoreNotMigrated unless the database is at the newest revision. Never migrates,
        and never creates a SQLite file that is not there."""
        from alembic.runtime.migration import MigrationContext
        from alembic.script import ScriptDirectory

        head = ScriptDirectory.from_config(self._alembic_config()).get_current_head()
        parsed = make_url(self.url)
        where = parsed.render_as_string(hide_password=True)
        if self.dialect == "sqlite" and parsed.database and not Path(parsed.database).exists():
            # Connecting would create an empty database file: a read must not leave one behind.
            raise StoreNotMigrated(f"the store {where} does not exist; run `rtrl labeler migrate` (or `rtrl run`)")
        try:
            with self.engine.connect() as connection:
                current = MigrationContext.configure(connection).get_current_revision()
        except DBAPIError as exc:
            raise self._database_error(exc) from exc
        if current != head:
            found = "no rtrl tables" if current is None else f"revision {current}, not {head}"
            raise StoreNotMigrated(f"the store at {where} has {found}; run `rtrl labeler migrate` (or `rtrl run`)")

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """A session in one transaction: committed on success, rolled back on any exception.

        A failure of the database itself (a driver error: unreachable, locked, a raced constraint)
        leaves as `DatabaseError`, so callers decide on retries without knowing SQLAlchemy. For the
        store package itself and for tests that inspect rows; other packages call the methods below.
        """
        try:
            with self._sessions() as session, session.begin():
                yield session
        except DBAPIError as exc:
            raise self._database_error(exc) from exc

    def _database_error(self, exc: DBAPIError) -> DatabaseError | StoreNotMigrated:
        detail = " ".join(f"{type(exc.orig).__name__}: {exc.orig}".split())[:1000]  # drivers write several lines
        where = make_url(self.url).render_as_string(hide_password=True)
        if "no such table" in detail or "UndefinedTable" in detail or "no such column" in detail:
            return StoreNotMigrated(f"the store at {where} lacks rtrl's tables ({detail}); run `rtrl labeler migrate`")
        if str(getattr(exc.orig, "sqlstate", "") or "").startswith("40"):
            # Deadlock or serialization failure: it raced another writer (a labeler replica); the
            # transaction was rolled back whole, and running it again is the remedy.
            return DatabaseUnavailable(f"the store at {where} rolled the transaction back after a conflict ({detail})")
        if isinstance(exc, OperationalError | InterfaceError):
            return DatabaseUnavailable(
                f"the store at {where} is unreachable or locked ({detail}); is it up? "
                "(`rtrl services up` starts the local one; `rtrl services status`; or set RTRL_STORE__URL)"
            )
        return DatabaseError(detail)

    @contextmanager
    def labelling(self, now: datetime) -> Iterator[Labelling]:
        """The labeler's unit of work: one transaction, committed when the block exits cleanly."""
        with self.transaction() as session:
            yield Labelling(session, self.dialect, now)

    # ---- training cycles ------------------------------------------------------------------------

    def trained_cycles(self, spec_id: str) -> int:
        """Cycles that trained a version (registered, promoted or rejected) on episodes of the reward
        spec `spec_id`: the k of that spec's PARL λ schedule (`settle.trained_cycles`)."""
        with self.transaction() as session:
            return settle.trained_cycles(session, spec_id)

    def acquire_cycle(self, owner: str, ttl_s: float, champion: int) -> int | None:
        """Start a cycle training from version `champion`; its id, or None when another cycle holds the lease."""
        now = self.clock()
        try:
            with self.transaction() as session:
                active = session.scalars(select(Cycle).where(Cycle.status.in_(ACTIVE_CYCLE_STATUSES))).all()
                for cycle in active:
                    if cycle.lease_expires_at > now:
                        return None
                    self._end_cycle(
                        session,
                        cycle.id,
                        "failed",
                        now,
                        error=f"lease expired at {cycle.lease_expires_at.isoformat()}",
                    )
                cycle = Cycle(
                    status="running",
                    owner=owner,
                    lease_expires_at=now + timedelta(seconds=ttl_s),
                    champion_version=format_version(champion),
                    started_at=now,
                    active_slot=_ACTIVE_SLOT,
                )
                session.add(cycle)
                session.flush()
                return cycle.id
        except DatabaseError as exc:
            if isinstance(exc.__cause__, IntegrityError):
                return None  # another worker inserted its active cycle between our read and our insert
            raise

    def reclaim_cycle(self, owner_suffix: str, reason: str) -> int | None:
        """Fail the active cycle whose owner ends with ``:owner_suffix`` and release its episodes.

        For a job delivered again after its worker died (the suffix is the Celery task id, which
        acks_late redelivers unchanged): the old cycle's lease is still valid but nobody runs it,
        so it ends now and the cycle re-runs instead of waiting for the lease to expire.
        Returns the failed cycle's id, or None when there was none.
        """
        with self.transaction() as session:
            active = session.scalars(select(Cycle).where(Cycle.status.in_(ACTIVE_CYCLE_STATUSES))).all()
            for cycle in active:
                if cycle.owner.endswith(f":{owner_suffix}"):
                    self._end_cycle(session, cycle.id, "failed", self.clock(), error=reason)
                    return cycle.id
        return None

    def expire_cycles(self) -> list[int]:
        """Fail every active cycle whose lease has expired and release its episodes; their ids.

        A lease expires when its worker stopped renewing it: the process died (SIGKILL, OOM, the
        machine) or hung. Called before anything counts trainable episodes, so that episodes a
        dead cycle claimed go back to the pool at once instead of blocking the next cycle.
        """
        now = self.clock()
        with self.transaction() as session:
            active = session.scalars(select(Cycle).where(Cycle.status.in_(ACTIVE_CYCLE_STATUSES))).all()
            expired = [c for c in active if c.lease_expires_at <= now]
            for cycle in expired:
                self._end_cycle(session, cycle.id, "failed", now,
                                error=f"lease expired at {cycle.lease_expires_at.isoformat()}: its worker "
                                f"({cycle.owner}) stopped renewing it")  # fmt: skip
            return [c.id for c in expired]

    def renew_lease(self, owner: str, ttl_s: float) -> int | None:
        """Extend the lease of the active cycle `owner` holds; its id, or None when it holds none."""
        with self.transaction() as session:
            cycle = session.scalars(
                select(Cycle).where(Cycle.status.in_(ACTIVE_CYCLE_STATUSES), Cycle.owner == owner)
            ).first()
            if cycle is None:
                return None
            cycle.lease_expires_at = self.clock() + timedelta(seconds=ttl_s)
            return cycle.id

    def heartbeat_cycle(self, cycle_id: int, ttl_s: float) -> None:
        """Extend the lease; raises LeaseLost if the cycle is no longer active."""
        with self.transaction() as session:
            result = session.execute(
                update(Cycle)
                .where(Cycle.id == cycle_id, Cycle.status.in_(ACTIVE_CYCLE_STATUSES))
                .values(lease_expires_at=self.clock() + timedelta(seconds=ttl_s))
            )
            if result.rowcount != 1:  # type: ignore[attr-defined]
                raise LeaseLost(f"cycle {cycle_id} is not active")

    def finish_cycle(
        self,
        cycle_id: int,
        status: str,
        challenger: int | None = None,
        metrics: dict[str, Any] | None = None,
        error: str | None = None,
    ) -> None:
        """Move a cycle to ``registered`` (still active) or a final status (promoted/rejected/failed)."""
        if status not in CYCLE_STATUSES or status == "running":
            raise ValueError(f"cannot finish a cycle as {status!r}; use one of {CYCLE_STATUSES[1:]}")
        with self.transaction() as session:
            cycle = session.get(Cycle, cycle_id, with_for_update=True)
            if cycle is None:
                raise LeaseLost(f"cycle {cycle_id} does not exist")
            if cycle.status == status and status in FINAL_CYCLE_STATUSES:
                return  # a retried finish is a no-op
            if status not in _TRANSITIONS.get(cycle.status, set()):
                raise LeaseLost(f"cycle {cycle_id} is {cycle.status}; cannot move it to {status}")
            if challenger is not None:
                cycle.challenger_version = format_version(challenger)
            if metrics is not None:
                cycle.metrics = {**(cycle.metrics or {}), **metrics}
            if status == "registered":
                cycle.status = status
            else:
                self._end_cycle(session, cycle_id, status, self.clock(), error=error)

    @staticmethod
    def _end_cycle(session: Session, cycle_id: int, status: str, now: datetime, error: str | None) -> None:
        values: dict[str, Any] = {"status": status, "finished_at": now, "active_slot": None}
        if error is not None:
            values["error"] = error
        session.execute(update(Cycle).where(Cycle.id == cycle_id).values(**values))
        if status == "failed":
            session.execute(
                update(Episode).where(Episode.used_in_cycle == cycle_id).values(used_in_cycle=None)
            )

    def get_cycle(self, cycle_id: int) -> CycleRecord | None:
        with self.transaction() as session:
            cycle = session.get(Cycle, cycle_id)
            return None if cycle is None else _record(cycle)

    def recent_cycles(self, limit: int) -> list[CycleRecord]:
        """The newest `limit` cycles, newest first."""
        with self.transaction() as session:
            return [_record(c) for c in session.scalars(select(Cycle).order_by(Cycle.id.desc()).limit(limit))]

    def last_cycle_started_at(self, statuses: tuple[str, ...]) -> datetime | None:
        """When the newest cycle that ended in one of `statuses` started; None when there is none."""
        with self.transaction() as session:
            # max() keeps the column's type, so the value comes back as an aware UTC datetime.
            return session.scalar(select(func.max(Cycle.started_at)).where(Cycle.status.in_(statuses)))

    def active_cycles(self) -> list[CycleRecord]:
        """Cycles holding an unexpired lease (running, or registered and waiting for gate/deploy)."""
        now = self.clock()
        with self.transaction() as session:
            rows = session.scalars(select(Cycle).where(Cycle.status.in_(ACTIVE_CYCLE_STATUSES))).all()
            return [_record(c) for c in rows if c.lease_expires_at > now]

    # ---- training data --------------------------------------------------------------------------

    def _trainable(
        self, champion_number: int, max_lag: int, spec_id: str | None, settle_window_s: float | None,
        holdout_percent: int = 0,
    ) -> Any:
        tenant_off = exists(select(Tenant.tenant).where(Tenant.tenant == Episode.tenant, Tenant.trains.is_(False)))
        condition = (
            (Episode.status == "settled")
            & Episode.used_in_cycle.is_(None)
            & self._within_lag(champion_number, max_lag)
            & ~tenant_off  # a tenant switched off does not train (a tenant without a row does)
        )
        if spec_id is not None:  # rewards of different spec versions never share a batch
            condition &= Episode.reward_spec == spec_id
        if holdout_percent > 0:  # the eval gate's held-out traffic (`select_heldout`) never trains
            condition &= Episode.eval_bucket.is_(None) | (Episode.eval_bucket >= holdout_percent)
        if settle_window_s is not None:
            # Every episode becomes trainable by the same rule whatever its outcome: the settle window
            # after its last event. Terminal feedback (a rejection) settles an episode early, a plain
            # acceptance waits for the window; selecting on settlement alone would over-sample the
            # early-settling outcomes into the newest batch.
            condition &= Episode.last_event_at <= self.clock() - timedelta(seconds=settle_window_s)
        return condition

    def _within_lag(self, champion_number: int, max_lag: int) -> Any:
        """The champion's episodes and those of the `max_lag` versions served most recently before
        it (`served_versions`): a challenger that never served is not a version of lag. On a store
        the deployer never announced a version in, the lag counts version numbers."""
        if max_lag == 0:
            return Episode.policy_number == champion_number
        served = [v for v in self.served_versions() if v != champion_number]
        if not served:
            return Episode.policy_number.between(champion_number - max_lag, champion_number)
        return Episode.policy_number.in_([champion_number, *served[:max_lag]])

    def count_trainable(
        self, champion_number: int, max_lag: int, *, spec_id: str | None = None, settle_window_s: float | None = None,
        holdout_percent: int = 0,
    ) -> int:
        """Settled, unused episodes whose policy is at most ``max_lag`` versions behind the champion;
        with `spec_id`, labelled under that reward spec only; with `settle_window_s`, only those
        whose last event is at least that old; never the held-out buckets below `holdout_percent`
        (the trainer passes all three)."""
        with self.transaction() as session:
            query = select(func.count()).select_from(Episode).where(
                self._trainable(champion_number, max_lag, spec_id, settle_window_s, holdout_percent)
            )
            return int(session.scalar(query) or 0)

    def select_episodes(
        self,
        champion_number: int,
        max_lag: int,
        limit: int,
        *,
        spec_id: str | None = None,
        settle_window_s: float | None = None,
        holdout_percent: int = 0,
    ) -> list[TrainingEpisode]:
        """The newest ``limit`` trainable episodes (as `count_trainable`) with their segments (late
        segments excluded)."""
        with self.transaction() as session:
            episodes = session.scalars(
                select(Episode)
                .where(self._trainable(champion_number, max_lag, spec_id, settle_window_s, holdout_percent))
                .order_by(Episode.first_event_at.desc(), Episode.episode_id)
                .limit(limit)
            ).all()
            return self._with_segments(session, list(episodes))

    def select_heldout(self, limit: int, *, spec_id: str, holdout_percent: int) -> list[TrainingEpisode]:
        """The newest ``limit`` settled episodes of the eval gate's held-out buckets (below
        `holdout_percent`, never trained on), labelled under `spec_id`, of tenants that train, with
        their segments: the logged traffic the gate's off-policy estimate reweights."""
        if holdout_percent <= 0:
            return []
        tenant_off = exists(select(Tenant.tenant).where(Tenant.tenant == Episode.tenant, Tenant.trains.is_(False)))
        with self.transaction() as session:
            episodes = session.scalars(
                select(Episode)
                .where(
                    Episode.status == "settled",
                    Episode.reward_spec == spec_id,
                    Episode.eval_bucket < holdout_percent,
                    Episode.used_in_cycle.is_(None),
                    ~tenant_off,
                )
                .order_by(Episode.first_event_at.desc(), Episode.episode_id)
                .limit(limit)
            ).all()
            return self._with_segments(session, list(episodes))

    def count_heldout(self, *, spec_id: str, holdout_percent: int) -> int:
        """Settled episodes of the held-out buckets labelled under `spec_id` (as `select_heldout`)."""
        if holdout_percent <= 0:
            return 0
        with self.transaction() as session:
            query = select(func.count()).select_from(Episode).where(
                Episode.status == "settled", Episode.reward_spec == spec_id, Episode.eval_bucket < holdout_percent,
                Episode.used_in_cycle.is_(None),
            )  # fmt: skip
            return int(session.scalar(query) or 0)

    def _with_segments(self, session: Session, episodes: list[Episode]) -> list[TrainingEpisode]:
        """`episodes` as TrainingEpisodes with their segments (late segments excluded)."""
        ids = [e.episode_id for e in episodes]
        segments: dict[str, list[TrainingSegment]] = {i: [] for i in ids}
        redacted_ok = set(
            session.scalars(
                select(Tenant.tenant).where(
                    Tenant.tenant.in_({e.tenant for e in episodes}), Tenant.train_redacted.is_(True)
                )
            )
        )
        rows = session.scalars(
            select(Interaction)
            .where(Interaction.episode_id.in_(ids), Interaction.late.is_(False))
            .order_by(Interaction.episode_id, Interaction.segment_index)
        ).all()
        for row in rows:
            # Redacted text still lives in the token ids: such a segment trains only where allowed.
            trainable = row.trainable and (not row.redacted or row.tenant in redacted_ok)
            segments[row.episode_id].append(
                TrainingSegment(
                    prompt=row.prompt,
                    prompt_token_ids=list(row.prompt_token_ids),
                    completion_token_ids=list(row.completion_token_ids),
                    completion_logprobs=list(row.completion_logprobs),
                    trainable=trainable,
                    role=row.role,
                    policy_version=row.policy_number,
                    sampling=SamplingParams.model_validate(row.sampling or {}),
                )
            )
        return [
            TrainingEpisode(
                episode_id=e.episode_id,
                reward=float(e.reward if e.reward is not None else 0.0),
                policy_version=e.policy_number,
                created_at=e.first_event_at,
                segments=segments[e.episode_id],
                no_feedback=NO_FEEDBACK in (e.reward_components or {}),
                components=dict(e.reward_components or {}),
                metrics=dict(e.metrics or {}),
            )
            for e in episodes
        ]

    def mark_used(self, cycle_id: int, episode_ids: Sequence[str]) -> None:
        """Claim episodes for an active cycle, all or none; raises EpisodesUnavailable or LeaseLost.

        Records on the cycle the reward spec its episodes were labelled under (``cycles.reward_spec``;
        None when they mix specs, which the trainer's selection never does, and then the cycle counts
        for none): what PARL's λ schedule counts (`settle.trained_cycles`), kept when retention prunes
        the episodes."""
        wanted = sorted(set(episode_ids))
        with self.transaction() as session:
            cycle = session.get(Cycle, cycle_id, with_for_update=True)
            if cycle is None or cycle.status not in ACTIVE_CYCLE_STATUSES:
                raise LeaseLost(f"cycle {cycle_id} is not active")
            if cycle.lease_expires_at <= self.clock():
                raise LeaseLost(
                    f"the lease of cycle {cycle_id} expired at {cycle.lease_expires_at.isoformat()}"
                )
            claimed = session.execute(
                update(Episode)
                .where(
                    Episode.episode_id.in_(wanted),
                    Episode.used_in_cycle.is_(None),
                    Episode.status == "settled",
                )
                .values(used_in_cycle=cycle_id)
            ).rowcount  # type: ignore[attr-defined]
            if claimed != len(wanted):
                # Raising rolls the whole UPDATE back: no episode is claimed.
                raise EpisodesUnavailable(
                    f"cycle {cycle_id}: only {claimed} of {len(wanted)} episodes are settled and unused"
                )
            cycle.episode_ids = [*(cycle.episode_ids or []), *wanted]
            specs = set(session.scalars(
                select(Episode.reward_spec).where(Episode.status == "settled", Episode.used_in_cycle == cycle_id)
                .distinct()
            ))  # fmt: skip
            cycle.reward_spec = specs.pop() if len(specs) == 1 else None

    # ---- eval gate decisions ---------------------------------------------------------------------

    def record_gate_decision(
        self, challenger: int, champion: int, passed: bool, reason: str, record: dict[str, Any], decided_at: datetime
    ) -> None:
        """Keep one decision of the eval gate (every run of the gate adds one)."""
        with self.transaction() as session:
            session.add(GateDecisionRow(challenger_version=challenger, champion_version=champion, passed=passed,
                                        reason=reason, record=record, decided_at=decided_at))  # fmt: skip

    def gate_decisions(self, challenger: int) -> list[dict[str, Any]]:
        """The gate's decision records for version `challenger`, newest first."""
        with self.transaction() as session:
            rows = session.scalars(
                select(GateDecisionRow)
                .where(GateDecisionRow.challenger_version == challenger)
                .order_by(GateDecisionRow.id.desc())
            ).all()
            return [dict(row.record) for row in rows]

    # ---- deploy state: recorded weight digests, deploy locks ---------------------------------------

    def record_digests(self, model: str, version: int, digests: dict[str, str]) -> None:
        """Keep the weight digests a verified server reported for `version` of registry model
        `model`, the baseline later swaps to it are checked against; recording again replaces them."""
        values = {"model": model, "version": version, "digests": dict(digests), "recorded_at": self.clock()}
        with self.transaction() as session:
            session.execute(_upsert(self.dialect, RecordedDigests, values, ["model", "version"]))

    def recorded_digests(self, model: str, version: int) -> dict[str, str] | None:
        """The digests recorded for `version` of `model`; None when none were."""
        with self.transaction() as session:
            row = session.get(RecordedDigests, (model, version))
            return None if row is None else dict(row.digests)

    @contextmanager
    def exclusive(self, name: str, purpose: str = "") -> Iterator[LockHolder]:
        """Hold lock `name` for the block, for every process on every host of this store (a
        PostgreSQL advisory lock, or an flock beside the SQLite file: store/locks.py), recording
        this process as its holder. Raises LockBusy at once, naming the holder, when it is held."""
        try:
            release = locks.try_lock(self.engine, self.url, name, self._local_locks)
        except DBAPIError as exc:
            raise self._database_error(exc) from exc
        if release is None:
            raise LockBusy(name, self._holder_text(name))
        try:
            holder = LockHolder(name, locks.this_process(), purpose[:500], self.clock())
            values = {"name": name, "holder": holder.holder, "purpose": holder.purpose, "acquired_at": holder.acquired_at}
            with self.transaction() as session:  # overwrites a row a killed holder left
                session.execute(_upsert(self.dialect, DeployLockHolder, values, ["name"]))
            try:
                yield holder
            finally:
                try:
                    with self.transaction() as session:  # before the lock is released: the next holder's row stays
                        session.execute(delete(DeployLockHolder).where(DeployLockHolder.name == name,
                                                                       DeployLockHolder.holder == holder.holder))  # fmt: skip
                except StoreError as exc:
                    log.warning("the %s lock's holder row stays (%s); the next holder overwrites it", name, exc)
        finally:
            release()

    def _holder_text(self, name: str) -> str | None:
        """The recorded holder of lock `name`, for a LockBusy message (best effort)."""
        try:
            with self.transaction() as session:
                row = session.get(DeployLockHolder, name)
                return None if row is None else str(LockHolder(row.name, row.holder, row.purpose, row.acquired_at))
        except StoreError:
            return None

    def lock_holders(self) -> list[LockHolder]:
        """Every recorded lock holder, with whether its lock is held now (`rtrl status`). A row whose
        lock is free (held False) was left by a holder that was killed; the next holder replaces it."""
        with self.transaction() as session:
            rows = session.scalars(select(DeployLockHolder).order_by(DeployLockHolder.name)).all()
            found = [LockHolder(r.name, r.holder, r.purpose, r.acquired_at) for r in rows]
        try:
            return [replace(h, held=locks.held(self.engine, self.url, h.name, self._local_locks)) for h in found]
        except DBAPIError as exc:
            raise self._database_error(exc) from exc

    # ---- server rotation ---------------------------------------------------------------------------

    def set_rotation(self, url: str, in_rotation: bool, reason: str) -> None:
        """Take a serving vLLM server out of the gateways' rotation, or put it back."""
        url = url.rstrip("/")
        with self.transaction() as session:
            row = session.get(ServerRotation, url, with_for_update=True)
            if row is None:
                row = ServerRotation(url=url, in_rotation=in_rotation, reason=reason[:500], updated_at=self.clock())
                session.add(row)
            row.in_rotation, row.reason, row.updated_at = in_rotation, reason[:500], self.clock()

    def set_serving_version(self, url: str, version: int | None, reason: str) -> int:
        """Announce the weight version a serving vLLM server serves: None before a change (a swap,
        a relabel), the version once it is verified. Returns the row's new version epoch."""
        url = url.rstrip("/")
        with self.transaction() as session:
            row = session.get(ServerRotation, url, with_for_update=True)
            if row is None:
                row = ServerRotation(url=url, in_rotation=True, reason=reason[:500], updated_at=self.clock(),
                                     version_epoch=0)  # fmt: skip
                session.add(row)
            row.serving_version, row.version_epoch = version, (row.version_epoch or 0) + 1
            row.reason, row.updated_at = reason[:500], self.clock()
            if version is not None:
                served = session.get(VersionHistory, version, with_for_update=True)
                if served is None:
                    session.add(VersionHistory(version=version, first_served_at=self.clock(), last_served_at=self.clock()))
                else:
                    served.last_served_at = self.clock()
            return row.version_epoch

    def served_versions(self) -> list[int]:
        """Every version a serving server was announced on, most recently served first."""
        with self.transaction() as session:
            return list(session.scalars(
                select(VersionHistory.version).order_by(VersionHistory.last_served_at.desc(), VersionHistory.version.desc())
            ))  # fmt: skip

    def rotation(self) -> dict[str, RotationRecord]:
        """Every server with a rotation row, by url (a server without one is in rotation)."""
        with self.transaction() as session:
            return {
                r.url: RotationRecord(r.url, r.in_rotation, r.reason, r.updated_at, r.serving_version,
                                      r.version_epoch or 0)  # fmt: skip
                for r in session.scalars(select(ServerRotation))
            }

    # ---- tenants and API keys ---------------------------------------------------------------------

    def set_tenant(self, tenant: str, *, trains: bool | None = None, train_redacted: bool | None = None) -> TenantRecord:
        """Create the tenant if needed (training on, redacted segments off) and apply the switches given."""
        check_tenant(tenant)
        with self.transaction() as session:
            row = session.get(Tenant, tenant, with_for_update=True)
            if row is None:
                row = Tenant(tenant=tenant, trains=True, train_redacted=False, created_at=self.clock())
                session.add(row)
            if trains is not None:
                row.trains = trains
            if train_redacted is not None:
                row.train_redacted = train_redacted
            session.flush()
            return TenantRecord(row.tenant, row.trains, row.train_redacted, row.created_at)

    def tenants(self) -> list[TenantRecord]:
        with self.transaction() as session:
            rows = session.scalars(select(Tenant).order_by(Tenant.tenant))
            return [TenantRecord(r.tenant, r.trains, r.train_redacted, r.created_at) for r in rows]

    def create_api_key(
        self, *, role: str, tenant: str | None, name: str, rate_per_s: float | None = None
    ) -> tuple[ApiKeyRecord, str]:
        """A new key: (its record, the key itself, which is not stored and cannot be shown again).

        A tenant key creates its tenant (training on) when it does not exist yet.
        """
        if role not in ("tenant", "admin") or (role == "tenant") != (tenant is not None):
            raise ValueError(f"a {role} key needs {'a' if role == 'tenant' else 'no'} tenant")
        if tenant is not None:
            self.set_tenant(tenant)
        key = new_key()
        with self.transaction() as session:
            row = ApiKey(
                key_hash=hash_key(key), prefix=key_prefix(key), role=role, tenant=tenant, name=name[:200],
                rate_per_s=rate_per_s, created_at=self.clock(), revoked_at=None,
            )  # fmt: skip
            session.add(row)
            session.flush()
            return _key_record(row), key

    def api_keys(self, include_revoked: bool = False) -> list[ApiKeyRecord]:
        """Keys, oldest first; the gateway loads the active ones (`include_revoked=False`)."""
        with self.transaction() as session:
            query = select(ApiKey).order_by(ApiKey.id)
            if not include_revoked:
                query = query.where(ApiKey.revoked_at.is_(None))
            return [_key_record(r) for r in session.scalars(query)]

    def revoke_api_key(self, key_id: int) -> bool:
        """Revoke a key; False when there is no such active key. Gateways stop accepting it within
        ``gateway.keys_refresh_s``."""
        with self.transaction() as session:
            result = session.execute(
                update(ApiKey).where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None)).values(revoked_at=self.clock())
            )
            return bool(result.rowcount)  # type: ignore[attr-defined]

    # ---- dead letters -----------------------------------------------------------------------------

    def dead_letters(self, limit: int, reason_prefix: str | None = None) -> list[DeadLetterEntry]:
        """The newest dead letters (optionally those whose reason starts with `reason_prefix`)."""
        with self.transaction() as session:
            query = select(DeadLetter).order_by(DeadLetter.created_at.desc(), DeadLetter.event_id).limit(limit)
            if reason_prefix:
                query = query.where(DeadLetter.reason.startswith(reason_prefix, autoescape=True))
            return [_dead_letter_entry(r) for r in session.scalars(query)]

    def dead_letter(self, event_id: str) -> DeadLetterEntry | None:
        with self.transaction() as session:
            row = session.get(DeadLetter, event_id)
            return None if row is None else _dead_letter_entry(row)

    def mark_replayed(self, event_id: str) -> bool:
        """Record that a dead letter was produced again; False when it already was (replay once)."""
        with self.transaction() as session:
            result = session.execute(
                update(DeadLetter)
                .where(DeadLetter.event_id == event_id, DeadLetter.replayed_at.is_(None))
                .values(replayed_at=self.clock())
            )
            return bool(result.rowcount)  # type: ignore[attr-defined]

    # ---- labeler progress (the poison-pill policy of feedback/labeler.py) ---------------------------

    def note_attempt(self, topic: str, partition: int, offset: int, mode: str) -> int:
        """Count one more start of work at `offset` of the partition in `mode` (batch | record);
        returns how many starts there were without the work being committed in between."""
        with self.transaction() as session:
            row = session.get(LabelerProgress, (topic, partition), with_for_update=True)
            if row is None:
                row = LabelerProgress(topic=topic, partition=partition, offset=offset, mode=mode, attempts=0)
                session.add(row)
            if row.offset != offset or row.mode != mode:
                row.offset, row.mode, row.attempts = offset, mode, 0
            row.attempts += 1
            row.updated_at = self.clock()
            return row.attempts

    def note_batch_starts(self, starts: dict[tuple[str, int], int]) -> set[tuple[str, int]]:
        """Note, for each (topic, partition), that a batch starting at the given offset is begun, in
        one transaction; returns the partitions where a labeler died on that start before (the same
        start was noted and never moved on from, as a batch or as a single record)."""
        died: set[tuple[str, int]] = set()
        with self.transaction() as session:
            for (topic, partition), offset in starts.items():
                row = session.get(LabelerProgress, (topic, partition), with_for_update=True)
                if row is None:
                    row = LabelerProgress(topic=topic, partition=partition, offset=offset, mode="batch", attempts=0)
                    session.add(row)
                elif row.offset == offset:
                    died.add((topic, partition))
                    if row.mode == "record":
                        continue  # died on that one record: its own count goes on in note_attempt
                else:
                    row.offset, row.mode, row.attempts = offset, "batch", 0
                row.attempts += 1
                row.updated_at = self.clock()
        return died

    # ---- observability --------------------------------------------------------------------------

    def count_judging(self) -> int:
        """Episodes closed and waiting for the judge of a judged reward spec (feedback/judging.py)."""
        with self.transaction() as session:
            return int(session.scalar(select(func.count()).select_from(Episode).where(Episode.status == "judging")) or 0)

    def stats(self, orphan_after_s: float | None = None) -> dict[str, int]:
        """Row counts per table and status. Feedback still unjoined after ``orphan_after_s`` is orphaned."""
        now = self.clock()
        with self.transaction() as session:

            def count(model: Any, *where: Any) -> int:
                return int(session.scalar(select(func.count()).select_from(model).where(*where)) or 0)

            out = {
                "interactions": count(Interaction),
                "interactions_late": count(Interaction, Interaction.late.is_(True)),
                "feedback": count(Feedback),
                "feedback_joined": count(Feedback, Feedback.joined_episode_id.is_not(None)),
                "feedback_late": count(Feedback, Feedback.late.is_(True)),
                "feedback_unjoined": count(Feedback, Feedback.joined_episode_id.is_(None)),
                "episodes_open": count(Episode, Episode.status == "open"),
                "episodes_judging": count(Episode, Episode.status == "judging"),
                "episodes_settled": count(Episode, Episode.status == "settled"),
                "episodes_settled_terminal": count(
                    Episode, (Episode.status == "settled") & (Episode.settle_reason == "terminal_feedback")
                ),
                "episodes_settled_window": count(Episode, (Episode.status == "settled") & (Episode.settle_reason == "window")),
                "episodes_used": count(Episode, Episode.used_in_cycle.is_not(None)),
                "dead_letters": count(DeadLetter),
            }
            if orphan_after_s is not None:
                cutoff = now - timedelta(seconds=orphan_after_s)
                out["feedback_orphaned"] = count(
                    Feedback, Feedback.joined_episode_id.is_(None), Feedback.ingested_at < cutoff
                )
            for status in CYCLE_STATUSES:
                out[f"cycles_{status}"] = count(Cycle, Cycle.status == status)
            return out


    def source_counts(self, topic: str, partition: int, low: int, high: int) -> tuple[int, int]:
        """(stored, dead-lettered) rows whose source record is offset low..high-1 of the partition."""

        def rows(model: Any) -> int:
            query = (
                select(func.count())
                .select_from(model)
                .where(
                    model.source_topic == topic,
                    model.source_partition == partition,
                    model.source_offset >= low,
                    model.source_offset < high,
                )
            )
            return int(session.scalar(query) or 0)

        with self.transaction() as session:
            return rows(Interaction) + rows(Feedback), rows(DeadLetter)


def _key_record(row: ApiKey) -> ApiKeyRecord:
    return ApiKeyRecord(
        id=row.id, key_hash=row.key_hash, prefix=row.prefix, role=row.role, tenant=row.tenant, name=row.name,
        rate_per_s=row.rate_per_s, created_at=row.created_at, revoked_at=row.revoked_at,
    )  # fmt: skip


def _dead_letter_entry(row: DeadLetter) -> DeadLetterEntry:
    return DeadLetterEntry(
        event_id=row.event_id, source=row.source, original_event_id=row.original_event_id, reason=row.reason,
        payload=bytes(row.payload), created_at=row.created_at, source_topic=row.source_topic,
        replayed_at=row.replayed_at,
    )  # fmt: skip


def _record(cycle: Cycle) -> CycleRecord:
    return CycleRecord(
        id=cycle.id,
        status=cycle.status,
        owner=cycle.owner,
        lease_expires_at=cycle.lease_expires_at,
        champion=parse_version(cycle.champion_version),
        challenger=None if cycle.challenger_version is None else parse_version(cycle.challenger_version),
        started_at=cycle.started_at,
        finished_at=cycle.finished_at,
        episode_ids=list(cycle.episode_ids or []),
        metrics=dict(cycle.metrics or {}),
        error=cycle.error,
        reward_spec=cycle.reward_spec,
    )


def _upsert(dialect: str, model: Any, values: dict[str, Any], keys: list[str]) -> Any:
    """INSERT `values`, or on a conflict over `keys` UPDATE the row to them (SQLite and PostgreSQL)."""
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        statement: Any = pg_insert(model).values(values)
    else:
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        statement = sqlite_insert(model).values(values)
    changed = {name: statement.excluded[name] for name in values if name not in keys}
    return statement.on_conflict_do_update(index_elements=keys, set_=changed)


def _configure_sqlite(engine: Engine, busy_timeout_s: float) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take transaction control away from the sqlite3 module so BEGIN IMMEDIATE below is ours.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        # FULL: offsets are committed right after a DB commit, so that commit must survive power loss.
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")
