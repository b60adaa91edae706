"""The ``rtrl`` command line. Keep imports light: ``rtrl --help`` must answer in well under a second."""

from __future__ import annotations

import importlib
from pathlib import Path

import typer

app = typer.Typer(
    name="rtrl",
    no_args_is_help=True,
    add_completion=False,
    help=(
        "Real-time online RL from production traffic. Configuration comes from RTRL_* environment "
        "variables (nested with __, e.g. RTRL_KAFKA__BOOTSTRAP_SERVERS) or a .env file; "
        "see `rtrl config show`."
    ),
)

schemas_app = typer.Typer(no_args_is_help=True, help="Wire schemas of the loop's events.")
config_app = typer.Typer(no_args_is_help=True, help="Inspect the effective configuration.")
app.add_typer(schemas_app, name="schemas")
app.add_typer(config_app, name="config")


@schemas_app.command("export")
def schemas_export(directory: Path = typer.Argument(..., help="Folder to write <schema>.json files into.")) -> None:
    """Write the JSON Schema of every wire message (InteractionEvent, FeedbackEvent, DeadLetterRecord)."""
    import json

    from schemas.events import WIRE_MODELS

    directory.mkdir(parents=True, exist_ok=True)
    for tag, model in WIRE_MODELS.items():
        path = directory / f"{tag}.json"
        path.write_text(json.dumps(model.model_json_schema(), indent=2, sort_keys=True) + "\n")
        typer.echo(f"wrote {path}")


@config_app.command("show")
def config_show() -> None:
    """Print the effective settings (defaults + environment + .env) as JSON."""
    from schemas.settings import Settings

    typer.echo(Settings().model_dump_json(indent=2))


for _name in ("services", "model", "gateway", "labeler", "trainer", "deploy", "simulate", "demo", "daemon"):
    importlib.import_module(f"rtrl.commands.{_name}").register(app)


if __name__ == "__main__":
    app()
