"""The ``rtrl`` command line. Keep imports light: ``rtrl --help`` must answer in well under a second.

`main` is the console script. An error the operator can fix (`schemas.errors.OperatorError`: a
missing system package, a busy port, a bad setting, an unknown task, a store that was never
migrated, Kafka, MLflow or the store not answering) and a vLLM server or Redis that cannot be
reached are printed as one line, with what to do, and the command exits 1; ``rtrl --debug ...``
shows the traceback instead. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import typer

from schemas.errors import OperatorError

app = typer.Typer(
    name="rtrl",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
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

_debug = False


@app.callback()
def _options(
    debug: bool = typer.Option(
        False, "--debug", help="Show the full traceback of an error instead of one line."
    ),
) -> None:
    global _debug
    _debug = debug


@schemas_app.command("export")
def schemas_export(
    directory: Path = typer.Argument(..., help="Folder to write <schema>.json files into."),
) -> None:
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
    """Print the effective settings (defaults + environment + .env) as JSON; secrets are masked."""
    from schemas.settings import load_settings

    typer.echo(load_settings().model_dump_json(indent=2))


for _name in (
    "services",
    "model",
    "gateway",
    "labeler",
    "keys",
    "dlq",
    "kafka",
    "store",
    "trainer",
    "deploy",
    "gate",
    "simulate",
    "demo",
    "report",
    "daemon",
    "agent",
):
    importlib.import_module(f"rtrl.commands.{_name}").register(app)


# Errors that mean "nothing answered at that address", by (top-level module, class name): their
# libraries are imported lazily, so they are recognised without importing them here.
# (Kafka, MLflow and the store have clients of their own that raise OperatorErrors already.)
_UNREACHABLE = {
    ("httpx", "ConnectError"),  # a vLLM server
    ("httpx", "ConnectTimeout"),
    ("kombu", "OperationalError"),  # the Celery broker (Redis)
}


def unreachable(exc: BaseException) -> str | None:
    """One line for an error that means a service could not be reached, else None."""
    kind = (type(exc).__module__.split(".")[0], type(exc).__name__)
    if not isinstance(exc, ConnectionRefusedError) and kind not in _UNREACHABLE:
        return None
    return f"cannot reach a service ({kind[1]}: {str(exc)[:300]}); check `rtrl services status` and the RTRL_* addresses"


def main() -> None:
    """The ``rtrl`` console script: run the app, print operator errors as one line."""
    try:
        app()
    except Exception as exc:
        if _debug:
            raise
        line = str(exc) if isinstance(exc, OperatorError) else unreachable(exc)
        if line is None:
            raise
        typer.echo(f"rtrl: {line}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
