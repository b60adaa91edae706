"""`rtrl deploy`: the MLflow registry, the eval gate and the verified hot-swap of the vLLM fleet.

    rtrl deploy bootstrap [MODEL_DIR]   register the base model as v1 @champion, set server versions
    rtrl deploy status                  champion/challenger and every server's version and pause state
    rtrl deploy gate VERSION            the eval gate on VERSION (as `rtrl gate run`)
    rtrl deploy promote VERSION         rolling verified swap, then move @champion (needs a passing
                                        gate decision, or --force --reason WHY)
    rtrl deploy rollback [--to VERSION] swap back to the previous champion
    ... promote|rollback --tenant T     the same on tenant T's adapter line only (docs/lora.md)
    rtrl deploy rotation [URL --in|--out] which servers the gateways route users to (and the live
                                        canary's server, with the canary running on it)
    rtrl deploy reconcile [--forever]   every server back on @champion, resumed, in rotation
    rtrl deploy canary status|stop      the live canary's numbers now; end it (rtrl/commands/canary.py)
    rtrl deploy prune [--dry-run]       delete checkpoints, downloads and rejected registry
                                        versions that deployer.retention does not keep

Promote, rollback and gate print their result as JSON and exit 1 when it is a failure. The fleet
serves what rtrl promoted, by its own record in the store: an @champion alias moved in MLflow by
hand is put back by the reconciler and shown by `status` (deployer/trust.py, docs/security.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from registry import Registry
    from schemas.settings import Settings
    from store import CanaryRecord, RotationRecord

deploy_app = typer.Typer(
    no_args_is_help=True, help="Registry versions, eval gate, verified hot-swap and rollback."
)


def _open(tenant: str | None = None) -> tuple[Settings, Registry]:
    """The settings and registry of the global line, or of `tenant`'s adapter line (its own
    registry model and served adapter: schemas/lines.py), which must be switched on."""
    from registry import Registry
    from schemas.lines import tenant_line
    from schemas.settings import load_settings

    settings = load_settings()
    if tenant is None:
        return settings, Registry.from_settings(settings)
    from store import Store

    with Store(settings.store.url) as store:
        store.check_schema()
        if tenant not in store.adapter_tenants():
            raise typer.BadParameter(
                f"tenant {tenant!r} has no adapter of its own (`rtrl tenants set {tenant} --adapter`)",
                param_hint="--tenant",
            )
    line = tenant_line(settings, tenant)
    return line.settings, Registry.for_line(line)


TENANT_OPTION = typer.Option(
    None, "--tenant", help="A tenant with an adapter of its own: act on its line only (docs/lora.md)."
)


@deploy_app.command("bootstrap")
def bootstrap(
    model_dir: Path | None = typer.Argument(
        None, help="Base HF checkpoint to register as v1 (default: settings.vllm.model_dir)."
    ),
) -> None:
    """Register the base model as version 1 @champion (once) and set every server's weight version."""
    from deployer.rollout import bootstrap as run_bootstrap

    settings, registry = _open()
    directory = model_dir or settings.vllm.model_dir
    if not (directory / "config.json").is_file():
        raise typer.BadParameter(
            f"{directory} is not an HF checkpoint folder (no config.json)", param_hint="MODEL_DIR"
        )
    champion = run_bootstrap(settings, registry, directory)
    typer.echo(json.dumps({"model": settings.mlflow.model_name, "champion": champion}))


