"""SQLAlchemy 2 ORM tables of the store. The schema itself is created by the Alembic migrations in
``store/migrations/versions``; a change here needs a new migration (the store's tests check that
the two agree).

Times are UTC. ``created_at`` is the sender's clock (event time); ``ingested_at`` and the episode's
``last_event_at`` are the labeler's clock, which is what the settle window is measured on, so a
client with a skewed clock cannot hold an episode open or close it early.

Every consumed Kafka record ends in exactly one row of ``interactions``, ``feedback`` or
``dead_letters``, and those rows keep the record's ``source_topic/partition/offset``: that is what
lets ``rtrl labeler reconcile`` prove produced = stored + dead-lettered, and what tells a replay of
the same record (no-op) from a second record carrying an already-stored event_id (dead-lettered).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, DateTime, Float, Index, Integer, LargeBinary, String, Text
from sqlalchemy import text as sql_text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

ID = String(200)


class UtcDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every dialect (SQLite stores naive text)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the store; use UTC-aware datetimes")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    pass


class Interaction(Base):
    """One served model call (a segment of an episode), as the gateway published it."""

    __tablename__ = "interactions"

    event_id: Mapped[str] = mapped_column(ID, primary_key=True)
    request_id: Mapped[str] = mapped_column(ID, index=True)
    episode_id: Mapped[str] = mapped_column(ID)
    segment_index: Mapped[int] = mapped_column(Integer)
    tenant: Mapped[str] = mapped_column(ID)
    session_id: Mapped[str | None] = mapped_column(ID)
    model: Mapped[str] = mapped_column(ID)
    policy_version: Mapped[str] = mapped_column(ID)
    policy_number: Mapped[int] = mapped_column(Integer)
    prompt: Mapped[str] = mapped_column(Text)
    prompt_token_ids: Mapped[list[int]] = mapped_column(JSON)
    completion: Mapped[str] = mapped_column(Text)
    completion_token_ids: Mapped[list[int]] = mapped_column(JSON)
    completion_logprobs: Mapped[list[float]] = mapped_column(JSON)
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    sampling: Mapped[dict[str, Any]] = mapped_column(JSON)
    role: Mapped[str] = mapped_column(String(32))
    # Which agent of the episode made the call (a PARL sub-agent's id); None: the main agent.
    agent: Mapped[str | None] = mapped_column(ID)
    trainable: Mapped[bool] = mapped_column(Boolean)
    # Kinds of text the gateway redacted; trained only where the tenant allows (Tenant.train_redacted).
    redacted: Mapped[list[str] | None] = mapped_column(JSON, default=list)  # None on rows older than it
    # Arrived after its episode had settled: kept, but not part of the labelled trajectory.
    late: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    ingested_at: Mapped[datetime] = mapped_column(UtcDateTime)
    source_topic: Mapped[str] = mapped_column(String(249))
    source_partition: Mapped[int] = mapped_column(Integer)
    source_offset: Mapped[int] = mapped_column(BigInteger)

    __table_args__ = (
        # Two different events for one segment would make the trajectory ambiguous: the labeler
        # dead-letters the second; this index is the backstop for concurrent labeler replicas.
        Index("uq_interactions_episode_segment", "episode_id", "segment_index", unique=True),
        Index("ix_interactions_source", "source_topic", "source_partition", "source_offset"),
    )


_NAMED_UNJOINED = sql_text("joined_episode_id IS NULL AND episode_id IS NOT NULL")


class Feedback(Base):
    """One feedback signal, stored as received; ``joined_episode_id`` is set once it is joined."""

    __tablename__ = "feedback"

    event_id: Mapped[str] = mapped_column(ID, primary_key=True)
    request_id: Mapped[str] = mapped_column(ID, index=True)
    episode_id: Mapped[str | None] = mapped_column(ID, index=True)  # as sent by the client
    tenant: Mapped[str] = mapped_column(ID)
    kind: Mapped[str] = mapped_column(String(32))
    value: Mapped[float] = mapped_column(Float)
    # What a correction (or an edit) says, redacted by the gateway; None for every other kind.
    text: Mapped[str | None] = mapped_column(Text)
    joined_episode_id: Mapped[str | None] = mapped_column(ID, index=True)
    # Joined an episode that had already settled: kept and counted, never re-rewarded silently.
    late: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    ingested_at: Mapped[datetime] = mapped_column(UtcDateTime)
    source_topic: Mapped[str] = mapped_column(String(249))
    source_partition: Mapped[int] = mapped_column(Integer)
    source_offset: Mapped[int] = mapped_column(BigInteger)

    __table_args__ = (
        Index("ix_feedback_source", "source_topic", "source_partition", "source_offset"),
        # Unjoined feedback that names an episode, for the window pass (store/settle.py, join_stranded).
        Index(
            "ix_feedback_named_unjoined",
            "ingested_at",
            postgresql_where=_NAMED_UNJOINED,
            sqlite_where=_NAMED_UNJOINED,
        ),
    )


class Episode(Base):
    """A labelled trajectory: open while events arrive, settled with a reward, then used by a cycle."""

    __tablename__ = "episodes"

    episode_id: Mapped[str] = mapped_column(ID, primary_key=True)
    tenant: Mapped[str] = mapped_column(ID)
    # The oldest policy among its segments: lag is measured from the most off-policy tokens.
    policy_version: Mapped[str] = mapped_column(ID)
    policy_number: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(
        String(16)
    )  # open | judging (closed, waiting for the judge) | settled
    first_event_at: Mapped[datetime] = mapped_column(UtcDateTime)  # earliest segment created_at
    last_event_at: Mapped[datetime] = mapped_column(UtcDateTime)  # latest ingest of a joined event
    settled_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    settle_reason: Mapped[str | None] = mapped_column(String(32))  # terminal_feedback | window
    reward: Mapped[float | None] = mapped_column(Float)
    reward_components: Mapped[dict[str, float] | None] = mapped_column(JSON)
    reward_spec: Mapped[str | None] = mapped_column(String(120))
    # What its structure says (schemas/episodes.py) and, under a judged spec, the judge's grade and
    # whether it disagrees with the feedback. Set when it closes; None on rows older than the column.
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    used_in_cycle: Mapped[int | None] = mapped_column(Integer)
    # 0..99 from a hash of episode_id (store/settle.py `eval_bucket`): episodes below
    # ``gate.ope.holdout_percent`` are kept for the eval gate and never trained on. None on rows
    # older than the column (trainable, never held out).
    eval_bucket: Mapped[int | None] = mapped_column(Integer)
    # Failed cycles that had claimed it (store/cycles.py `release_claims`). At
    # ``trainer.max_episode_failures`` it is quarantined instead of released: ``quarantined_at`` set,
    # with the failed cycle's error, and never selected again until an operator releases it
    # (`rtrl dlq episodes --release`; docs/security.md, Poisoned episodes). It stays ``settled``.
    failed_cycles: Mapped[int] = mapped_column(Integer, server_default="0")
    quarantined_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    quarantine_reason: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        Index("ix_episodes_open", "status", "last_event_at"),
        Index("ix_episodes_trainable", "status", "used_in_cycle", "policy_number", "first_event_at"),
    )


class DeadLetter(Base):
    """A record rtrl could not use, with the reason and the original bytes."""

    __tablename__ = "dead_letters"

    event_id: Mapped[str] = mapped_column(ID, primary_key=True)
    source: Mapped[str] = mapped_column(String(300))
    original_event_id: Mapped[str | None] = mapped_column(ID)
    reason: Mapped[str] = mapped_column(Text)
    # Raw bytes, not text: hostile payloads may hold NUL or invalid UTF-8.
    payload: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    source_topic: Mapped[str | None] = mapped_column(String(249))
    source_partition: Mapped[int | None] = mapped_column(Integer)
    source_offset: Mapped[int | None] = mapped_column(BigInteger)
    # `rtrl dlq replay` produced the payload to its topic again (at most once per dead letter).
    replayed_at: Mapped[datetime | None] = mapped_column(UtcDateTime)

    __table_args__ = (Index("ix_dead_letters_source", "source_topic", "source_partition", "source_offset"),)


ACTIVE_CYCLE_STATUSES = ("running", "registered")
# skipped: the batch carried too little signal to train on (trainer.min_signal); its episodes are spent.
FINAL_CYCLE_STATUSES = ("promoted", "rejected", "failed", "skipped")


class Cycle(Base):
    """A training cycle and its lease. At most one cycle is active (running or registered)."""

    __tablename__ = "cycles"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    status: Mapped[str] = mapped_column(String(16))
    owner: Mapped[str] = mapped_column(String(200))
    lease_expires_at: Mapped[datetime] = mapped_column(UtcDateTime)
    champion_version: Mapped[str] = mapped_column(ID)
    challenger_version: Mapped[str | None] = mapped_column(ID)
    started_at: Mapped[datetime] = mapped_column(UtcDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    episode_ids: Mapped[list[str] | None] = mapped_column(JSON)
    # The reward spec (name@version) of the episodes it claimed, set when it claims them: what a PARL
    # spec's λ schedule counts (store/settle.py `trained_cycles`). NULL when it claimed none or mixed specs.
    reward_spec: Mapped[str | None] = mapped_column(String(120))
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    error: Mapped[str | None] = mapped_column(Text)
    # Constant while the cycle is active and NULL afterwards: the unique index on it makes "one
    # active cycle" hold in the database itself, on SQLite and PostgreSQL alike. One slot for every
    # line: the lines' cycles take turns (docs/lora.md, An adapter per tenant).
    active_slot: Mapped[int | None] = mapped_column(Integer, unique=True)
    # The tenant whose adapter line it trained (schemas/lines.py); NULL: the global line.
    line: Mapped[str | None] = mapped_column(String(64))


class ServerRotation(Base):
    """Whether the gateways send users to a vLLM server, and the weight version it serves. A server
    with no row is in rotation and its version unknown here (the gateways read it from the server).

    The deployer takes a server out (and drains it) before it pauses it for a swap, and puts it
    back after. It also announces every weight change: ``serving_version`` is NULL from before the
    pause until the new version is verified, and ``version_epoch`` grows on every write of it, so a
    gateway can tell "the same version all along" from "changed and changed back" (ingest/routing.py)."""

    __tablename__ = "server_rotation"

    url: Mapped[str] = mapped_column(String(500), primary_key=True)
    in_rotation: Mapped[bool] = mapped_column(Boolean)
    reason: Mapped[str] = mapped_column(String(500))
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime)
    serving_version: Mapped[int | None] = mapped_column(Integer)
    version_epoch: Mapped[int] = mapped_column(Integer, server_default="0")


class VersionHistory(Base):
    """Every weight version the deployer announced on a serving server, first and last time.
    Policy lag is counted in these (versions users were served), not in registry numbers: a
    challenger the gate rejected never served and is no version behind anything."""

    __tablename__ = "version_history"

    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    first_served_at: Mapped[datetime] = mapped_column(UtcDateTime)
    last_served_at: Mapped[datetime] = mapped_column(UtcDateTime)


class GateDecisionRow(Base):
    """Every decision of the eval gate: the verdict and the record behind it (suites with their
    intervals, alarms, reasons; deployer/gate.py `GateDecision`). `rtrl gate explain` reads it."""

    __tablename__ = "gate_decisions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    # The registry model the version belongs to (NULL: a decision recorded before revision 0011).
    model: Mapped[str | None] = mapped_column(String(200), nullable=True)
    challenger_version: Mapped[int] = mapped_column(Integer, index=True)
    champion_version: Mapped[int] = mapped_column(Integer)
    passed: Mapped[bool] = mapped_column(Boolean)
    reason: Mapped[str] = mapped_column(Text)
    record: Mapped[dict[str, Any]] = mapped_column(JSON)
    decided_at: Mapped[datetime] = mapped_column(UtcDateTime)


class RecordedDigests(Base):
    """A version's `/weight_checker` digests as a server that loaded and verified it reported them
    (the staging server during the gate, or the canary): the baseline every later swap to that
    version is checked against (deployer/swap.py). Keyed by the registry model's name too: a
    store can outlive a registry (or hold several models' tests), and v2 of another model is
    another checkpoint."""

    __tablename__ = "recorded_digests"

    model: Mapped[str] = mapped_column(String(200), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    digests: Mapped[dict[str, str]] = mapped_column(JSON)  # tensor name -> sha256 hex
    recorded_at: Mapped[datetime] = mapped_column(UtcDateTime)


class Promotion(Base):
    """Every move of @champion that rtrl made, and on what grounds: the record the deployer, the
    reconciler, the trainer and the gate trust over the registry's alias (deployer/trust.py,
    docs/security.md, The registry). The newest row of a model is its champion."""

    __tablename__ = "promotions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(String(200), index=True)
    version: Mapped[int] = mapped_column(Integer)
    # gate (a passing gate decision), served (a version that served before: a rollback),
    # bootstrap (the base model, v1), adopted (the alias found when rtrl first kept a record), force.
    grounds: Mapped[str] = mapped_column(String(16))
    gate_decision_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    actor: Mapped[str] = mapped_column(String(300))  # user@host, or the process that moved it
    reason: Mapped[str] = mapped_column(Text)
    promoted_at: Mapped[datetime] = mapped_column(UtcDateTime)


CANARY_FINAL_STATES = ("passed", "failed", "inconclusive", "stopped", "aborted")
CANARY_STATES = ("running", *CANARY_FINAL_STATES)


class Canary(Base):
    """A live canary: the challenger serving a share of live traffic on the canary server while its
    users' reward is compared with the champion's (store/canaries.py). At most one runs per store."""

    __tablename__ = "canaries"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(String(200))  # the registry model both versions belong to
    challenger_version: Mapped[int] = mapped_column(Integer)
    champion_version: Mapped[int] = mapped_column(Integer)
    server: Mapped[str] = mapped_column(String(500))  # the canary vLLM server's URL
    share: Mapped[float] = mapped_column(Float)  # of live episodes routed to the challenger
    cycle_id: Mapped[int | None] = mapped_column(Integer, nullable=True)  # the cycle that trained it
    # running, or how it ended: passed | failed | inconclusive | stopped | aborted
    state: Mapped[str] = mapped_column(String(16))
    # Why it ended, or the first stop request's reason while it still runs.
    reason: Mapped[str] = mapped_column(Text, default="")
    decision: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)  # the test's numbers
    started_at: Mapped[datetime] = mapped_column(UtcDateTime)
    ended_at: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)
    stop_requested_at: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)
    stop_requested_by: Mapped[str | None] = mapped_column(String(300), nullable=True)  # user@host
    # 1 while running and NULL once ended: the unique index on it makes "one running canary" hold
    # in the database itself, on SQLite and PostgreSQL alike (as cycles.active_slot).
    running_slot: Mapped[int | None] = mapped_column(Integer, unique=True)


class CanaryTraffic(Base):
    """What one gateway process saw of a live canary's requests on one arm (canary | fleet), as
    cumulative counts since the process started (store/canaries.py `record_canary_traffic`): every
    flush overwrites its row, so a repeated flush never counts a request twice."""

    __tablename__ = "canary_traffic"

    instance: Mapped[str] = mapped_column(String(64), primary_key=True)  # new per gateway process start
    version: Mapped[int] = mapped_column(Integer, primary_key=True)  # the version the canary served
    arm: Mapped[str] = mapped_column(String(16), primary_key=True)  # canary | fleet
    requests: Mapped[int] = mapped_column(BigInteger)
    errors: Mapped[int] = mapped_column(BigInteger)  # answered with an upstream failure
    # Requests per latency bucket (schemas/settings/canary.py LATENCY_BUCKETS_S, then +inf), not cumulative.
    latency_buckets: Mapped[list[int]] = mapped_column(JSON)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime)


class DeployLockHolder(Base):
    """Who holds a deploy lock ("rollout", "staging"), for `RolloutBusy` and `rtrl status`. The lock
    itself is a PostgreSQL advisory lock or a file lock beside the SQLite file (store/locks.py); this
    row is written inside it and deleted before it is released, so a row left by a holder that was
    killed is stale, and the next holder overwrites it."""

    __tablename__ = "deploy_locks"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(300))  # host:pid
    purpose: Mapped[str] = mapped_column(String(500))  # what it is doing ("promote v3")
    acquired_at: Mapped[datetime] = mapped_column(UtcDateTime)


class Tenant(Base):
    """An application whose traffic the gateway accepts under its keys, and what of it trains."""

    __tablename__ = "tenants"

    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    # Whether the tenant's episodes train the model at all; checked when a cycle selects its batch.
    trains: Mapped[bool] = mapped_column(Boolean, default=True)
    # Whether segments with redacted text train (their token ids still carry the original text).
    train_redacted: Mapped[bool] = mapped_column(Boolean, default=False)
    # Whether the tenant has a LoRA adapter of its own (its own line: docs/lora.md, An adapter per
    # tenant): its episodes train only that adapter, and the global line's selection skips them.
    adapter: Mapped[bool] = mapped_column(Boolean, server_default=sql_text("false"))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)


class ApiKey(Base):
    """A gateway API key. Only the sha256 of the key is stored; the key itself is shown once."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(32))  # the key's first characters, to recognise it in lists
    role: Mapped[str] = mapped_column(String(16))  # tenant | admin
    tenant: Mapped[str | None] = mapped_column(String(64))  # None for admin keys
    name: Mapped[str] = mapped_column(String(200))
    rate_per_s: Mapped[float | None] = mapped_column(Float)  # None: settings.gateway.rate_limit_per_s
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UtcDateTime)


class LabelerProgress(Base):
    """Where a partition's labeler last started work, to recognise a record that kills the process.

    ``mode`` batch: a batch starting at ``offset`` was begun ``attempts`` times without its offsets
    being committed; record: the single record at ``offset`` was. See feedback/labeler.py.
    """

    __tablename__ = "labeler_progress"

    topic: Mapped[str] = mapped_column(String(249), primary_key=True)
    partition: Mapped[int] = mapped_column(Integer, primary_key=True)
    offset: Mapped[int] = mapped_column(BigInteger)
    mode: Mapped[str] = mapped_column(String(8))
    attempts: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime)
