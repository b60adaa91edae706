"""`rtrl deploy canary`: the live canary between the offline gate and the fleet (docs/gate.md, Live
canary; docs/runbooks/deployer.md, Live canary).

    rtrl deploy canary status [--last N]   the running canary (and the last N that ended) with its
                                           test's numbers now, as JSON lines
    rtrl deploy canary stop [--reason WHY] end the running canary: its users go back to the champion
                                           and its challenger is not promoted

`stop` asks the canary's runner (the worker) to end it and waits for it, up to
``--wait`` seconds; when no process runs it (a worker that died), it ends it at once itself.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from schemas.settings import Settings
    from store import CanaryRecord, Store

canary_app = typer.Typer(no_args_is_help=True, help="The live canary: status, stop.")


def _as_json(settings: Settings, store: Store, record: CanaryRecord) -> dict[str, Any]:
    from deployer import canary

    row: dict[str, Any] = {
        "canary": record.id,
        "version": record.challenger_version,
        "champion": record.champion_version,
        "server": record.server,
        "share": record.share,
        "state": record.state,
        "reason": record.reason,
        "cycle": record.cycle_id,
        "started_at": record.started_at.isoformat(),
        "ended_at": None if record.ended_at is None else record.ended_at.isoformat(),
        "stop_requested_by": record.stop_requested_by,
    }
    if record.running:
        now = canary.read(settings, store, record)
        d = now.decision
        row["now"] = {
            "episodes": {"challenger": now.challenger, "champion": now.champion},
            "difference": [round(d.difference.low, 4), round(d.difference.high, 4)],
            "test": d.outcome,
            "why": d.reason,
            "requests": {
                arm: {
                    "requests": now.traffic[arm]["requests"],
                    "errors": now.traffic[arm]["errors"],
                    "p95_s": now.traffic["latency"][f"{arm}_p95_s"],
                }
                for arm in ("canary", "fleet")
            },
        }
    elif record.decision is not None:
        row["decision"] = record.decision
    return row


@canary_app.command("status")
def status(
    last: int = typer.Option(
        3, "--last", min=0, help="Also show this many canaries that ended, newest first."
    ),
) -> None:
    """The running canary with its live numbers, and the last ones that ended (JSON lines); exit 0."""
    from schemas.settings import load_settings
    from store import Store

    settings = load_settings()
    with Store(settings.store.url) as store:
        store.check_schema()
        running = store.running_canary()
        if running is None:
            typer.echo(
                json.dumps(
                    {
                        "running": None,
                        "enabled": settings.gate.canary.enabled,
                        "server": settings.vllm.canary_server,
                    }
                )
            )
        ended = [r for r in store.recent_canaries(last + 1) if not r.running][:last]
        for record in ([running] if running is not None else []) + ended:
            typer.echo(json.dumps(_as_json(settings, store, record)))


@canary_app.command("stop")
def stop(
    reason: str = typer.Option("operator", help="Why, recorded with the canary."),
    wait: float = typer.Option(60.0, min=0, help="Seconds to wait for the runner to end it."),
) -> None:
    """End the running canary now: its server leaves the rotation, the challenger is not promoted.
    Exit 1 when nothing runs, or when it has not ended within --wait."""
    from deployer import canary
    from deployer.trust import actor
    from schemas.settings import load_settings
    from store import Store

    settings = load_settings()
    with Store(settings.store.url) as store:
        store.check_schema()
        running = store.running_canary()
        if running is None:
            typer.echo("no canary is running (`rtrl deploy canary status` shows the last ones)", err=True)
            raise typer.Exit(1)
        who = actor("rtrl deploy canary stop")
        store.request_canary_stop(running.id, who, reason)
        orphan = f"stopped by {who}: {reason} (no process was running it)"
        deadline = time.monotonic() + wait
        while True:
            reaped = canary.reap(settings, store, "stopped", orphan)  # no runner: end it here
            record = store.canary(running.id)
            assert record is not None
            if not record.running:
                typer.echo(json.dumps(_as_json(settings, store, record)))
                return
            if time.monotonic() >= deadline:
                typer.echo(
                    f"canary #{running.id} asked to stop but still running after {wait:g}s; its runner looks "
                    f"every gate.canary.check_every_s ({settings.gate.canary.check_every_s:g}s). {reaped or ''}",
                    err=True,
                )
                raise typer.Exit(1)
            time.sleep(0.5)
