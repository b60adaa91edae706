"""`rtrl report`: write the loop's HTML report (rtrl/report.py, docs/report.md) from the store alone."""

from __future__ import annotations

from pathlib import Path

import typer


def report(
    out: Path | None = typer.Option(
        None, "--out", help="Where to write the page. Default: <run_dir>/report.html."
    ),
    since: float | None = typer.Option(
        None, "--since", min=0, help="Only the last DAYS days (default: all history)."
    ),
) -> None:
    """Write an HTML report of rewards, acceptance, gate decisions, latencies and dead letters; print its path.

    Reads only the store (RTRL_STORE__URL): it works while MLflow, Kafka and the trainer are down.
    """
    import os
    from datetime import timedelta

    from rtrl.report import collect, render
    from schemas.clock import utcnow
    from schemas.settings import load_settings
    from store import ReportStore

    settings = load_settings()
    with ReportStore(settings.store.url) as store:
        store.check_schema()
        data = collect(store, since=None if since is None else utcnow() - timedelta(days=since))
    path = out if out is not None else Path(settings.services.run_dir) / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(render(data), encoding="utf-8")
    partial.replace(path)  # a browser reloading the page never sees half of it
    typer.echo(str(path))


def register(app: typer.Typer) -> None:
    """Add `rtrl report` to the root app."""
    app.command("report")(report)
