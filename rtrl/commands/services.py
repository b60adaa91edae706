"""`rtrl services up|status|down`: the real local services (Kafka, PostgreSQL, Redis, MLflow, vLLM)."""

from __future__ import annotations

import typer

services_app = typer.Typer(no_args_is_help=True, help="Start, check and stop the local services on loopback.")

_ONLY = typer.Option(
    None,
    "--only",
    help="Comma-separated subset: kafka,postgres,redis,mlflow,vllm,vllm-staging,vllm-canary (default: all enabled).",
)


def _split(only: str | None) -> list[str] | None:
    return None if only is None else [name.strip() for name in only.split(",") if name.strip()]


def _print_table(rows: list) -> None:  # type: ignore[type-arg]
    from rich.console import Console
    from rich.table import Table

    table = Table("service", "healthy", "pid", "address", "detail")
    for row in rows:
        table.add_row(
            row.name,
            "[green]yes[/]" if row.healthy else "[red]no[/]",
            str(row.pid or "-"),
            row.address,
            row.detail,
        )
    Console(width=max(120, Console().width)).print(table)


@services_app.command("up")
def up(only: str | None = _ONLY) -> None:
    """Install what is missing, start the services that are not running and wait until all are healthy.

    MLflow on the local PostgreSQL (its default backend) starts once PostgreSQL is healthy and has made
    the databases of the store and of MLflow; `--only mlflow` starts PostgreSQL too."""
    import logging

    from schemas.settings import load_settings
    from services import up as services_up

    # Progress of the services package only; the Kafka and HTTP clients' INFO chatter stays off.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
    logger = logging.getLogger("services")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    rows = services_up(load_settings(), _split(only))  # a ServiceError is printed as one line by rtrl.cli
    _print_table(rows)


@services_app.command("status")
def status(
    only: str | None = _ONLY,
    json_output: bool = typer.Option(False, "--json", help="Print a JSON list instead of a table."),
) -> None:
    """Show each enabled service's health; exits 1 when one of them is not healthy."""
    import dataclasses
    import json

    from schemas.settings import load_settings
    from services import status as services_status

    rows = services_status(load_settings(), _split(only))
    if json_output:
        typer.echo(json.dumps([dataclasses.asdict(r) for r in rows], indent=2))
    else:
        _print_table(rows)
    if not all(r.healthy for r in rows):
        raise typer.Exit(1)


@services_app.command("down")
def down(
    only: str | None = typer.Option(None, "--only", help="Comma-separated subset (default: all)."),
) -> None:
    """Stop the services and every process they started."""
    from schemas.settings import load_settings
    from services import down as services_down

    stopped = services_down(load_settings(), _split(only))
    typer.echo(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")


def register(app: typer.Typer) -> None:
    """Add `rtrl services ...` to the root app."""
    app.add_typer(services_app, name="services")
