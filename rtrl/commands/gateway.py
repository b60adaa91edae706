"""`rtrl gateway`: the OpenAI-compatible capture gateway in front of the vLLM fleet (ingest/)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add `rtrl gateway` to the root app."""

    @app.command("gateway")
    def gateway(
        host: str = typer.Option(None, help="Bind address (default: settings.gateway.host)."),
        port: int = typer.Option(None, help="Bind port (default: settings.gateway.port)."),
        workers: int = typer.Option(
            None, help="Gateway processes on the port (default: settings.gateway.workers)."
        ),
    ) -> None:
        """Serve /v1/completions, /v1/chat/completions, /v1/responses, /v1/feedback and /v1/models; publish every call to Kafka."""
        from ingest.app import run
        from schemas.settings import load_settings
        from services.logs import setup_logging

        setup_logging()
        settings = load_settings()
        overrides = {
            k: v for k, v in {"host": host, "port": port, "workers": workers}.items() if v is not None
        }
        if overrides:
            gateway_settings = type(settings.gateway).model_validate(
                {**settings.gateway.model_dump(), **overrides}
            )
            settings = settings.model_copy(update={"gateway": gateway_settings})
        run(settings)
