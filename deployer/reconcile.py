"""The fleet reconciler: every server on ``@champion``, resumed and in rotation, without an operator.

`rtrl run` keeps ``rtrl deploy reconcile --forever`` running (a child of its supervisor), one tick
every ``deployer.reconcile_interval_s``. Each tick is `rollout.align_fleet` with ``keep_going``: a vLLM server that
restarted comes back on its base weights labelled "default" and is swapped back to the champion
(verified, out of the gateways' rotation while it changes); one that only lost its label is
relabelled after the probe passes; one a dead deployer left paused or out of rotation is resumed
and put back. A tick during a rollout (the fleet lock held) does nothing; a server that cannot be
aligned is reported and retried at the next tick. Nothing a tick meets stops the loop.

Before aligning, a tick runs its `Revive` hook: ``rtrl deploy reconcile`` passes
`rtrl.services.revive.Reviver`, which restarts the local vLLM servers whose process died (the
deployer itself does not start processes).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from deployer.errors import RolloutBusy
from deployer.rollout import FleetReport, align_fleet
from registry import Registry
from schemas.settings import Settings

log = logging.getLogger(__name__)

Revive = Callable[[], dict[str, str | None]]
"""Restarts dead servers before a tick aligns them: {url: None when restarted, else why not}."""


def reconcile_once(settings: Settings, registry: Registry, revive: Revive | None = None) -> FleetReport | None:
    """One tick; the report, or None when a rollout holds the fleet (nothing to align until it
    ends; servers `revive` restarted meanwhile stay out of rotation until the next tick)."""
    revived = {} if revive is None else revive()
    try:
        report = align_fleet(settings, registry, keep_going=True)
    except RolloutBusy:
        if revived:
            log.warning("restarted %s; a rollout holds the fleet, aligning them at the next tick", sorted(revived))
        return None
    report.restarted = sorted(url for url, problem in revived.items() if problem is None)
    report.errors.update({url: problem for url, problem in revived.items() if problem is not None})
    return report


def reconcile_forever(
    settings: Settings, registry: Registry, every_s: float, stop: threading.Event, revive: Revive | None = None
) -> None:
    """Tick every `every_s` seconds until `stop` is set; a tick that fails is logged and the next one runs."""
    while not stop.is_set():
        try:
            report = reconcile_once(settings, registry, revive)
            if report is None:
                log.info("a rollout holds the fleet; next check in %.0fs", every_s)
            elif report.changed:
                log.warning("reconciled the fleet to v%s: %s", report.champion, report.model_dump_json())
        except Exception as exc:  # noqa: BLE001 - the store, MLflow or a server down: try again next tick
            log.error("fleet check failed: %r; next check in %.0fs", exc, every_s)
        stop.wait(every_s)
