"""The fleet reconciler: every server on ``@champion``, resumed and in rotation, without an operator.

`rtrl run` keeps ``rtrl deploy reconcile --forever`` running (a child of its supervisor), one tick
every ``deployer.reconcile_interval_s``. Each tick is `rollout.align_fleet` with ``keep_going``: a vLLM server that
restarted comes back on its base weights labelled "default" and is swapped back to the champion
(verified, out of the gateways' rotation while it changes); one that only lost its label is
relabelled after the probe passes; one a dead deployer left paused or out of rotation is resumed
and put back; a live canary whose runner died is ended and its server taken out of rotation
(deployer/canary.py `reap`). A tick during a rollout (the fleet lock held) does nothing; a server that cannot be
aligned is reported and retried at the next tick. Nothing a tick meets stops the loop.

With tenant adapters (docs/lora.md, An adapter per tenant), a tick then aligns each adapter
tenant's line the same way (`align_lines`): its adapter on every server loaded from its champion
(a restarted server has none), a line without a version given its identity v1 first. A line that
fails is reported under its label and the next one is still aligned.

Before aligning, a tick runs its `Revive` hook: ``rtrl deploy reconcile`` passes
`services.revive.Reviver`, which restarts the local vLLM servers whose process died (the
deployer itself does not start processes).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from deployer import canary, metrics
from deployer.errors import RolloutBusy
from deployer.rollout import FleetReport, align_fleet, bootstrap
from registry import Registry
from schemas.lines import all_lines
from schemas.settings import Settings
from serving import VllmClient
from store import Store

log = logging.getLogger(__name__)

Revive = Callable[[], dict[str, str | None]]
"""Restarts dead servers before a tick aligns them: {url: None when restarted, else why not}."""


def reconcile_once(
    settings: Settings, registry: Registry, revive: Revive | None = None
) -> FleetReport | None:
    """One tick; the report, or None when a rollout holds the fleet (nothing to align until it
    ends; servers `revive` restarted meanwhile stay out of rotation until the next tick)."""
    revived = {} if revive is None else revive()
    try:
        report = align_fleet(settings, registry, keep_going=True)
    except RolloutBusy:
        if revived:
            log.warning(
                "restarted %s; a rollout holds the fleet, aligning them at the next tick", sorted(revived)
            )
        return None
    try:
        align_lines(settings, report)
    except RolloutBusy:
        log.info("a rollout started while the tick aligned the tenants' adapters; the next tick goes on")
    report.canary = _reap_canary(settings)
    report.restarted = sorted(url for url, problem in revived.items() if problem is None)
    report.errors.update({url: problem for url, problem in revived.items() if problem is not None})
    return report


def align_lines(settings: Settings, report: FleetReport) -> None:
    """Align every adapter tenant's line (see the module docstring) into `report`: its champion in
    ``lines``, its swaps beside the global ones, its errors keyed ``<url or line> (tenant T)``.
    Raises RolloutBusy when a rollout holds the fleet."""
    if settings.trainer.adapter != "lora":
        return
    with Store(settings.store.url) as store:
        store.check_schema()
        tenants = store.adapter_tenants()
    for line in all_lines(settings, tenants)[1:]:
        registry = Registry.for_line(line)
        try:
            if not registry.versions():  # switched on since the last tick: its v1 is the identity
                bootstrap(line.settings, registry, settings.vllm.model_dir, keep_going=True)
            found = align_fleet(line.settings, registry, keep_going=True)
        except RolloutBusy:
            raise
        except Exception as exc:  # noqa: BLE001 - one line's failure must not stop the others'
            log.error("%s: cannot align its adapter: %r", line.label, exc)
            report.errors[line.label] = repr(exc)
            continue
        report.lines[str(line.tenant)] = found.champion
        report.swaps.extend(found.swaps)
        report.errors.update({f"{where} ({line.label})": why for where, why in found.errors.items()})


def _reap_canary(settings: Settings) -> str | None:
    """End a live canary whose runner died, and take its server out of rotation (`canary.reap`)."""
    if settings.vllm.canary_server is None:
        return None
    with Store(settings.store.url) as store:
        store.check_schema()
        return canary.reap(settings, store)


def observe_fleet(settings: Settings, champion: int | None) -> bool:
    """Set the per-server version and health gauges (deployer/metrics.py) from one look at every
    server; whether all of them serve `champion`."""
    agree = champion is not None
    staging = [settings.vllm.staging_server] if settings.vllm.staging_server else []
    for url in [*settings.vllm.servers, *staging]:
        with VllmClient(url, model=settings.vllm.served_model_name, timeout_s=3.0) as server:
            state = server.state()  # never raises
        name = url.rstrip("/")
        metrics.SERVER_UP.labels(name).set(1 if state.healthy else 0)
        if state.weight_version is not None:
            metrics.SERVER_VERSION.labels(name).set(state.weight_version)
        agree = agree and state.weight_version == champion
    metrics.FLEET_AGREES.set(1 if agree else 0)
    if champion is not None:
        metrics.CHAMPION.set(champion)
    return agree


def reconcile_forever(
    settings: Settings,
    registry: Registry,
    every_s: float,
    stop: threading.Event,
    revive: Revive | None = None,
    on_tick: Callable[[str, str], None] | None = None,
) -> None:
    """Tick every `every_s` seconds until `stop` is set; a tick that fails is logged and the next one runs.
    `on_tick(outcome, detail)` hears how each tick went (`rtrl deploy reconcile`'s readiness)."""
    while not stop.is_set():
        outcome, detail = "failed", ""
        try:
            report = reconcile_once(settings, registry, revive)
            if report is None:
                outcome = "busy"
                log.info("a rollout holds the fleet; next check in %.0fs", every_s)
            else:
                outcome = "error" if report.errors else "changed" if report.changed else "aligned"
                detail = "; ".join(f"{url}: {why}" for url, why in sorted(report.errors.items()))
                for url in report.restarted:
                    metrics.RESTARTS.labels(url).inc()
                if report.changed:
                    log.warning("reconciled the fleet to v%s: %s", report.champion, report.model_dump_json())
                observe_fleet(settings, report.champion)
        except Exception as exc:  # noqa: BLE001 - the store, MLflow or a server down: try again next tick
            detail = repr(exc)
            log.error("fleet check failed: %r; next check in %.0fs", exc, every_s)
        metrics.RECONCILE.labels(outcome).inc()
        if on_tick is not None:
            on_tick(outcome, detail)
        stop.wait(every_s)