@deploy_app.command("status")
def status(tenant: str | None = TENANT_OPTION) -> None:
    """Champion and challenger versions, and each server's weight version and pause state (with
    --tenant, the tenant line's, and the version of its adapter on each server)."""
    from registry import CHAMPION
    from serving import VllmClient
    from store import Store

    settings, registry = _open(tenant)
    alias = registry.alias(CHAMPION)
    with Store(settings.store.url) as store:
        store.check_schema()
        record = store.champion_record(registry.model_name)
        history = store.promotions(registry.model_name, limit=5)
        previous = store.previous_champion(registry.model_name)
    # rtrl's record decides; before the first record, the alias is what the next deployer adopts.
    champion = record.version if record is not None else alias
    servers = []
    urls = [(url, "serving") for url in settings.vllm.servers]
    if settings.vllm.staging_server is not None:
        urls.append((settings.vllm.staging_server, "staging"))
    for url, role in urls:
        with VllmClient(url, model=settings.vllm.served_model_name, timeout_s=10.0) as server:
            state = {"role": role, **server.state().model_dump()}
            if tenant is not None and state["healthy"]:  # the label is the global adapter's
                state["adapter_version"] = server.adapter_versions().get(settings.vllm.served_model_name)
            servers.append(state)
    challenger = registry.challenger() if champion is not None else None
    gate_tags = registry.version_tags(challenger) if challenger is not None else {}
    report = {
        "model": settings.mlflow.model_name,
        "champion": champion,
        "challenger": challenger,
        "challenger_gate": gate_tags.get("gate"),  # pass | fail | None (not judged yet)
        "challenger_gate_reason": gate_tags.get("gate_reason"),
        "previous_champion": previous,
        # The registry's alias when it disagrees with rtrl's record (moved outside rtrl: the next
        # reconcile puts it back), else None.
        "alias_refused": alias if record is not None and alias != record.version else None,
        "promotions": [
            {
                "version": p.version,
                "grounds": p.grounds,
                "actor": p.actor,
                "reason": p.reason,
                "at": p.promoted_at.isoformat(),
            }
            for p in history
        ],
        "servers": servers,
    }
    if report["alias_refused"] is not None:
        typer.echo(
            f"warning: @{CHAMPION} points at v{alias}, which rtrl did not promote; serving v{champion}. "
            f"`rtrl deploy promote {alias}` needs a passing gate decision (or --force --reason)",
            err=True,
        )

    typer.echo(json.dumps(report, indent=2))


@deploy_app.command("gate")
def gate(
    version: int = typer.Argument(..., min=1, help="Registered version to evaluate against @champion."),
) -> None:
    """Judge VERSION against the champion (as `rtrl gate run`); exit 1 when it fails the gate."""
    from rtrl.commands.gate import run_gate

    run_gate(version)


@deploy_app.command("promote")
def promote(
    version: int = typer.Argument(..., min=1, help="Registered version to serve."),
    force: bool = typer.Option(
        False, "--force", help="Serve VERSION without a passing gate decision (needs --reason; recorded)."
    ),
    reason: str | None = typer.Option(None, "--reason", help="Why it is forced: kept with who forced it."),
    tenant: str | None = TENANT_OPTION,
) -> None:
    """Swap every server to VERSION (verified, rolling) and move @champion; exit 1 on rollback.

    VERSION needs a passing gate decision (`rtrl gate run VERSION`) or to have served before;
    --force --reason WHY serves it anyway, recorded with who and why (`rtrl deploy status`)."""
    from deployer.rollout import promote as run_promote

    if force and reason is None:
        raise typer.BadParameter(
            "--force needs --reason 'WHY' (recorded with who forced it)", param_hint="--reason"
        )
    if reason is not None and not force:
        raise typer.BadParameter("--reason goes with --force", param_hint="--reason")
    settings, registry = _open(tenant)
    result = run_promote(settings, registry, version, force_reason=reason if force else None, role="cli")
    typer.echo(result.model_dump_json(indent=2))
    if not result.ok:
        raise typer.Exit(1)


@deploy_app.command("rollback")
def rollback(
    to: int | None = typer.Option(
        None, "--to", min=1, help="Version to serve (default: the previous champion)."
    ),
    tenant: str | None = TENANT_OPTION,
) -> None:
    """Serve the previous champion (or --to VERSION) again: re-swap the fleet and move @champion.
    With --tenant, only that tenant's adapter changes on the servers."""
    from deployer.rollout import rollback as run_rollback

    settings, registry = _open(tenant)
    result = run_rollback(settings, registry, to, role="cli")
    typer.echo(result.model_dump_json(indent=2))
    if not result.ok:
        raise typer.Exit(1)


