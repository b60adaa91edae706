"""The verified rolling hot-swap of the vLLM fleet, and rollback.

`promote(settings, registry, version)` swaps every server in ``settings.vllm.servers`` one at a time (the
first is the canary)::

    pause(mode) → reload_weights(checkpoint) → digests → update_weight_version("vN")
                → reset_prefix_cache → resume → probe

Verify = (in the pause window) the server's `/weight_checker` digests that mean something on this
backend equal the version's baseline (recorded on the staging server by the gate, or by the
canary), and (after resume, because it generates) the probe's prompt logprobs from the server
match transformers on the same checkpoint within the probe tolerance (`probe_tolerance`:
``settings.deployer.probe_tolerance``, or by the dtype the servers compute in), which covers every
weight.

With ``trainer.adapter=lora`` a version is a LoRA adapter on the servers' base model: the reload is
``/v1/load_lora_adapter`` in place under the served name, there are no digests to compare (they
cover the base, which never changes), and the probe scores greedy continuations instead of
prompt logprobs (deployer/probe.py). Everything else, rollback included, is the same.

A failed reload or verify restores the previous champion on that server (before it resumes when
the reload or the digests fail), swaps back every server already done, leaves the registry
alias where it was and returns ``ok=False`` with the reason. Only a fully verified fleet moves
``@champion``. Every pause is paired with a resume in ``finally``.

`rollback` is a promotion of the previous champion. `align_fleet` brings servers that restarted (or
were never given a version) back to the champion, and resumes and puts back what a deployer that
died mid-swap left paused or out of rotation; `bootstrap` registers the base model as v1
@champion when the registry is empty and then aligns the fleet. One rollout (and one gate run
on the staging server) at a time per store, whichever host it runs on (`rollout_lock`: a lock in
the store, store/locks.py); the digests the swaps are verified against are kept in the store too.

Called by the trainer chain after a passing gate, by ``rtrl run`` / the demo before the loop
starts (`bootstrap`), by the fleet reconciler (deployer/reconcile.py, a child of ``rtrl run``),
and by ``rtrl deploy bootstrap|promote|rollback|reconcile``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field

from deployer import metrics
from deployer.agent import agent_for
from deployer.agent import fetch as fetch_on_host
from deployer.errors import NothingToRollBack, RolloutBusy
from deployer.probe import (
    ADAPTER_PROBE_TOKENS,
    Probe,
    Tolerance,
    adapter_reference,
    build_probe,
    cached_reference,
    max_abs_diff,
    tolerance_for,
)
from deployer.tied import with_tied_head
from registry import CHAMPION, Registry, RegistryError
from schemas.clock import utcnow
from schemas.settings import Settings
from schemas.versions import format_version
from serving import AdapterError, ServerError, ServingError, VersionUnknown, VllmClient, meaningful_digests
from serving.adapters import check_servable, is_adapter, server_max_rank, write_identity_adapter
from store import LockBusy, Store, StoreError

log = logging.getLogger(__name__)

# Prefix of the rotation reason of a server the deployer took out for a swap: when the deployer
# dies before it puts the server back, the reconciler recognises the leftover (an operator's
# `rtrl deploy rotation --out` is never undone by it).
DEPLOYER_MARK = "deployer: "


class ServerSwap(BaseModel):
    """What happened on one server."""

    model_config = ConfigDict(frozen=True)

    url: str
    version: int = Field(description="Version this step loaded (the previous one when rolling back).")
    pause_ms: float = Field(description="Pause to resume: the window the server served nothing.")
    reload_ms: float = Field(description="The reload_weights call alone.")
    total_ms: float = Field(description="The whole step, restore included.")
    verified: bool = Field(description="Probe within tolerance and digests (where recorded) equal.")
    max_abs_logprob_diff: float | None = Field(
        description="Largest |vLLM - transformers| probe logprob; None when not measured or unreadable."
    )
    digest_match: bool | None = Field(description="None when no digest baseline was available.")
    restored: bool = Field(
        False, description="The step failed and the server was put back on the previous version."
    )
    drained: bool = Field(
        False,
        description="Taken out of the gateways' rotation and drained before the pause (a fleet of more than one); "
        "otherwise swapped in place, requests arriving in the pause waiting for it.",
    )
    drain_ms: float | None = Field(None, description="Out of rotation until no request ran on the server.")
    in_flight_at_drain: int | None = Field(None, description="Requests on the server when it left the rotation.")
    in_flight_at_pause: int | None = Field(None, description="Requests still on it when it was paused.")
    paused_at: datetime | None = Field(None, description="When the pause was requested (UTC).")
    error: str | None = None


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


# ---- pure decisions (unit-tested) ----------------------------------------------------------------


def digests_agree(baseline: dict[str, str] | None, observed: dict[str, str]) -> bool | None:
    """Whether a server's digests equal the baseline on every tensor the baseline can vouch for.

    Only meaningful digests count (on CPU, linear layers always digest to sha256 of nothing);
    None when there is nothing to compare.
    """
    useful = meaningful_digests(baseline or {})
    if not useful:
        return None
    return all(observed.get(name) == digest for name, digest in useful.items())


def verdict(max_diff: float, tolerance: float, digest_match: bool | None, hint: str = "") -> str | None:
    """None when a reload is verified, else the reason it is not (followed by `hint`, what to check)."""
    if not max_diff <= tolerance:  # also catches nan
        reason = f"probe logprobs differ from transformers by {max_diff:.3g} > tolerance {tolerance:g}"
        return f"{reason} {hint}" if hint else reason
    if digest_match is False:
        return "weight digests differ from the version's recorded digests"
    return None


# ---- one server --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """Everything needed to load and verify one version."""

    version: int
    path: Path
    probe: Probe
    expected: list[list[float]]  # the prompt-logprob reference (full weights); empty for an adapter
    digests: dict[str, str] | None
    base: Path | None = None  # the base model of a LoRA adapter (vllm.model_dir); None: full weights

    @property
    def adapter(self) -> bool:
        return self.base is not None


def probe_tolerance(settings: Settings, want: Target) -> Tolerance:
    """The probe tolerance of swapping `want` (`deployer.probe.tolerance_for` its checkpoint, the
    base model's for an adapter: a policy version keeps its base's config.json)."""
    return tolerance_for(settings, want.base if want.base is not None else want.path)


def deploy_dir(settings: Settings) -> Path:
    """Local working directory of the deployer (its probe cache, a LoRA registry's v1 adapter), absolute.
    Its locks and the recorded digests are in the store (`rollout_lock`, `load_digests`)."""
    path = (settings.services.run_dir / "deploy").expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def target(settings: Settings, registry: Registry, store: Store, version: int) -> Target:
    """`version`, downloaded, with its probe. Raises AdapterError when the version is not what the
    fleet loads: an adapter for a full-weight fleet, full weights for a LoRA fleet (whose base
    weights never change), or an adapter above the servers' rank."""
    path = registry.download_checkpoint(version)
    lora = settings.trainer.adapter == "lora"
    if is_adapter(path) != lora:
        what = "a LoRA adapter" if is_adapter(path) else "full weights"
        raise AdapterError(f"v{version} is {what}, but trainer.adapter={settings.trainer.adapter}: a registry's "
                           "versions are all adapters or all full weights (docs/lora.md, Choosing the mode)")  # fmt: skip
    if lora:
        check_servable(path, server_max_rank(settings.trainer.lora.rank))
        base = settings.vllm.model_dir.expanduser().resolve()
        return Target(version, path, adapter_probe(base), [], None, base=base)
    probe, reference = cached_reference(path, deploy_dir(settings) / "probes" / f"{format_version(version)}.json")
    return Target(version, path, probe, reference, load_digests(settings, store, version))


_adapter_probes: dict[Path, Probe] = {}


def adapter_probe(base: Path) -> Probe:
    """The probe prompts as the base model's tokenizer encodes them (once per process)."""
    if base not in _adapter_probes:
        _adapter_probes[base] = build_probe(base)
    return _adapter_probes[base]


def load_digests(settings: Settings, store: Store, version: int) -> dict[str, str] | None:
    """The digests recorded for `version` of the registry model (``mlflow.model_name``); None: none yet."""
    return store.recorded_digests(settings.mlflow.model_name, version)


def save_digests(settings: Settings, store: Store, version: int, digests: dict[str, str]) -> None:
    """Record `digests` as `version`'s baseline, replacing any recorded before; every deployer
    and gate sharing the store reads it."""
    store.record_digests(settings.mlflow.model_name, version, digests)


def host_path(settings: Settings, server: VllmClient, want: Target) -> Path:
    """Where `server` reads `want` from: the deployer's download, or for a server with a weights
    agent (``vllm.weights_agents``) the agent's copy on the server's host, downloaded now
    (deployer/agent.py). Raises ServerError when the agent cannot provide it."""
    agent = agent_for(settings, server.url)
    return want.path if agent is None else fetch_on_host(settings, server.url, agent, want.version)


def _reload(server: VllmClient, want: Target, path: Path) -> float:
    """reload_weights from `path` (`host_path`), or for an adapter its in-place load under the
    served name (the name the server's client uses); returns its duration in ms."""
    start = time.perf_counter()
    if want.adapter:
        server.load_adapter(server.model, path)
    else:
        server.reload_weights(path)
    return (time.perf_counter() - start) * 1000


def _digests(server: VllmClient, want: Target) -> dict[str, str]:
    """The server's weight digests after loading `want`; none for an adapter (they cover the base
    weights only, which a LoRA fleet never changes: the probe verifies the adapter)."""
    return {} if want.adapter else server.weight_digests()


def _publish(server: VllmClient, version: int) -> None:
    server.update_weight_version(version)
    server.reset_prefix_cache()


def probe_diff(server: VllmClient, want: Target) -> float:
    """Max |vLLM - transformers| over the probe. Needs a resumed server: it generates. An adapter is
    probed on greedy continuations, never with prompt logprobs (deployer/probe.py)."""
    if want.base is not None:
        prompts = [list(ids) for ids in want.probe.token_ids]
        generated = [server.greedy_logprobs(ids, ADAPTER_PROBE_TOKENS) for ids in prompts]
        expected = adapter_reference(want.base, want.path, [(ids, tokens) for ids, (tokens, _) in
                                                            zip(prompts, generated, strict=True)])  # fmt: skip
        return max_abs_diff(expected, [logprobs for _, logprobs in generated])
    observed = [server.prompt_logprobs(list(ids)) for ids in want.probe.token_ids]
    return max_abs_diff(want.expected, observed)


def _restore(server: VllmClient, back: Target, settings: Settings, paused: bool) -> None:
    """Put `back` on the server and check it; raises ServerError when even that fails."""
    path = host_path(settings, server, back)
    if not paused:
        server.pause(settings.deployer.pause_mode)
    try:
        _reload(server, back, path)
        digest_match = digests_agree(back.digests, _digests(server, back))
        _publish(server, back.version)
    finally:
        server.resume()
    tolerance = probe_tolerance(settings, back)
    problem = verdict(probe_diff(server, back), tolerance.value, digest_match, tolerance.hint())
    if problem is not None:
        raise ServerError(server.url, f"restoring v{back.version} failed: {problem}")


def swap_server(
    server: VllmClient, want: Target, settings: Settings, restore: Target | None
) -> tuple[ServerSwap, dict[str, str]]:
    """Swap one server to `want`; on failure put `restore` back (when given).

    In one pause window: reload, compare digests (a mismatch restores before the server
    resumes), set the version, reset the prefix cache, resume. Then the probe, which has to
    generate and so runs after resume: a mismatch there restores at once. On CPU the digests miss
    the linear layers, so a checkpoint that only the probe catches is served for the probe's few
    requests (stamped with the new version) before the restore; the gate has already probed the
    same checkpoint on the staging server, so this is the second line of defence.

    Returns the step's record and the server's digests after the load (the baseline for the rest
    of the fleet when none was recorded). Raises ServerError only when even the restore fails;
    the server is resumed on every path, because a paused server hangs every request routed to it.
    """
    tolerance = probe_tolerance(settings, want)
    try:
        path = host_path(settings, server, want)  # before the pause: a download is not part of the window
    except ServingError as exc:
        return _failed_step(server.url, want.version, exc), {}
    start = time.perf_counter()
    reload_ms, max_diff, digest_match = 0.0, float("inf"), None
    digests: dict[str, str] = {}
    error: str | None = None
    restored = False
    paused_at = utcnow()
    try:
        server.pause(settings.deployer.pause_mode)
        try:
            reload_ms = _reload(server, want, path)
            digests = _digests(server, want)
            digest_match = digests_agree(want.digests, digests)
            if digest_match is False:
                error = verdict(0.0, tolerance.value, digest_match)
        except (ServingError, httpx.HTTPError) as exc:
            error = f"reload of v{want.version} failed: {exc}"
        if error is None:
            _publish(server, want.version)
        elif restore is not None:
            _restore(server, restore, settings, paused=True)
            restored = True
    finally:
        server.resume()
    pause_ms = (time.perf_counter() - start) * 1000
    if error is None:
        try:
            max_diff = probe_diff(server, want)
            error = verdict(max_diff, tolerance.value, digest_match, tolerance.hint())
        except (ServingError, httpx.HTTPError) as exc:
            error = f"probe of v{want.version} failed: {exc}"
        if error is not None and restore is not None:
            _restore(server, restore, settings, paused=False)
            restored = True
    record = ServerSwap(
        url=server.url,
        version=want.version,
        pause_ms=round(pause_ms, 1),
        reload_ms=round(reload_ms, 1),
        total_ms=round((time.perf_counter() - start) * 1000, 1),
        verified=error is None,
        max_abs_logprob_diff=max_diff if math.isfinite(max_diff) else None,
        digest_match=digest_match,
        restored=restored,
        paused_at=paused_at,
        error=error,
    )
    return record, digests


def _in_flight(server: VllmClient) -> int | None:
    try:
        return server.requests_in_flight()
    except (ServingError, httpx.HTTPError, ValueError, IndexError):
        return None


@dataclass
class Drain:
    """How a server left the gateways' rotation before its swap (`swap_window`), and what it serves
    after: the caller sets `serving` once the server's weights are known again (verified, or
    restored); left None, the gateways read versions from the server itself."""

    drained: bool
    drain_ms: float | None = None
    in_flight_at_drain: int | None = None
    in_flight_at_pause: int | None = None
    serving: int | None = None


def announce_wait_s(settings: Settings) -> float:
    """How long after an announcement in the store every gateway has read it: two of its refresh
    intervals (a gateway trusts an announcement only while its last read is younger than that,
    `ingest.routing.Fleet.attributed`), plus a margin."""
    return 2 * settings.gateway.rotation_refresh_s + 0.05


@contextmanager
def swap_window(
    settings: Settings, store: Store, server: VllmClient, reason: str, drain: bool
) -> Iterator[Drain]:
    """The window in which `server`'s weights or version label may change.

    Announces in the store that the server's version is changing (the gateways stop attributing
    its generations to the announced version and read the server's own label instead,
    ingest/routing.py) and, with `drain`, takes it out of the gateways' rotation; waits until every
    gateway has read that (`announce_wait_s`) and, with `drain`, until the server has no request
    left (at most ``deployer.drain_timeout_s``); yields; then announces ``Drain.serving`` (None:
    unknown) and puts the server back in rotation, whatever happened.

    Raises ServerError, before anything changed, when the store cannot take the announcement: a
    swap the gateways were not told about would be attributed to the old version.
    """
    try:
        store.set_serving_version(server.url, None, reason)
        if drain:
            store.set_rotation(server.url, False, f"{DEPLOYER_MARK}{reason}")
    except StoreError as exc:
        raise ServerError(server.url, f"cannot announce the swap in the store ({exc}); not swapping") from exc
    window = Drain(drained=drain)
    try:
        start = time.perf_counter()
        window.in_flight_at_drain = _in_flight(server) if drain else None
        time.sleep(announce_wait_s(settings))  # every gateway has read it by now
        if drain:
            deadline = start + settings.deployer.drain_timeout_s
            left = _in_flight(server)
            while left and time.perf_counter() < deadline:
                time.sleep(0.05)
                left = _in_flight(server)
            if left:
                log.warning("%s still had %d requests after %.0fs of draining: pausing anyway", server.url, left,
                            settings.deployer.drain_timeout_s)  # fmt: skip
            window.in_flight_at_pause = left
            window.drain_ms = round((time.perf_counter() - start) * 1000, 1)
        yield window
    finally:
        try:
            store.set_serving_version(server.url, window.serving, f"after: {reason}")
        except StoreError as exc:
            log.error("the version %s serves could not be announced (%s): the gateways read it from the "
                      "server until the next swap", server.url, exc)  # fmt: skip
        if drain:
            try:
                store.set_rotation(server.url, True, f"back after: {reason}")
            except StoreError as exc:
                log.error("%s could not be put back in rotation (%s): the gateways leave it out until "
                          "`rtrl deploy rotation %s --in`", server.url, exc, server.url)  # fmt: skip


# ---- the fleet ---------------------------------------------------------------------------------


@contextmanager
def rollout_lock(store: Store, name: str = "rollout", purpose: str = "") -> Iterator[None]:
    """One rollout ("rollout") or gate run on the staging server ("staging") at a time, across every
    host that shares the store (`Store.exclusive`); raises RolloutBusy at once, naming the holder,
    when it is held. The two names never block each other."""
    with ExitStack() as stack:
        try:
            stack.enter_context(store.exclusive(name, purpose))
        except LockBusy as exc:
            raise RolloutBusy(f"another {name} is under way: {exc}") from None
        yield


def server_client(settings: Settings, url: str) -> VllmClient:
    """The deployer's client of one server of ``settings.vllm`` (fleet or staging)."""
    return VllmClient(url, model=settings.vllm.served_model_name, timeout_s=settings.vllm.request_timeout_s)


def _failed_step(url: str, version: int, exc: Exception) -> ServerSwap:
    return ServerSwap(
        url=url, version=version, pause_ms=0.0, reload_ms=0.0, total_ms=0.0, verified=False,
        max_abs_logprob_diff=None, digest_match=None, error=str(exc),
    )  # fmt: skip


def _swap_fleet(settings: Settings, registry: Registry, store: Store, version: int, previous: int) -> SwapResult:
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
            with swap_window(settings, store, server, f"swap to v{want.version}", drain) as window:
                step, digests = swap_server(server, want, settings, restore=restore)
                if step.verified:
                    window.serving = want.version
                elif step.restored and restore is not None:
                    window.serving = restore.version
        except (ServingError, httpx.HTTPError) as exc:
            metrics.SWAPS.labels("failed").inc()
            return _failed_step(url, want.version, exc), {}
    extra = {"drained": window.drained, "drain_ms": window.drain_ms,
             "in_flight_at_drain": window.in_flight_at_drain, "in_flight_at_pause": window.in_flight_at_pause}  # fmt: skip
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


def promote(settings: Settings, registry: Registry, version: int) -> SwapResult:
    """Swap the fleet to `version` and, when every server verified, move @champion to it."""
    store = Store(settings.store.url)
    try:
        store.check_schema()  # the lock, the digests and the swap's announcements are there
        return _promote(settings, registry, store, version)
    finally:
        store.close()


def _promote(settings: Settings, registry: Registry, store: Store, version: int) -> SwapResult:
    with rollout_lock(store, "rollout", f"promote v{version}"):
        previous = registry.champion()
        result = _swap_fleet(settings, registry, store, version, previous)
        metrics.ROLLOUTS.labels("ok" if result.ok else "failed").inc()
        if result.ok:
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


def rollback(settings: Settings, registry: Registry, to_version: int | None = None) -> SwapResult:
    """Serve `to_version` (default: the previous champion) again: re-swap the fleet, move @champion."""
    if to_version is None:
        to_version = registry.previous_champion()
        if to_version is None:
            raise NothingToRollBack("no previous champion recorded; pass the version to roll back to (--to N)")
    return promote(settings, registry, to_version)


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
            first = write_identity_adapter(model_dir, deploy_dir(settings) / "v1-adapter", rank=lora.rank,
                                           alpha=lora.alpha, dropout=lora.dropout, target_modules=lora.target_modules)  # fmt: skip
            tags = {"rtrl.base": "true", "rtrl.adapter": "lora", "rtrl.base_model": str(model_dir.resolve())}
            version = registry.register_checkpoint(first, tags=tags)
        else:
            # A tied head written out, so that a server can be swapped back to v1 (deployer/tied.py).
            base = with_tied_head(model_dir, deploy_dir(settings) / "v1-base")
            version = registry.register_checkpoint(base, tags={"rtrl.base": "true"})
        if version != 1:
            raise RegistryError(f"registered the base model as version {version}; expected 1 (concurrent bootstrap?)")
        registry.set_alias(CHAMPION, version)
    champion = registry.champion()
    report = align_fleet(settings, registry, keep_going=keep_going)
    for url, problem in report.errors.items():
        log.warning("%s not on @champion v%d yet (%s); the fleet reconciler retries it", url, champion, problem)
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
            version = registry.champion()
            report.champion = version
            want = target(settings, registry, store, version)
            rotation = store.rotation()
            drain = len(settings.vllm.servers) > 1
            for url in settings.vllm.servers:
                _align_one(settings, url, want, store, drain, report, keep_going)
                row = rotation.get(url.rstrip("/"))
                if row is not None and not row.in_rotation and row.reason.startswith(DEPLOYER_MARK):
                    store.set_rotation(url, True, f"reconciled: back after {row.reason[len(DEPLOYER_MARK):]}")
                    report.returned_to_rotation.append(url.rstrip("/"))
        if settings.vllm.staging_server is not None:  # no gateway routes to it: nothing to announce
            try:
                with rollout_lock(store, "staging", "align staging to @champion"):
                    _align_one(settings, settings.vllm.staging_server, want, store, False, report, keep_going,
                               announce=False)  # fmt: skip
            except RolloutBusy:
                report.skipped.append(settings.vllm.staging_server.rstrip("/"))  # the gate is using it
    finally:
        store.close()
    return report


class FleetReport(BaseModel):
    """What `align_fleet` found and did."""

    champion: int | None = None
    restarted: list[str] = Field(
        default_factory=list, description="Dead servers restarted first (`rtrl deploy reconcile` on local services)."
    )
    swaps: list[ServerSwap] = Field(default_factory=list, description="Servers swapped to the champion.")
    relabelled: list[str] = Field(default_factory=list, description="Servers on the champion's weights under another label.")
    resumed: list[str] = Field(default_factory=list, description="Servers found paused outside any swap.")
    returned_to_rotation: list[str] = Field(
        default_factory=list, description="Servers a dead deployer had left out of the gateways' rotation."
    )
    skipped: list[str] = Field(default_factory=list, description="Staging server, in use by the gate.")
    errors: dict[str, str] = Field(default_factory=dict, description="Servers that could not be aligned, and why.")

    @property
    def changed(self) -> bool:
        return bool(self.restarted or self.swaps or self.relabelled or self.resumed or self.returned_to_rotation
                    or self.errors)


def _align_one(
    settings: Settings, url: str, want: Target, store: Store, drain: bool, report: FleetReport,
    keep_going: bool, *, announce: bool = True,
) -> None:
    try:
        with server_client(settings, url) as server:
            if server.is_paused():  # we hold the lock: no swap of ours is under way
                log.warning("%s was paused outside any swap (a deployer died mid-swap?): resuming it", server.url)
                server.resume()
                report.resumed.append(server.url)
            done, step = _align(settings, server, want, store, drain, announce=announce)
    except (ServingError, httpx.HTTPError) as exc:
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
    settings: Settings, server: VllmClient, want: Target, store: Store, drain: bool = False, *, announce: bool = True
) -> tuple[Literal["aligned", "relabelled", "swapped"], ServerSwap | None]:
    """Bring one server to `want` (see `align_fleet`): what it took, and the swap record when it
    was swapped. With `announce` (a serving server), what it serves is announced to the gateways
    in the store, and with `drain` it leaves their rotation while it changes."""
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
        nullcontext(Drain(drained=False)) if not announce
        else swap_window(settings, store, server, f"align to v{version}", drain=drain)
    )  # fmt: skip
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
