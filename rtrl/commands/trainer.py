"""`rtrl worker`, `rtrl beat`, `rtrl train now|status|node`: the Celery-scheduled training cycle (worker/,
trainer/), and the ranks other hosts lend it (trainer/nodes.py)."""

from __future__ import annotations

import socket

import typer

train_app = typer.Typer(
    no_args_is_help=True,
    help="Training cycles: enqueue one, list recent ones, or lend this host's ranks to them.",
)


def _logging() -> None:
    from services.logs import setup_logging

    setup_logging()


def worker(
    loglevel: str = typer.Option("INFO", help="Celery log level."),
    hostname: str = typer.Option(f"rtrl-trainer@{socket.gethostname()}", help="Celery node name."),
) -> None:
    """Run the trainer's Celery worker: one process, one cycle at a time (solo pool), until SIGTERM."""
    from schemas.settings import load_settings
    from worker.app import QUEUE, configure, on_worker_ready

    _logging()
    settings = load_settings()
    app = configure(settings)
    from telemetry import Readiness, start_exporter
    from trainer.engine import prebuild_ops

    readiness = Readiness()
    readiness.set("consuming", False, "starting")
    start_exporter(settings, "worker", readiness)  # /metrics, /healthz, /readyz (docs/metrics.md)
    on_worker_ready(lambda: readiness.set("consuming", True))
    prebuild_ops()  # DeepSpeed's CPU op built (or loaded) now, and a lock left by a killed build cleared
    # Solo pool: the cycle runs in this process, which keeps DeepSpeed's process group across cycles.
    app.worker_main(
        ["worker", "--pool=solo", "--concurrency=1", f"--loglevel={loglevel}", "-Q", QUEUE, "-n", hostname]
    )


def beat(loglevel: str = typer.Option("INFO", help="Celery log level.")) -> None:
    """Run Celery beat: every trainer.interval_s it checks whether a cycle should be enqueued."""
    from schemas.settings import load_settings
    from telemetry import start_exporter
    from worker.app import configure

    _logging()
    settings = load_settings()
    start_exporter(settings, "beat")  # /metrics, /healthz (docs/metrics.md)
    settings.services.run_dir.mkdir(parents=True, exist_ok=True)
    schedule = settings.services.run_dir / "celerybeat-schedule"
    configure(settings).start(["beat", f"--loglevel={loglevel}", f"--schedule={schedule}"])


@train_app.command("now")
def now(
    wait: bool = typer.Option(False, "--wait", help="Wait for the cycle and print its result JSON."),
    timeout: float = typer.Option(3600.0, "--timeout", help="Seconds --wait waits."),
    inline: bool = typer.Option(False, "--inline", help="Run the cycle chain in this process (no worker)."),
    tenant: str | None = typer.Option(
        None, "--tenant", help="A tenant with an adapter of its own: a cycle of its line (docs/lora.md)."
    ),
) -> None:
    """Enqueue one training cycle (train → gate → deploy) for `rtrl worker`."""
    import json

    from schemas.lines import global_line, tenant_line
    from schemas.settings import load_settings

    settings = load_settings()
    if inline:
        from registry import Registry
        from store import Store
        from worker.chain import run_chain

        _logging()
        line = global_line(settings) if tenant is None else tenant_line(settings, tenant)
        with Store(settings.store.url) as store:
            store.check_schema()
            result = run_chain(
                settings,
                store,
                Registry.from_settings(settings),
                owner=f"{socket.gethostname()}:cli",
                line=line,
            )
        typer.echo(json.dumps(result, indent=2))
        return
    from worker.app import configure
    from worker.tasks import train_cycle

    configure(settings)
    task = train_cycle.apply_async(kwargs={"tenant": tenant})
    typer.echo(f"enqueued cycle task {task.id}", err=wait)
    if wait:
        typer.echo(json.dumps(task.get(timeout=timeout), indent=2))


@train_app.command("pause")
def pause(
    reason: str = typer.Option("operator", help="Why, shown by beat's log and `rtrl train resume`."),
) -> None:
    """Stop new cycles (beat enqueues none) until `rtrl train resume`; a running cycle finishes.
    `rtrl train now` still runs one when asked."""
    import json

    from schemas.settings import load_settings
    from worker.tasks import pause_training

    typer.echo(json.dumps(pause_training(load_settings(), reason)))


@train_app.command("resume")
def resume() -> None:
    """Let beat start cycles again (after `rtrl train pause`)."""
    import json

    from schemas.settings import load_settings
    from worker.tasks import resume_training

    typer.echo(json.dumps(resume_training(load_settings())))


@train_app.command("status")
def status(
    limit: int = typer.Option(10, min=1, help="How many recent cycles."),
    cycle: int | None = typer.Option(
        None, "--id", min=1, help="Print this one cycle in full (metrics, steps, episodes)."
    ),
) -> None:
    """Recent training cycles from the store (newest first), as JSON lines; or one in full (--id)."""
    import dataclasses
    import json

    from schemas.settings import load_settings
    from store import Store

    with Store(load_settings().store.url) as store:
        store.check_schema()
        record = None if cycle is None else store.get_cycle(cycle)
        recent = [] if cycle is not None else store.recent_cycles(limit)
    if cycle is not None:
        if record is None:
            raise typer.BadParameter(f"no cycle {cycle} in the store", param_hint="--id")
        typer.echo(json.dumps(dataclasses.asdict(record), indent=2, default=str))
        return
    for c in recent:
        metrics = c.metrics
        typer.echo(
            json.dumps(
                {
                    "id": c.id,
                    "status": c.status,
                    "champion": c.champion,
                    "challenger": c.challenger,
                    "episodes": len(c.episode_ids),
                    "started_at": c.started_at.isoformat(),
                    "finished_at": c.finished_at.isoformat() if c.finished_at else None,
                    "train_s": metrics.get("train_s"),
                    "mean_reward": metrics.get("mean_reward"),
                    "gate": metrics.get("gate"),
                    "challenger_score": metrics.get("challenger_score"),
                    "champion_score": metrics.get("champion_score"),
                    "gate_reason": metrics.get("gate_reason"),
                    "swap_ms": metrics.get("swap_ms"),
                    "data_to_deploy_s": metrics.get("data_to_deploy_s"),
                    "error": c.error,
                }
            )
        )


@train_app.command("node")
def node() -> None:
    """Lend this host's ranks to every training cycle (trainer.nodes > 1), until SIGTERM.

    Run on each of the trainer.nodes - 1 hosts beside the worker's (RTRL_TRAINER__NODES, __RANKS, __RENDEZVOUS; trainer.checkpoint_dir and
    <run_dir>/deploy on a filesystem shared with the worker's host; docs/scaling.md, Training across hosts)."""
    import signal
    import threading

    from schemas.errors import OperatorError
    from schemas.settings import load_settings

    _logging()
    cfg = load_settings().trainer
    if cfg.nodes == 1:
        raise OperatorError(
            "rtrl train node joins multi-host cycles: set RTRL_TRAINER__NODES (> 1) and "
            "RTRL_TRAINER__RENDEZVOUS (host:port of the worker's host), as on the worker"
        )
    from trainer.engine import prebuild_ops
    from trainer.nodes import join_cycles

    prebuild_ops()  # DeepSpeed's CPU op built (or loaded) once, before the first cycle's ranks need it
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    join_cycles(cfg, stop.is_set)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the root app."""
    app.command("worker")(worker)
    app.command("beat")(beat)
    app.add_typer(train_app, name="train")
