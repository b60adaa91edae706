"""The verified rolling hot-swap of the vLLM fleet, and rollback.

`promote(settings, registry, version)` swaps every server in ``settings.vllm.servers`` one at a time
(the first is the canary) with the verified swap of one server (deployer/swap.py: pause → reload →
digests → version → prefix-cache reset → resume → probe), each inside its `swap_window`: with more
than one server it leaves the gateways' rotation and is drained first.

A failed reload or verify restores the previous champion on that server, swaps back every server
already done, leaves the registry alias where it was and returns ``ok=False`` with the reason.
Only a fully verified fleet moves ``@champion``. When the version has no recorded digests yet,
the canary's (once its probe passed) become the baseline for the rest of the fleet.

A promotion needs grounds in rtrl's own store (deployer/trust.py): a passing gate decision, or a
version that served before; an operator's ``--force`` is recorded with who and why. Every move of
@champion is recorded there first, and the fleet follows that record, not an alias moved by hand.

`rollback` is a promotion of the previous champion. `align_fleet` brings servers that restarted (or
were never given a version) back to the champion, and resumes and puts back what a deployer that
died mid-swap left paused or out of rotation; `bootstrap` registers the base model as v1
@champion when the registry is empty and then aligns the fleet. One rollout (and one gate run
on the staging server) at a time per store, whichever host it runs on (`rollout_lock`: a lock in
the store, store/locks.py); the digests the swaps are verified against are kept in the store too.

Called by the worker's chain after a passing gate (worker/chain.py, with the store it holds), by
``rtrl run`` / the demo before the loop starts (`bootstrap`), by the fleet reconciler
(deployer/reconcile.py, a child of ``rtrl run``), and by ``rtrl deploy
bootstrap|promote|rollback|reconcile``.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from deployer import metrics, trust
from deployer.errors import NothingToRollBack, RolloutBusy
from deployer.swap import (
    DEPLOYER_MARK,
    NO_WAIT,
    Drain,
    LockWait,
    ServerSwap,
    Target,
    deploy_dir,
    failed_step,
    probe_diff,
    probe_tolerance,
    rollout_lock,
    save_digests,
    server_client,
    swap_server,
    swap_window,
    target,
)
from deployer.tied import with_tied_head
from registry import CHAMPION, Registry, RegistryError
from schemas.clock import utcnow
from schemas.settings import Settings
from serving import CallFailed, ServerError, ServingError, VersionUnknown, VllmClient, meaningful_digests
from serving.adapters import write_identity_adapter
from store import Store

log = logging.getLogger(__name__)


class SwapResult(BaseModel):
    """Outcome of a promotion or rollback over the whole fleet."""

    model_config = ConfigDict(frozen=True)

    ok: bool
    version: int = Field(description="Version asked for.")
    previous_version: int = Field(description="Champion before the call (still champion when ok is False).")
    servers: list[ServerSwap]
    swap_ms: float = Field(description="Longest pause window over the servers.")
    rolled_back: bool = Field(description="Servers were put back on previous_version after a failure.")
    error: str | None = None


def _swap_fleet(
    settings: Settings, registry: Registry, store: Store, version: int, previous: int
) -> SwapResult:
    want = target(settings, registry, store, version)
    back = want if previous == version else target(settings, registry, store, previous)
    return _swap_servers(settings, registry, store, want, back, previous)


def _swap_one(
    settings: Settings, store: Store, url: str, want: Target, restore: Target | None
) -> tuple[ServerSwap, dict[str, str]]:
    """Swap one serving server inside its `swap_window`. With more than one server, each leaves the
    gateways' rotation and is drained before its pause, so no user request waits for a paused
    server; a lone server is swapped in place (its requests wait out the pause)."""
    drain = len(settings.vllm.servers) > 1
    with server_client(settings, url) as server:
        try:
            label = _label(server) if want.tenant is not None else None
            with swap_window(settings, store, server, f"swap to v{want.version}", drain) as window:
                step, digests = swap_server(server, want, settings, restore=restore)
                if want.tenant is not None:
                    window.serving = label  # a tenant's adapter changed; the global one serves as before
                elif step.verified:
                    window.serving = want.version
                elif step.restored and restore is not None:
                    window.serving = restore.version
        except (ServingError, CallFailed) as exc:
            metrics.SWAPS.labels("failed").inc()
            return failed_step(url, want.version, exc), {}
    extra = {
        "drained": window.drained,
        "drain_ms": window.drain_ms,
        "in_flight_at_drain": window.in_flight_at_drain,
        "in_flight_at_pause": window.in_flight_at_pause,
    }
    metrics.record_swap(url, step.verified, step.restored, step.pause_ms, window.serving)
    return step.model_copy(update=extra), digests


def _swap_servers(
    settings: Settings,
    registry: Registry,
    store: Store,
    want: Target,
    back: Target,
    previous: int,
) -> SwapResult:
    """Swap the servers one by one to `want`; after a failure, put the ones done back on `back`."""
    version = want.version
    steps: list[ServerSwap] = []
    done: list[str] = []
    failure: str | None = None
    for url in settings.vllm.servers:
        step, digests = _swap_one(settings, store, url, want, back)
        steps.append(step)
        if not step.verified:
            failure = f"{url}: {step.error}"
            break
        done.append(url)
        if want.digests is None and meaningful_digests(digests):
            # The canary passed the probe: its digests vouch for this version on the rest.
            save_digests(settings, store, version, digests)
            want = target(settings, registry, store, version)

    rolled_back = False
    if failure is not None and done:
        rolled_back = True
        for url in reversed(done):
            step, _ = _swap_one(settings, store, url, back, None)
            steps.append(step)
            if not step.verified:
                failure += f"; rolling {url} back to v{previous} failed: {step.error}"
    return SwapResult(
        ok=failure is None,
        version=version,
        previous_version=previous,
        servers=steps,
        swap_ms=max((s.pause_ms for s in steps), default=0.0),
        rolled_back=rolled_back or any(s.restored for s in steps),
        error=failure,
    )


def promote(
    settings: Settings,
    registry: Registry,
    version: int,
    *,
    store: Store | None = None,
    force_reason: str | None = None,
    role: str = "",
    lock_wait: LockWait = NO_WAIT,
) -> SwapResult:
    """Swap the fleet to `version` and, when every server verified, record the promotion and move
    @champion to it. Raises NotAuthorized before touching a server when `version` has no grounds
    (deployer/trust.py) and no `force_reason` is given; `role` names the caller in the record.
    Raises RolloutBusy when the fleet's lock stays held past `lock_wait` (`NO_WAIT`: at once).

    The lock, the digests and the swaps' announcements are in `store`: the caller's (the worker's
    chain passes the one it holds, its schema checked when it was opened), else one opened, checked
    and closed here."""
    if store is not None:
        return _promote(settings, registry, store, version, force_reason, role, lock_wait)
    own = Store(settings.store.url)
    try:
        own.check_schema()
        return _promote(settings, registry, own, version, force_reason, role, lock_wait)
    finally:
        own.close()


def _promote(
    settings: Settings,
    registry: Registry,
    store: Store,
    version: int,
    force_reason: str | None,
    role: str,
    lock_wait: LockWait,
) -> SwapResult:
    with lock_wait.hold(store, "rollout", f"promote v{version}"):
        previous = trust.champion(registry, store)  # first: adopts the alias when no record exists yet
        grounds = trust.grounds(registry, store, version, force_reason)  # or NotAuthorized, nothing touched
        result = _swap_fleet(settings, registry, store, version, previous)
        metrics.ROLLOUTS.labels("ok" if result.ok else "failed").inc()
        if result.ok:
            # The record first: an alias set without it would be refused by the next reconcile.
            store.record_promotion(
                registry.model_name,
                version,
                grounds.kind,
                trust.actor(role),
                grounds.reason,
                grounds.gate_decision_id,
            )
            registry.set_alias(CHAMPION, version)
            metrics.CHAMPION.set(version)
            if version != previous:
                registry.set_previous_champion(previous)
        registry.tag_version(
            version,
            {
                "deploy": "ok" if result.ok else "failed",
                "deploy_at": utcnow().isoformat(),
                "deploy_error": (result.error or "")[:4000],
            },
        )
        return result


def rollback(
    settings: Settings,
    registry: Registry,
    to_version: int | None = None,
    *,
    store: Store | None = None,
    role: str = "",
) -> SwapResult:
    """Serve `to_version` (default: the champion rtrl promoted before this one) again: re-swap the
    fleet, move @champion (`promote`, in `store` when given). A version that never served needs
    ``rtrl deploy promote --force``."""
    if to_version is None:
        with Store(settings.store.url) as own:
            own.check_schema()
            to_version = own.previous_champion(registry.model_name)
        if to_version is None:
            raise NothingToRollBack(
                "no previous champion recorded; pass the version to roll back to (--to N)"
            )
    return promote(settings, registry, to_version, store=store, role=role)


def bootstrap(settings: Settings, registry: Registry, model_dir: Path, *, keep_going: bool = False) -> int:
    """Register `model_dir` (with ``trainer.adapter=lora``: an identity adapter on it) as version 1
    @champion when the registry has no version, then make every
    server (fleet and staging) report the champion's weight version; returns the champion.

    Idempotent: a second call finds the champion and only re-checks the servers (`align_fleet`:
    a server whose weights pass the champion's probe is relabelled, any other is swapped). With
    `keep_going` (``rtrl run``'s preparation), a server that cannot be aligned is logged and left
    to the fleet reconciler instead of failing the bootstrap.
    """
    if not registry.versions():
        if settings.trainer.adapter == "lora":
            # v1 of a LoRA registry is the identity adapter on the base model (A·B = 0): the base
            # model's outputs, and the adapter the first cycle trains (docs/lora.md).
            lora = settings.trainer.lora
            first = write_identity_adapter(
                model_dir,
                deploy_dir(settings) / "v1-adapter",
                rank=lora.rank,
                alpha=lora.alpha,
                dropout=lora.dropout,
                target_modules=lora.target_modules,
            )
            tags = {"rtrl.base": "true", "rtrl.adapter": "lora", "rtrl.base_model": str(model_dir.resolve())}
            version = registry.register_checkpoint(first, tags=tags)
        else:
            # A tied head written out, so that a server can be swapped back to v1 (deployer/tied.py).
            base = with_tied_head(model_dir, deploy_dir(settings) / "v1-base")
            version = registry.register_checkpoint(base, tags={"rtrl.base": "true"})
        if version != 1:
            raise RegistryError(
                f"registered the base model as version {version}; expected 1 (concurrent bootstrap?)"
            )
        with Store(settings.store.url) as store:
            store.check_schema()
            store.record_promotion(
                registry.model_name, version, "bootstrap", trust.actor("bootstrap"), f"base model {model_dir}"
            )
        registry.set_alias(CHAMPION, version)
    report = align_fleet(settings, registry, keep_going=keep_going)
    champion = report.champion
    assert champion is not None  # align_fleet raises NoChampion otherwise
    for url, problem in report.errors.items():
        log.warning(
            "%s not on @champion v%d yet (%s); the fleet reconciler retries it", url, champion, problem
        )
    return champion


def align_fleet(settings: Settings, registry: Registry, *, keep_going: bool = False) -> FleetReport:
    """Make every server (fleet and staging) serve the champion, resumed, and report its version.

    A server reporting the champion's version is left alone. A server reporting another version
    (or none) whose weights pass the champion's probe (a fresh server started on the base model
    while the champion is v1, a label lost in a restart) only gets the version set. Any other
    server (a restart put it back on base weights, or a swap died half-way) is swapped to the
    champion with the verified swap, out of the gateways' rotation when the fleet has more than one
    server. A server left paused, or out of rotation, by a deployer that died mid-swap is resumed
    and put back. The staging server is skipped while the gate holds it.

    Raises ServerError at the first server that cannot be brought to the champion, or, with
    `keep_going` (the reconciler), records the error and goes on with the next server.
    Raises RolloutBusy when a rollout holds the fleet.
    """
    report = FleetReport()
    store = Store(settings.store.url)
    try:
        store.check_schema()  # the lock, the digests and what each server serves are there
        with rollout_lock(store, "rollout", "align the fleet to @champion"):
            alias = trust.guard_alias(registry, store)  # an alias moved outside rtrl is put back
            version = report.champion = alias.champion
            if not alias.agrees:
                report.alias_refused = alias.alias
            want = target(settings, registry, store, version)
            rotation = store.rotation()
            drain = len(settings.vllm.servers) > 1
            for url in settings.vllm.servers:
                _align_one(settings, url, want, store, drain, report, keep_going)
                row = rotation.get(url.rstrip("/"))
                if row is not None and not row.in_rotation and row.reason.startswith(DEPLOYER_MARK):
                    store.set_rotation(
                        url, True, f"reconciled: back after {row.reason[len(DEPLOYER_MARK) :]}"
                    )
                    report.returned_to_rotation.append(url.rstrip("/"))
        if settings.vllm.staging_server is not None:  # no gateway routes to it: nothing to announce
            try:
                with rollout_lock(store, "staging", "align staging to @champion"):
                    _align_one(
                        settings,
                        settings.vllm.staging_server,
                        want,
                        store,
                        False,
                        report,
                        keep_going,
                        announce=False,
                    )
            except RolloutBusy:
                report.skipped.append(settings.vllm.staging_server.rstrip("/"))  # the gate is using it
    finally:
        store.close()
    return report


class FleetReport(BaseModel):
    """What `align_fleet` found and did."""

    champion: int | None = None
    alias_refused: int | None = Field(
        None,
        description="The version @champion pointed at though rtrl never promoted it; the alias was put back "
        "(deployer/trust.py).",
    )
    restarted: list[str] = Field(
        default_factory=list,
        description="Dead servers restarted first (`rtrl deploy reconcile` on local services).",
    )
    swaps: list[ServerSwap] = Field(default_factory=list, description="Servers swapped to the champion.")
    relabelled: list[str] = Field(
        default_factory=list, description="Servers on the champion's weights under another label."
    )
    resumed: list[str] = Field(default_factory=list, description="Servers found paused outside any swap.")
    returned_to_rotation: list[str] = Field(
        default_factory=list, description="Servers a dead deployer had left out of the gateways' rotation."
    )
    skipped: list[str] = Field(default_factory=list, description="Staging server, in use by the gate.")
    errors: dict[str, str] = Field(
        default_factory=dict, description="Servers that could not be aligned, and why."
    )
    canary: str | None = Field(
        None, description="A canary whose runner died, ended by the reconciler (deployer/canary.py `reap`)."
    )
    lines: dict[str, int | None] = Field(
        default_factory=dict,
        description="Each adapter tenant's line aligned by the reconciler, with its champion "
        "(docs/lora.md, An adapter per tenant); its swaps and errors are with the global ones.",
    )

    @property
    def changed(self) -> bool:
        return bool(
            self.alias_refused is not None
            or self.restarted
            or self.swaps
            or self.relabelled
            or self.resumed
            or self.returned_to_rotation
            or self.errors
            or self.canary is not None
        )


def _align_one(
    settings: Settings,
    url: str,
    want: Target,
    store: Store,
    drain: bool,
    report: FleetReport,
    keep_going: bool,
    *,
    announce: bool = True,
) -> None:
    try:
        with server_client(settings, url) as server:
            if server.is_paused():  # we hold the lock: no swap of ours is under way
                log.warning(
                    "%s was paused outside any swap (a deployer died mid-swap?): resuming it", server.url
                )
                server.resume()
                report.resumed.append(server.url)
            done, step = _align(settings, server, want, store, drain, announce=announce)
    except (ServingError, CallFailed) as exc:
        if not keep_going:
            raise
        log.error("%s: cannot bring it to champion v%d: %s", url, want.version, exc)
        report.errors[url.rstrip("/")] = str(exc)
        return
    if done == "relabelled":
        report.relabelled.append(url.rstrip("/"))
    elif step is not None:
        report.swaps.append(step)


def _align(
    settings: Settings,
    server: VllmClient,
    want: Target,
    store: Store,
    drain: bool = False,
    *,
    announce: bool = True,
) -> tuple[Literal["aligned", "relabelled", "swapped"], ServerSwap | None]:
    """Bring one server to `want` (see `align_fleet`): what it took, and the swap record when it
    was swapped. With `announce` (a serving server), what it serves is announced to the gateways
    in the store, and with `drain` it leaves their rotation while it changes. A tenant's adapter:
    `_align_adapter`."""
    if want.tenant is not None:
        return _align_adapter(settings, server, want, store, drain, announce=announce)
    version = want.version
    try:
        label: int | None = server.weight_version()
    except VersionUnknown:
        label = None  # a label that is not "vN" is as good as none: probe, relabel or swap
    if label == version:
        if announce:
            store.set_serving_version(server.url, version, f"aligned: serving v{version}")
        return "aligned", None
    changing: AbstractContextManager[Drain] = (
        nullcontext(Drain(drained=False))
        if not announce
        else swap_window(settings, store, server, f"align to v{version}", drain=drain)
    )
    with changing as window:
        if probe_diff(server, want) <= probe_tolerance(settings, want).value:
            if want.digests is None and not want.adapter:
                save_digests(settings, store, version, server.weight_digests())
            server.update_weight_version(version)  # verified by the probe just now
            window.serving = version
            return "relabelled", None
        step, _ = swap_server(server, want, settings, restore=None)
        if step.verified:
            window.serving = version
    metrics.record_swap(server.url, step.verified, step.restored, step.pause_ms, window.serving)
    if not step.verified:
        raise ServerError(server.url, f"could not bring the server to champion v{version}: {step.error}")
    return "swapped", step


def _label(server: VllmClient) -> int | None:
    """The server's weight-version label (the global adapter's); None when it has none."""
    try:
        return server.weight_version()
    except VersionUnknown:
        return None


def _align_adapter(
    settings: Settings, server: VllmClient, want: Target, store: Store, drain: bool, *, announce: bool
) -> tuple[Literal["aligned", "swapped"], ServerSwap | None]:
    """Bring a tenant's adapter on one server to `want` (docs/lora.md, An adapter per tenant): left
    alone when the server holds it loaded from `want`'s folder, else loaded (a restarted server
    has none) and verified by the probe. The server's label and the global adapter are untouched,
    and what the gateways were told it serves is announced again as it was."""
    if server.adapter_versions().get(server.model) == want.version:
        return "aligned", None
    label = _label(server)
    changing: AbstractContextManager[Drain] = (
        nullcontext(Drain(drained=False))
        if not announce
        else swap_window(settings, store, server, f"align {server.model} to v{want.version}", drain=drain)
    )
    with changing as window:
        step, _ = swap_server(server, want, settings, restore=None)
        window.serving = label
    metrics.record_swap(server.url, step.verified, step.restored, step.pause_ms, label)
    if not step.verified:
        raise ServerError(server.url, f"could not bring {server.model} to v{want.version}: {step.error}")
    return "swapped", step
