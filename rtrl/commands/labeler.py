"""`rtrl labeler`: run the feedback labeler, show store stats, reconcile Kafka with the store."""

from __future__ import annotations

import typer

labeler_app = typer.Typer(
    invoke_without_command=True,
    help="The feedback labeler: Kafka -> SQL store, join/settle, rewards. Without a subcommand: run it.",
)


@labeler_app.callback()
def labeler(ctx: typer.Context) -> None:
    """Consume interactions and feedback until SIGTERM/SIGINT (see feedback/labeler.py)."""
    if ctx.invoked_subcommand is not None:
        return
    from feedback.labeler import run
    from schemas.settings import load_settings
    from services.logs import setup_logging
    from telemetry import Readiness, start_exporter

    setup_logging()
    settings = load_settings()
    readiness = Readiness()
    start_exporter(settings, "labeler", readiness)  # /metrics, /healthz, /readyz (docs/metrics.md)
    run(settings, readiness=readiness)


@labeler_app.command("migrate")
def migrate() -> None:
    """Create or upgrade the store's tables (the labeler also does this at start-up)."""
    from schemas.settings import load_settings
    from store import Store

    with Store(load_settings().store.url) as store:
        store.migrate()
    typer.echo("store is at the newest migration")


@labeler_app.command("stats")
def stats() -> None:
    """Row counts per table and status (orphaned = feedback unjoined after the settle window)."""
    import json

    from schemas.settings import load_settings
    from store import Store

    settings = load_settings()
    with Store(settings.store.url) as store:
        store.check_schema()
        counts = store.stats(orphan_after_s=settings.labeler.settle_window_s)
    typer.echo(json.dumps(counts, indent=2, sort_keys=True))


@labeler_app.command("reconcile")
def reconcile() -> None:
    """Check produced = stored + dead-lettered over the event topics; exit 1 if it does not hold."""
    from feedback.reconcile import reconcile as reconcile_
    from schemas.settings import load_settings
    from store import Store

    settings = load_settings()
    with Store(settings.store.url) as store:
        store.check_schema()
        result = reconcile_(settings, store)
    for p in result.partitions:
        typer.echo(
            f"{p.topic}[{p.partition}]  produced {p.produced}  stored {p.stored}  "
            f"dead-lettered {p.dead_lettered}  pending {p.pending}"
        )
    verdict = "balanced" if result.balanced else "NOT balanced"
    typer.echo(
        f"total  produced {result.produced}  stored {result.stored}  dead-lettered {result.dead_lettered}  "
        f"pending {result.pending}  -> {verdict}"
    )
    if not result.balanced:
        if result.pending:
            typer.echo(
                "the labeler group has uncommitted records: wait for the lag to drain and re-run", err=True
            )
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add `rtrl labeler` to the root app."""
    app.add_typer(labeler_app, name="labeler")
