"""The cycle chain: train → eval gate → deploy, one cycle from lease to the promoted fleet.

`run_chain` is run by the Celery task ``rtrl.train_cycle`` (worker/tasks.py) and by ``rtrl train
now --inline`` (no Celery). It joins the two stages that never import each other: the trainer
(`trainer.cycle.run_cycle`: lease, select, train, register the challenger) and the deployer
(`deployer.gate.evaluate`, then `deployer.rollout.promote`), each given the store and the registry
the caller holds.

The gate, the canary and the promotion each take a deploy lock in the store ("staging", "canary",
"rollout"); the chain waits up to ``deployer.lock_wait_s`` for one that a reconciler tick (or an
operator) holds, so a registered challenger does not fail for a moment's collision. Two workers
never reach these together: the cycle lease admits one cycle at a time (docs/scaling.md). A worker
told to stop (`stopping`: SIGTERM's warm shutdown) gives that wait up within 0.2 s
(`deployer.errors.WaitStopped`, a RolloutBusy): the cycle fails after registration as for a lock
that stayed held, its version registered and never promoted.

With ``gate.canary.enabled``, a challenger the gate passed serves the live canary first
(`deployer.canary.run`) and only a canary that passes is promoted; any other ending rejects it.

A chain runs one line (schemas/lines.py, docs/lora.md "An adapter per tenant"): the global line,
or a tenant's adapter line, whose settings name its registry model and served adapter and whose
tenant filters the episodes the cycle selects. Everything below runs on the line's settings and
registry, so the gate, the canary and the promotion are the line's own.

The cycle ends ``promoted``, ``rejected`` (the gate or the canary said no: its episodes stay used) or ``failed``
(its episodes are released). After registration a failure is final (`AfterRegistration`): a retry
would train and register another version.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from registry import Registry
from schemas.clock import utcnow
from schemas.lines import Line
from schemas.settings import Settings
from store import Store
from trainer import metrics
from trainer.errors import Abandoned, AfterRegistration
from trainer.lease import keep_lease

if TYPE_CHECKING:
    from deployer.swap import LockWait
    from trainer.cycle import CycleResult

log = logging.getLogger(__name__)


def run_chain(
    settings: Settings,
    store: Store,
    registry: Registry,
    *,
    owner: str,
    takeover_suffix: str | None = None,
    stopping: Callable[[], bool] = lambda: False,
    line: Line | None = None,
) -> dict[str, Any]:
    """train → gate → promote. Shared by the task and ``rtrl train now --inline``.

    `line`: a tenant's adapter line (its own settings and registry replace `settings` and
    `registry`); None, the global line. ``line`` in the result names the tenant (None: global).

    Returns the CycleResult as JSON plus: ``status`` (the cycle's final status: promoted,
    rejected or failed; busy / not_enough_data when no cycle ran; abandoned when `stopping`
    answered True first, the cycle failed and its episodes released), ``gate`` (pass/fail),
    ``challenger_score`` / ``champion_score``, ``version_after`` (the served version N),
    ``swap_ms``, ``deployed_at`` and ``data_to_deploy_s`` (deployed_at − first interaction).
    """
    started = time.monotonic()
    metrics.cycle_started(time.time())
    tenant = None if line is None else line.tenant
    if line is not None and tenant is not None:
        settings, registry = line.settings, Registry.for_line(line)
    out: dict[str, Any] = {"status": "failed"}
    try:
        # Renewed from a thread for the whole job (training, gate, swap): the lease outlives a long cycle,
        # and expires within trainer.lease_ttl_s of this worker's death (trainer/lease.py).
        with keep_lease(store, owner, settings.trainer.lease_ttl_s):
            out = _chain(
                settings,
                store,
                registry,
                owner=owner,
                takeover_suffix=takeover_suffix,
                stopping=stopping,
                tenant=tenant,
            )
        out["line"] = tenant
        return out
    finally:
        metrics.cycle_ended(out, time.monotonic() - started)


def _chain(
    settings: Settings,
    store: Store,
    registry: Registry,
    *,
    owner: str,
    takeover_suffix: str | None,
    stopping: Callable[[], bool],
    tenant: str | None,
) -> dict[str, Any]:
    """The cycle (of `tenant`'s line), then, for a registered challenger, the gate and the fleet (`_gate_and_promote`).
    After registration any exception fails the cycle; an Exception is raised again as the final
    `AfterRegistration`."""
    from trainer.cycle import end_cycle, run_cycle

    try:
        result = run_cycle(
            settings,
            store,
            registry,
            owner=owner,
            takeover_suffix=takeover_suffix,
            stopping=stopping,
            tenant=tenant,
        )
    except Abandoned as exc:  # the cycle is failed and its episodes released already
        log.warning("%s", exc)
        return {"status": "abandoned", "error": str(exc), "gate": None}
    out: dict[str, Any] = result.model_dump(mode="json")
    out.update(
        gate=None,
        challenger_score=None,
        champion_score=None,
        swap_ms=None,
        deployed_at=None,
        data_to_deploy_s=None,
        version_after=result.champion_version,
    )
    if result.status != "registered":
        return out
    assert result.cycle_id is not None and result.challenger_version is not None
    if stopping():  # SIGTERM while it saved and registered: the gate would outlast the grace
        end_cycle(
            settings,
            store,
            result.cycle_id,
            "failed",
            error="the worker is stopping; abandoned before the gate",
        )
        out["status"] = "abandoned"
        return out
    try:
        return _gate_and_promote(settings, store, registry, result, out, stopping)
    except BaseException as exc:
        # The registered version stays (@challenger, never @champion); the cycle must not stay
        # active until its lease expires.
        end_cycle(
            settings,
            store,
            result.cycle_id,
            "failed",
            error=f"after registration: {type(exc).__name__}: {exc}"[:10_000],
        )
        if isinstance(exc, Exception):
            # Even a transient cause is final here: a retry would train and register another version.
            raise AfterRegistration(f"v{result.challenger_version}: {type(exc).__name__}: {exc}") from exc
        raise


def _gate_and_promote(
    settings: Settings,
    store: Store,
    registry: Registry,
    result: CycleResult,
    out: dict[str, Any],
    stopping: Callable[[], bool],
) -> dict[str, Any]:
    """The registered challenger through the eval gate: a fail ends the cycle ``rejected``, a pass
    promotes it (`_promote`). Returns `out` with the gate's decision and scores."""
    from deployer import gate
    from trainer.cycle import end_cycle

    assert result.cycle_id is not None and result.challenger_version is not None
    gate_started = time.monotonic()
    decision = gate.evaluate(
        settings, registry, result.challenger_version, store, lock_wait=_lock_wait(settings, stopping)
    )
    out["gate_s"] = round(time.monotonic() - gate_started, 3)
    out.update(
        gate="pass" if decision.passed else "fail",
        gate_reason=decision.reason,
        challenger_score=decision.challenger_score,
        champion_score=decision.champion_score,
    )
    gate_metrics = {
        "gate": out["gate"],
        "gate_reason": decision.reason,
        "challenger_score": decision.challenger_score,
        "champion_score": decision.champion_score,
    }
    if not decision.passed:
        end_cycle(settings, store, result.cycle_id, "rejected", metrics=gate_metrics)
        out["status"] = "rejected"
        return out
    if settings.gate.canary.enabled and registry.tenant is not None:
        # The live canary routes a share of every tenant's users to one server: a tenant line's canary
        # (that tenant's share only) is not built, and a challenger never skips a canary it was given.
        why = "the live canary does not run for a tenant's adapter yet (docs/lora.md, An adapter per tenant)"
        end_cycle(settings, store, result.cycle_id, "rejected", metrics=gate_metrics | {"canary_reason": why})
        out.update(status="rejected", gate="fail", gate_reason=why)
        return out
    if settings.gate.canary.enabled:
        return _canary_then_promote(
            settings, store, registry, result, out, gate_metrics, decision.champion_version, stopping
        )
    return _promote(settings, store, registry, result, out, gate_metrics, stopping)


def _canary_then_promote(
    settings: Settings,
    store: Store,
    registry: Registry,
    result: CycleResult,
    out: dict[str, Any],
    gate_metrics: dict[str, Any],
    champion: int,
    stopping: Callable[[], bool],
) -> dict[str, Any]:
    """The challenger that passed the offline gate serves the live canary (deployer/canary.py); only
    a canary that passes promotes it. Any other ending rejects the cycle, its numbers recorded."""
    from deployer import canary
    from trainer.cycle import end_cycle

    assert result.cycle_id is not None and result.challenger_version is not None
    outcome = canary.run(
        settings,
        registry,
        store,
        result.challenger_version,
        champion,
        cycle_id=result.cycle_id,
        stopping=stopping,
        lock_wait=_lock_wait(settings, stopping),
    )
    out["canary"] = outcome.model_dump(mode="json")
    gate_metrics = gate_metrics | {
        "canary": outcome.state,
        "canary_reason": outcome.reason,
        "canary_id": outcome.canary_id,
        "canary_episodes": outcome.episodes,
    }
    if not outcome.passed:
        end_cycle(settings, store, result.cycle_id, "rejected", metrics=gate_metrics)
        out.update(status="rejected", gate="fail", gate_reason=f"canary {outcome.state}: {outcome.reason}")
        return out
    return _promote(settings, store, registry, result, out, gate_metrics, stopping)


def _promote(
    settings: Settings,
    store: Store,
    registry: Registry,
    result: CycleResult,
    out: dict[str, Any],
    gate_metrics: dict[str, Any],
    stopping: Callable[[], bool],
) -> dict[str, Any]:
    """The challenger that passed the gate onto the fleet: the cycle ends ``promoted``, or ``failed``
    when the swap fails. Returns `out` with the swap, its timings and the served version."""
    from deployer import rollout
    from trainer.cycle import end_cycle

    assert result.cycle_id is not None and result.challenger_version is not None
    deploy_started = time.monotonic()
    swap = rollout.promote(
        settings,
        registry,
        result.challenger_version,
        store=store,
        role="worker",
        lock_wait=_lock_wait(settings, stopping),
    )
    out["deploy_s"] = round(time.monotonic() - deploy_started, 3)
    out["swap"] = swap.model_dump(mode="json")
    if not swap.ok:
        # Not deployed (the fleet is back on the champion): the data was not learnt from in
        # production, so the cycle fails and its episodes go back to the pool.
        end_cycle(
            settings,
            store,
            result.cycle_id,
            "failed",
            metrics=gate_metrics,
            error=f"swap failed: {swap.error}",
        )
        out["status"] = "failed"
        return out
    deployed_at = utcnow()
    out.update(
        status="promoted",
        version_after=result.challenger_version,
        swap_ms=swap.swap_ms,
        deployed_at=deployed_at.isoformat(),
    )
    if result.first_interaction_at is not None:
        out["data_to_deploy_s"] = round((deployed_at - result.first_interaction_at).total_seconds(), 3)
    end_cycle(
        settings,
        store,
        result.cycle_id,
        "promoted",
        metrics=gate_metrics
        | {
            "swap_ms": swap.swap_ms,
            "deployed_at": out["deployed_at"],
            "data_to_deploy_s": out["data_to_deploy_s"],
        },
    )
    return out


def _lock_wait(settings: Settings, stopping: Callable[[], bool]) -> LockWait:
    """How the chain waits for a deploy lock: up to ``deployer.lock_wait_s``, and not past the
    worker's shutdown (`stopping`), so SIGTERM is not answered only once the lock comes free."""
    from deployer.swap import LockWait

    return LockWait(settings.deployer.lock_wait_s, stopping)