@deploy_app.command("reconcile")
def reconcile(
    forever: bool = typer.Option(
        False,
        "--forever",
        help="Keep checking every deployer.reconcile_interval_s until SIGTERM (what `rtrl run` runs).",
    ),
    every: float | None = typer.Option(
        None, "--every", min=1.0, help="With --forever: check every SECONDS instead."
    ),
) -> None:
    """Bring every server back to @champion: restart a local vLLM server that died (one `rtrl services
    up` started), swap one on other weights (a restart puts a server back on its base model), relabel
    one that lost its label, resume one left paused and put back one left out of rotation by a
    deployer that died. Prints what it did as JSON; exit 1 when a server could not be restarted or
    aligned, 2 while a rollout holds the fleet."""
    import signal
    import threading

    from deployer.reconcile import reconcile_forever, reconcile_once
    from services.revive import Reviver

    settings, registry = _open()
    revive = Reviver(settings)  # restarts the local vLLM servers that died (services.restart_vllm)
    if not forever:
        report = reconcile_once(settings, registry, revive)
        if report is None:
            typer.echo("a rollout holds the fleet; run this again when it has finished", err=True)
            raise typer.Exit(2)
        typer.echo(report.model_dump_json(indent=2))
        if report.errors:
            raise typer.Exit(1)
        return
    from services.logs import setup_logging
    from telemetry import Readiness, start_exporter

    setup_logging()
    readiness = Readiness()
    readiness.set("fleet", False, "first check not done yet")
    start_exporter(settings, "reconciler", readiness)  # /metrics, /healthz, /readyz (docs/metrics.md)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # finish the tick under way, then exit
    reconcile_forever(
        settings,
        registry,
        every or settings.deployer.reconcile_interval_s,
        stop,
        revive,
        on_tick=lambda outcome, detail: readiness.set(
            "fleet", outcome in ("aligned", "changed", "busy"), detail
        ),
    )


@deploy_app.command("rotation")
def rotation(
    url: str | None = typer.Argument(None, help="A serving server's URL (one of RTRL_VLLM__SERVERS)."),
    in_rotation: bool | None = typer.Option(
        None, "--in/--out", help="Put the server back in rotation, or take it out."
    ),
    reason: str = typer.Option("operator", help="Why, shown by `rtrl deploy rotation`."),
) -> None:
    """Show which servers the gateways route users to (the serving fleet, and the live canary's server
    with the canary running on it, if any), or take a serving server out / put it back.

    A swap takes each server out while it is drained, paused and verified (when the fleet has more
    than one), and puts it back after; use this to do it by hand (maintenance, or a swap that could
    not put its server back because the store was down). The canary's server is the canary's runner's
    to move: `rtrl deploy canary stop` ends a running canary and takes it out."""
    from schemas.settings import load_settings
    from store import Store

    settings = load_settings()
    if url is not None or in_rotation is not None:
        _check_rotation_target(settings, url, in_rotation)
    with Store(settings.store.url) as store:
        store.check_schema()
        if url is not None and in_rotation is not None:
            store.set_rotation(url, in_rotation, reason)
        rows = store.rotation()
        running = store.running_canary()
    for server in settings.vllm.servers:
        typer.echo(json.dumps(_rotation_line(server, "serving", rows.get(server.rstrip("/")))))
    for line in _canary_lines(settings, rows, running):
        typer.echo(json.dumps(line))


