"""`rtrl dlq list|show|replay|episodes`: the records and episodes rtrl could not use, with their reasons.

    rtrl dlq list [--reason schema:] [--limit 50]   newest first: id, source, when, reason
    rtrl dlq show ID                                 everything about one, the payload as text
    rtrl dlq replay ID [ID ...]                      produce the original bytes to their topic again
    rtrl dlq episodes [--limit 50]                   quarantined episodes, newest first, with reasons
    rtrl dlq episodes --release ID [--release ID]    put quarantined episodes back in the pool

Dead letters are read from the store (``dead_letters``: the labeler writes one row per record it
refused). A replay is for a record refused by a labeler bug that is now fixed: it goes to the end
of its topic as a new record and is labelled (or dead-lettered) again. Records the gateway dead-lettered (source ``gateway``) have no topic to go
back to. The DLQ topic (``settings.kafka.dlq_topic``) carries the same records for other consumers.
A replay is produced before it is marked: a crash in between can replay a record twice, and the
labeler then dead-letters the second copy as a duplicate; it is never lost.

A quarantined episode is a settled episode that ``trainer.max_episode_failures`` failed cycles had
claimed (store/cycles.py `release_claims`): the trainer no longer selects it. Release one that
an operator judged innocent (it shared batches with a poisoned one, or an outage failed them): it
goes back with no failure counted (docs/security.md, Poisoned episodes).
"""

from __future__ import annotations

import json

import typer

dlq_app = typer.Typer(
    no_args_is_help=True,
    help="Dead letters: records rtrl refused, and episodes quarantined after failed cycles, with the reasons.",
)


@dlq_app.command("list")
def list_letters(
    reason: str | None = typer.Option(
        None, help="Only reasons starting with this (schema:, content:, duplicate:, ...)."
    ),
    limit: int = typer.Option(50, min=1, help="How many, newest first."),
) -> None:
    """Dead letters as JSON lines, newest first."""
    from schemas.settings import load_settings
    from store import Store

    with Store(load_settings().store.url) as store:
        store.check_schema()
        for d in store.dead_letters(limit, reason_prefix=reason):
            typer.echo(
                json.dumps(
                    {
                        "id": d.event_id,
                        "source": d.source,
                        "created_at": d.created_at.isoformat(),
                        "original_event_id": d.original_event_id,
                        "replayed": d.replayed_at is not None,
                        "reason": d.reason[:300],
                    }
                )
            )


@dlq_app.command("show")
def show(
    letter_id: str = typer.Argument(..., help="Id from `rtrl dlq list` (dlq:topic:partition:offset)."),
) -> None:
    """One dead letter in full; the payload decoded as UTF-8 (invalid bytes replaced)."""
    from schemas.settings import load_settings
    from store import Store

    with Store(load_settings().store.url) as store:
        store.check_schema()
        d = store.dead_letter(letter_id)
    if d is None:
        raise typer.BadParameter(f"no dead letter {letter_id!r} (see `rtrl dlq list`)", param_hint="ID")
    typer.echo(
        json.dumps(
            {
                "id": d.event_id,
                "source": d.source,
                "source_topic": d.source_topic,
                "created_at": d.created_at.isoformat(),
                "original_event_id": d.original_event_id,
                "replayed_at": None if d.replayed_at is None else d.replayed_at.isoformat(),
                "reason": d.reason,
                "payload_bytes": len(d.payload),
                "payload": d.payload.decode("utf-8", errors="replace"),
            },
            indent=2,
        )
    )


@dlq_app.command("replay")
def replay(letter_ids: list[str] = typer.Argument(..., help="Ids from `rtrl dlq list`.")) -> None:
    """Produce each dead letter's original bytes to its topic again (once per dead letter)."""
    import streams
    from schemas.settings import load_settings
    from store import Store

    settings = load_settings()
    with Store(settings.store.url) as store:
        producer = None
        failed = 0
        try:
            store.check_schema()
            for letter_id in letter_ids:
                d = store.dead_letter(letter_id)
                if d is None or d.source_topic is None:
                    typer.echo(
                        f"{letter_id}: {'no such dead letter' if d is None else 'came from ' + d.source + ', no topic to replay to'}",
                        err=True,
                    )
                    failed += 1
                    continue
                if d.replayed_at is not None:
                    typer.echo(f"{letter_id}: already replayed at {d.replayed_at.isoformat()}", err=True)
                    failed += 1
                    continue
                # Produced first, marked after: a crash in between replays it twice; the labeler stores
                # the first copy and dead-letters the second as a duplicate, rather than losing it.
                producer = producer or streams.producer(settings.kafka, "rtrl-dlq-replay")
                metadata = producer.send(
                    d.source_topic, key=_record_key(d.payload, letter_id), value=d.payload
                ).get(timeout=30)
                store.mark_replayed(letter_id)
                typer.echo(
                    f"{letter_id}: replayed to {metadata.topic}:{metadata.partition}:{metadata.offset}"
                )
        finally:
            if producer is not None:
                producer.close()
    if failed:
        raise typer.Exit(1)


@dlq_app.command("episodes")
def episodes(
    release: list[str] = typer.Option(
        [], "--release", help="Put this quarantined episode back in the pool (repeat for several)."
    ),
    limit: int = typer.Option(50, min=1, help="How many to list, newest first."),
) -> None:
    """Quarantined episodes as JSON lines (newest first), or release some with --release."""
    from schemas.errors import OperatorError
    from schemas.settings import load_settings
    from store import Store

    with Store(load_settings().store.url) as store:
        store.check_schema()
        if not release:
            for e in store.quarantined(limit):
                typer.echo(
                    json.dumps(
                        {
                            "episode_id": e.episode_id,
                            "tenant": e.tenant,
                            "failed_cycles": e.failed_cycles,
                            "quarantined_at": e.quarantined_at.isoformat(),
                            "reason": e.reason[:300],
                        }
                    )
                )
            return
        released = store.release_quarantined(release)
    for episode_id in released:
        typer.echo(f"{episode_id}: released; trainable again")
    unknown = sorted(set(release) - set(released))
    if unknown:
        raise OperatorError(
            f"not quarantined: {', '.join(map(repr, unknown))} (see `rtrl dlq episodes` for the ids)"
        )


def _record_key(payload: bytes, fallback: str) -> bytes:
    """The key the gateway gives such a record (its request id), so a replay lands on the partition
    the rest of its request's records are on; `fallback` for a payload without one."""
    try:
        request_id = json.loads(payload).get("request_id")
    except (ValueError, AttributeError, RecursionError):
        request_id = None
    return (request_id if isinstance(request_id, str) and request_id else fallback).encode()


def register(app: typer.Typer) -> None:
    """Add `rtrl dlq` to the root app."""
    app.add_typer(dlq_app, name="dlq")
