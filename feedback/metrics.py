"""Prometheus metrics of the labeler process (served by `rtrl labeler`'s exporter, telemetry/).

Module-level families on the default registry: one labeler per process. docs/metrics.md gives each
with its unit; infra/prometheus/rtrl.rules.yml pages on lag, dead letters and a store that refuses.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

EVENTS = Counter(
    "rtrl_labeler_events_total",
    "Events stored by the labeler, by kind (interaction, feedback); replays of records already stored are not counted.",
    ["kind"],
)
REPLAYED = Counter(
    "rtrl_labeler_replayed_total",
    "Records read again after a crash or rebalance and recognised as already stored (no-ops).",
)
POLL_FAILURES = Counter(
    "rtrl_labeler_poll_failures_total",
    "Kafka polls that raised a Kafka error (no broker answered); each is retried after a second.",
)
DEAD_LETTERS = Counter(
    "rtrl_labeler_dead_letters_total",
    "Records dead-lettered (DLQ topic and dead_letters table), by reason: schema, content, duplicate, unknown "
    "tenant, cap (past a cap per episode or over the prompt size: docs/security.md, Caps per episode), record "
    "(the store refused it alone), poison (labelers died on it), other.",
    ["reason"],
)
FEEDBACK_JOINED = Counter(
    "rtrl_labeler_feedback_joined_total",
    'Feedback events joined to an open episode (the join rate is this over rtrl_labeler_events_total{kind="feedback"}).',
)
FEEDBACK_LATE = Counter(
    "rtrl_labeler_feedback_late_total",
    "Feedback events that arrived after their episode settled (stored, not part of its reward).",
)
FEEDBACK_STRANDED = Counter(
    "rtrl_labeler_feedback_stranded_total",
    "Feedback naming an episode that another replica was creating at the same moment, stored unjoined "
    "and joined by a later window pass (also counted as joined or late).",
)
SETTLED = Counter(
    "rtrl_labeler_settled_total",
    "Episodes settled (labelled with a reward), by how: terminal_feedback or window.",
    ["how"],
)
SETTLE_FAILED = Counter(
    "rtrl_labeler_settle_failed_total",
    "Expired episodes that settling failed on alone (the window pass's error policy): closed without a reward "
    "and quarantined with the error (rtrl dlq episodes), never trained.",
)
SETTLED_BY_VERSION = Counter(
    "rtrl_labeler_settled_by_version_total",
    "Episodes settled, by the policy version that served them and the sign of their reward (positive, zero, "
    "negative): positive over all is the version's live acceptance under specs where acceptance earns a reward.",
    ["version", "sign"],
)
REWARD_SUM = Counter(
    "rtrl_labeler_settled_reward_abs",
    "Sum of |reward| of settled episodes, by version and sign (positive, negative), exported as "
    "rtrl_labeler_settled_reward_abs_total: the mean live reward of a version is (positive − negative) / "
    "rtrl_labeler_settled_by_version_total summed over signs.",
    ["version", "sign"],
)
SETTLED_UNFINISHED = Counter(
    "rtrl_labeler_settled_unfinished_total",
    "Episodes settled that the model left unfinished (cut off by max_tokens), by the version that served them: "
    "labelled with the reward spec's negative 'unfinished' component, never dropped.",
    ["version"],
)
JUDGED = Counter(
    "rtrl_labeler_judged_total",
    "Episodes settled under a reward spec with a judge term, by outcome: scored (the judge's grade is a term of the "
    "reward) or unavailable (the judge failed after its retries: labelled without the judge term and flagged "
    "judge_unavailable, never dropped).",
    ["outcome"],
)
JUDGE_COMPARED = Counter(
    "rtrl_labeler_judge_compared_total",
    "Judged episodes that also had feedback, whose outcome the judge's grade is compared with.",
)
JUDGE_DISAGREED = Counter(
    "rtrl_labeler_judge_disagreed_total",
    "Of the compared episodes, those where the judge's grade (good: >= 0.5) and the feedback's outcome (good: "
    "positive) disagree; the disagreement rate is this over rtrl_labeler_judge_compared_total.",
)
JUDGE_WAITING = Gauge(
    "rtrl_labeler_judge_waiting",
    "Episodes closed and waiting for the judge, as this labeler's last judge pass found them (at most labeler.judge_batch).",
)
SETTLE_LATENCY = Histogram(
    "rtrl_labeler_settle_latency_seconds",
    "From an episode's first event to its settlement (seconds).",
    buckets=(0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400),
)
LAG = Gauge(
    "rtrl_labeler_consumer_lag",
    "Records on a partition this labeler has not consumed yet (high watermark − position), by topic and partition.",
    ["topic", "partition"],
)
STORE_UP = Gauge(
    "rtrl_labeler_store_up",
    "1 while the store accepts the labeler's writes; 0 while it backs off because the store or the DLQ producer failed.",
)
LAST_STEP = Gauge(
    "rtrl_labeler_last_step_timestamp_seconds",
    "Unix time of the labeler's last completed poll → store → commit round (idle rounds included).",
)

REASONS = ("schema", "content", "duplicate", "unknown tenant", "cap", "record", "poison")
# Every known series exists from the start (at 0), so the first increment is an increase a rule sees.
for _reason in (*REASONS, "other"):
    DEAD_LETTERS.labels(_reason)
for _outcome in ("scored", "unavailable"):
    JUDGED.labels(_outcome)
for _kind in ("interaction", "feedback"):
    EVENTS.labels(_kind)
for _how in ("terminal_feedback", "window"):
    SETTLED.labels(_how)


def sign(reward: float) -> str:
    return "positive" if reward > 0 else "negative" if reward < 0 else "zero"


def reason_label(reason: str) -> str:
    """The bounded label of a dead letter's reason: its prefix before the first ':' when known, else other."""
    prefix = reason.split(":", 1)[0].strip()
    return prefix if prefix in REASONS else "other"