def _canary_lines(
    settings: Settings, rows: dict[str, RotationRecord], running: CanaryRecord | None
) -> list[dict[str, Any]]:
    """The canary's server's line (`role` canary) with the canary running on it, if any; and the
    server a canary still runs on when the setting has changed since it started."""
    urls = [u.rstrip("/") for u in (settings.vllm.canary_server, running and running.server) if u]
    lines = []
    for url in dict.fromkeys(urls):
        line = _rotation_line(url, "canary", rows.get(url))
        on_it = running is not None and running.server.rstrip("/") == url
        line["running_canary"] = (
            None
            if running is None or not on_it
            else {
                "canary": running.id,
                "version": running.challenger_version,
                "champion": running.champion_version,
                "share": running.share,
                "started_at": running.started_at.isoformat(),
                "stop_requested_by": running.stop_requested_by,
            }
        )
        lines.append(line)
    return lines


def _check_rotation_target(settings: Settings, url: str | None, in_rotation: bool | None) -> None:
    """Refuse a rotation change by hand that is not for one serving server of the fleet."""
    from schemas.errors import OperatorError

    if url is None or in_rotation is None:
        raise typer.BadParameter("give a URL and --in or --out", param_hint="URL")
    canary = (settings.vllm.canary_server or "").rstrip("/")
    if canary and url.rstrip("/") == canary:
        # The runner puts it in after its verified swap and takes it out at every ending; the
        # reconciler keeps it out while none runs. By hand, --out ends a canary as `aborted` (or is
        # undone by the runner mid-load) and --in sends users to whatever weights it last loaded.
        raise OperatorError(
            f"{url} is the live canary's server, which the canary's runner takes in and out of rotation; "
            "`rtrl deploy canary stop` ends a running canary and takes it out"
        )
    known = [u.rstrip("/") for u in settings.vllm.servers]
    if url.rstrip("/") not in known:
        raise typer.BadParameter(f"{url} is not a serving server ({', '.join(known)})", param_hint="URL")


def _rotation_line(url: str, role: str, row: RotationRecord | None) -> dict[str, Any]:
    """One server's line of `rtrl deploy rotation`. No row: a serving server is in rotation (it was
    never taken out), the canary's server is out (no canary ever put it in, ingest/routing.py)."""
    from schemas.versions import format_version

    return {
        "url": url,
        "role": role,  # serving | canary
        "in_rotation": (role == "serving") if row is None else row.in_rotation,
        "reason": None if row is None else row.reason,
        "since": None if row is None else row.updated_at.isoformat(),
        # What the deployer announced to the gateways (None: a swap in progress, or never).
        "announced_version": None if row is None or row.version is None else format_version(row.version),
        "announced_epoch": None if row is None else row.epoch,
    }


@deploy_app.command("prune")
def prune(
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what would be deleted; change nothing."),
    verbose: bool = typer.Option(False, "--verbose", help="Also print what is kept, and why."),
) -> None:
    """Delete the cycle checkpoints, downloaded versions and registry versions the gate rejected that
    deployer.retention does not keep (the champion, the previous champions, what a server serves, a
    challenger in flight and the anchor always stay; nothing younger than min_age_s goes). One line
    per deletion, then a summary; exit 1 when a deletion failed (the next run tries it again).
    Safe while a cycle runs, and idempotent (docs/runbooks/deployer.md, Artefact retention)."""
    from deployer.artefacts import prune as run_prune
    from store import Store

    settings, registry = _open()
    with Store(settings.store.url) as store:
        store.check_schema()
        report = run_prune(settings, registry, store, dry_run=dry_run)
    verb = "would delete" if dry_run else "deleted"
    for decision in report.decisions:
        if decision.delete or verbose:
            word = verb if decision.delete else "kept"
            typer.echo(f"{word} {decision.artefact.kind} {decision.artefact.name}: {decision.reason}")
    for error in report.errors:
        typer.echo(f"error: {error}", err=True)
    typer.echo(report.summary())
    if report.errors:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add `rtrl deploy ...` to the root app."""
    from rtrl.commands.canary import canary_app

    deploy_app.add_typer(canary_app, name="canary")
    app.add_typer(deploy_app, name="deploy")
