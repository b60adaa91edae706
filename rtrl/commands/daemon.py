"""``rtrl run``: the loop as one supervised background daemon; ``rtrl status``: the loop on one screen."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from schemas.settings import Settings
    from store import Store


def register(app: typer.Typer) -> None:
    """Add ``rtrl run``."""

    @app.command("run")
    def run(
        processes: str = typer.Option(
            "gateway,labeler,worker,beat,reconciler", help="Comma-separated processes to supervise."
        ),
    ) -> None:
        """Run gateway, labeler, trainer worker, beat and the fleet reconciler; restart any that exits; stop on SIGTERM.

        The gateway starts at once. Meanwhile it migrates the store, creates the topics and registers
        the base model as v1 @champion if the registry is empty (idempotent), retrying while a
        dependency is down; the other processes start once that is done. The services (Kafka, PostgreSQL,
        Redis, MLflow, vLLM, ...) are not started here: run `rtrl services up` first, or point RTRL_* at your
        own. The store is the local PostgreSQL's unless RTRL_STORE__URL says otherwise; when that server does
        not answer and this run dir has not started it, nothing would, so `rtrl run` stops at once saying so. So
        does a checkpoint in RTRL_VLLM__MODEL_DIR that `rtrl model check` rejects.
        """
        from feedback.judging import require_endpoint
        from registry import Registry
        from schemas.rewards import get_spec
        from schemas.settings import load_settings
        from services.logs import setup_logging
        from services.modelcheck import require_usable
        from services.supervisor import PROCESSES, Supervisor, prepare
        from store import Store

        setup_logging()
        names = [p.strip() for p in processes.split(",") if p.strip()]
        unknown = sorted(set(names) - set(PROCESSES))
        if unknown:
            raise typer.BadParameter(f"unknown process(es) {unknown}; choose from {sorted(PROCESSES)}")
        settings = load_settings()
        # An unknown spec, or a judged one without its endpoint, is a mistake to fix now, not to retry.
        require_endpoint(get_spec(settings.labeler.reward_spec), settings.labeler.judge)
        with Store(
            settings.store.url
        ) as store:  # a malformed store URL is a mistake to fix now, not to retry
            _require_local_store(settings, store)
        Registry.from_settings(settings)
        require_usable(settings)  # the base model the champion starts from: a broken one is refused now

        def prepared() -> int:
            with Store(settings.store.url) as store:
                return prepare(settings, store, Registry.from_settings(settings))

        Supervisor(settings, names, prerequisite=prepared).run_forever()

    @app.command("status")
    def status(as_json: bool = typer.Option(False, "--json", help="Print the report as JSON.")) -> None:
        """The whole loop on one screen: services, the daemon's processes and restarts, the labeler's lag,
        the trainer's cycle and last gate decision, @champion and each server's version and rotation.
        Exits 1 when something needs an operator (listed under problems)."""
        import json

        from rtrl.status import collect, render
        from schemas.settings import load_settings

        report = collect(load_settings())
        typer.echo(json.dumps(report, indent=2, default=str) if as_json else render(report))
        if report["problems"]:
            raise typer.Exit(1)


def _require_local_store(settings: Settings, store: Store) -> None:
    """Raise DatabaseUnavailable, saying how to fix it, when the store is the local PostgreSQL
    (`rtrl services up`) and that does not answer because this run dir never started it: waiting for
    it would be waiting for nothing. Any other store that is down is waited for (the supervisor
    retries `prepare`)."""
    from schemas.settings import local_postgres_url
    from services.postgres import Postgres
    from store import DatabaseUnavailable, StoreNotMigrated

    if "postgres" not in settings.services.enabled or settings.store.url != local_postgres_url(settings):
        return
    try:
        store.check_schema()
    except StoreNotMigrated:
        return  # it answers; `prepare` migrates it
    except DatabaseUnavailable:
        if Postgres(settings).pid() is not None:
            return  # started, not up yet (or restarting): waited for
        raise DatabaseUnavailable(
            f"store {settings.store.url} unreachable: start it with `rtrl services up` or set RTRL_STORE__URL"
        ) from None
