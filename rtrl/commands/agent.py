"""`rtrl agent`: the weights agent on a vLLM host that cannot see the deployer's files (deployer/agent.py)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add `rtrl agent` to the root app."""

    @app.command("agent")
    def agent(
        host: str = typer.Option(None, help="Bind address (default: settings.agent.host)."),
        port: int = typer.Option(None, help="Bind port (default: settings.agent.port)."),
    ) -> None:
        """Serve the weights agent on this vLLM host: the deployer asks it to download a version from the
        registry's artifact store into agent.cache_dir, and hands vLLM that path (vllm.weights_agents maps
        each server to its agent; docs/scaling.md, Weights on every host)."""
        import uvicorn

        from deployer.agent import create_app
        from schemas.settings import load_settings
        from services.base import ServiceError, port_in_use
        from services.logs import setup_logging

        setup_logging()
        settings = load_settings()
        overrides = {k: v for k, v in {"host": host, "port": port}.items() if v is not None}
        if overrides:
            settings = settings.model_copy(update={"agent": settings.agent.model_copy(update=overrides)})
        cfg = settings.agent
        if port_in_use(cfg.host, cfg.port):
            raise ServiceError(
                f"agent: port {cfg.port} on {cfg.host} is in use; stop what holds it or set RTRL_AGENT__PORT"
            )
        if cfg.token is None and cfg.host not in ("127.0.0.1", "localhost", "::1"):
            typer.echo(
                f"rtrl agent: listening on {cfg.host} without a token; set RTRL_AGENT__TOKEN", err=True
            )
        uvicorn.run(create_app(settings), host=cfg.host, port=cfg.port, log_level="warning", access_log=False)
