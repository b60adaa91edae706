"""`rtrl store prune`: retention for the SQL store.

    rtrl store prune --older-than 30 --dry-run   count what would go, per table
    rtrl store prune --older-than 30 --yes       delete it (asks first on a terminal without --yes)

Deletes settled episodes (with their segments and feedback) that no active cycle holds, orphaned
feedback and segments, and dead letters, older than the cutoff, a batch per transaction, and only
rows whose Kafka records are gone: Kafka is asked for the beginning offset of every partition of
the event topics, so `rtrl labeler reconcile` stays balanced (store/retention.py says why and
how). ``--without-kafka`` prunes by age alone, for when the topics are gone for good. Live
canaries that ended before the cutoff go too (no Kafka record behind them); a running one stays.
Runbook: docs/runbooks/daemon.md, Retention.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from schemas.settings import Settings
    from store.retention import KafkaFloor, PruneReport

store_app = typer.Typer(no_args_is_help=True, help="The SQL store: retention of old rows.")

MIN_DAYS = 1.0  # a typo guard: `--older-than 0.01` is never what an operator means


@store_app.command("prune")
def prune(
    older_than: float = typer.Option(
        ...,
        "--older-than",
        metavar="DAYS",
        help=f"Delete rows older than this many days (at least {MIN_DAYS:g}, and longer than labeler.settle_window_s).",
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Count what would be deleted, per table; change nothing."
    ),
    yes: bool = typer.Option(
        False, "--yes", help="Delete without asking (needed when stdin is not a terminal)."
    ),
    without_kafka: bool = typer.Option(
        False,
        "--without-kafka",
        help="Do not ask Kafka which records it still holds; prune by age alone. `rtrl labeler reconcile` then "
        "reports NOT balanced until Kafka's retention has deleted those records too.",
    ),
    batch_size: int = typer.Option(5000, min=1, help="Rows of a kind deleted per transaction."),
) -> None:
    """Delete settled episodes (with their segments and feedback), orphaned feedback, dead letters and
    ended live canaries older than DAYS, keeping open episodes, those an active cycle holds, rows
    Kafka still holds, and a running canary whatever its age."""
    from datetime import timedelta

    from schemas.errors import OperatorError
    from schemas.settings import load_settings
    from store import Store
    from store.retention import prune as prune_

    if not dry_run and not yes and not sys.stdin.isatty():
        typer.echo(
            "rtrl: store prune deletes rows for good; pass --yes to confirm (or --dry-run to count them)",
            err=True,
        )
        raise typer.Exit(1)
    settings = load_settings()
    minimum_s = max(MIN_DAYS * 86400, settings.labeler.settle_window_s)
    if older_than * 86400 < minimum_s:
        raise OperatorError(
            f"--older-than {older_than:g} is too recent: at least {minimum_s / 86400:g} days (one day, and longer than "
            "labeler.settle_window_s, within which unjoined feedback may still join)"
        )
    with Store(settings.store.url) as store:
        store.check_schema()
        floor = None if without_kafka else _kafka_floor(settings)
        if floor is None:
            typer.echo(
                "pruning by age alone: `rtrl labeler reconcile` reports NOT balanced until Kafka's retention "
                "has deleted the records of the rows deleted now",
                err=True,
            )
        cutoff = store.clock() - timedelta(days=older_than)
        typer.echo(f"rows older than {cutoff.isoformat()} ({older_than:g} days)")
        if not dry_run and not yes:  # a terminal: show what would go, then ask
            _print(prune_(store, cutoff, floor, dry_run=True, batch_size=batch_size))
            typer.confirm("delete these rows?", abort=True)
        _print(prune_(store, cutoff, floor, dry_run=dry_run, batch_size=batch_size))


def _print(report: PruneReport) -> None:
    verb = "would be deleted" if report.dry_run else "deleted"
    for table, rows in report.deleted.items():
        typer.echo(f"{table:<13} {rows} {verb}")
    held = ", ".join(f"{rows} {table}" for table, rows in report.held.items() if rows)
    if held:
        typer.echo(
            f"kept because Kafka still holds their records (reconcile counts them): {held}; "
            "they go on a later run, once Kafka's retention has deleted those records"
        )


def _kafka_floor(settings: Settings) -> KafkaFloor:
    """The beginning offset of every partition of the interactions and feedback topics (what
    `rtrl labeler reconcile` counts from); a topic Kafka does not have is an error (the wrong
    topic names would let rows of the real topics go while Kafka still holds them)."""
    import streams
    from schemas.errors import OperatorError

    kafka = settings.kafka
    consumer = streams.consumer(kafka, "rtrl-store-prune", group_id=None)
    try:
        partitions = []
        for topic in (kafka.interactions_topic, kafka.feedback_topic):
            found = streams.partitions_of(consumer, topic)
            if not found:
                raise OperatorError(
                    f"Kafka at {kafka.bootstrap_servers} has no topic {topic!r}; check RTRL_KAFKA__INTERACTIONS_TOPIC "
                    "and RTRL_KAFKA__FEEDBACK_TOPIC, or pass --without-kafka when the topics are gone for good"
                )
            partitions += found
        begin = consumer.beginning_offsets(partitions)
    finally:
        consumer.close()
    return {(tp.topic, tp.partition): int(offset) for tp, offset in begin.items()}


def register(app: typer.Typer) -> None:
    """Add `rtrl store` to the root app."""
    app.add_typer(store_app, name="store")
