"""One server's verified hot-swap: load a version, check it, put the previous one back on failure.

`swap_server(server, want, settings, restore)` changes one vLLM server (the fleet's rollout,
deployer/rollout.py, calls it for each server in turn; the gate, deployer/gate.py, for the staging
server)::

    pause(mode) → reload_weights(checkpoint) → digests → update_weight_version("vN")
                → reset_prefix_cache → resume → probe

Verify = (in the pause window) the server's `/weight_checker` digests that mean something on this
backend equal the version's baseline (recorded on the staging server by the gate, or by the
canary), and (after resume, because it generates) the probe's prompt logprobs from the server
match transformers on the same checkpoint within the probe tolerance (`probe_tolerance`:
``settings.deployer.probe_tolerance``, or by the dtype the servers compute in), which covers every
weight. A failed reload or verify puts `restore` back on the server (before it resumes when the
reload or the digests fail). Every pause is paired with a resume in ``finally``.

With ``trainer.adapter=lora`` a version is a LoRA adapter on the servers' base model: the reload is
``/v1/load_lora_adapter`` in place under the served name, there are no digests to compare (they
cover the base, which never changes), and the probe scores greedy continuations instead of
prompt logprobs (deployer/probe.py). A tenant's adapter (a registry of a tenant line,
schemas/lines.py) is swapped the same way under its own served name, beside the others, and never
sets the server's weight-version label, which is the global adapter's: its version on a server is
read back from the folder it was loaded from (`serving.VllmClient.adapter_versions`).

The public interface, shared by the fleet's rollout and the gate:

- `Target` and `target(settings, registry, store, version)`: a version downloaded, with its probe
  and its recorded digests; `probe_tolerance`, `probe_diff`.
- `server_client(settings, url)`, `swap_server(...) -> (ServerSwap, digests)`,
  `failed_step(url, version, exc)` (the record of a swap that never started).
- `load_digests` / `save_digests`: the digest baselines, kept in the store.
- `swap_window(settings, store, server, reason, drain) -> Drain`: the change announced to the
  gateways (and, with `drain`, the server out of their rotation) around a swap;
  `announce_wait_s`, `DEPLOYER_MARK`.
- `rollout_lock(store, name, purpose, wait_s)`: one rollout ("rollout") and one gate run on the
  staging server ("staging") at a time per store, whichever host it runs on (a lock in the store,
  store/locks.py); the worker's chain waits `wait_s` for a held one, everyone else fails at once.
- `digests_agree`, `verdict`: the pure decisions (unit-tested).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from deployer.agent import agent_for
from deployer.agent import fetch as fetch_on_host
from deployer.errors import RolloutBusy, WaitStopped
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
from registry import Registry
from schemas.clock import utcnow
from schemas.settings import Settings
from schemas.versions import format_version
from serving import AdapterError, CallFailed, ServerError, ServingError, VllmClient, meaningful_digests
from serving.adapters import check_servable, is_adapter, server_max_rank
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
    in_flight_at_drain: int | None = Field(
        None, description="Requests on the server when it left the rotation."
    )
    in_flight_at_pause: int | None = Field(None, description="Requests still on it when it was paused.")
    paused_at: datetime | None = Field(None, description="When the pause was requested (UTC).")
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
    tenant: str | None = None  # a tenant line's adapter (schemas/lines.py): never labels the server

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
        raise AdapterError(
            f"v{version} is {what}, but trainer.adapter={settings.trainer.adapter}: a registry's "
            "versions are all adapters or all full weights (docs/lora.md, Choosing the mode)"
        )
    if lora:
        check_servable(path, server_max_rank(settings.trainer.lora.rank))
        base = settings.vllm.model_dir.expanduser().resolve()
        return Target(version, path, adapter_probe(base), [], None, base=base, tenant=registry.tenant)
    probe, reference = cached_reference(
        path, deploy_dir(settings) / "probes" / f"{format_version(version)}.json"
    )
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


def _publish(server: VllmClient, want: Target) -> None:
    """Label the server with `want`'s version (not for a tenant's adapter: the label is the global
    adapter's) and drop the prefix cache computed with the old weights."""
    if want.tenant is None:
        server.update_weight_version(want.version)
    server.reset_prefix_cache()


def probe_diff(server: VllmClient, want: Target) -> float:
    """Max |vLLM - transformers| over the probe. Needs a resumed server: it generates. An adapter is
    probed on greedy continuations, never with prompt logprobs (deployer/probe.py)."""
    if want.base is not None:
        prompts = [list(ids) for ids in want.probe.token_ids]
        generated = [server.greedy_logprobs(ids, ADAPTER_PROBE_TOKENS) for ids in prompts]
        expected = adapter_reference(
            want.base, want.path, [(ids, tokens) for ids, (tokens, _) in zip(prompts, generated, strict=True)]
        )
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
        _publish(server, back)
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
        return failed_step(server.url, want.version, exc), {}
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
        except (ServingError, CallFailed) as exc:
            error = f"reload of v{want.version} failed: {exc}"
        if error is None:
            _publish(server, want)
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
        except (ServingError, CallFailed) as exc:
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
    except (ServingError, CallFailed, ValueError, IndexError):
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
                log.warning(
                    "%s still had %d requests after %.0fs of draining: pausing anyway",
                    server.url,
                    left,
                    settings.deployer.drain_timeout_s,
                )
            window.in_flight_at_pause = left
            window.drain_ms = round((time.perf_counter() - start) * 1000, 1)
        yield window
    finally:
        try:
            store.set_serving_version(server.url, window.serving, f"after: {reason}")
        except StoreError as exc:
            log.error(
                "the version %s serves could not be announced (%s): the gateways read it from the "
                "server until the next swap",
                server.url,
                exc,
            )
        if drain:
            try:
                store.set_rotation(server.url, True, f"back after: {reason}")
            except StoreError as exc:
                log.error(
                    "%s could not be put back in rotation (%s): the gateways leave it out until "
                    "`rtrl deploy rotation %s --in`",
                    server.url,
                    exc,
                    server.url,
                )


# ---- the lock, the client, the record of a swap that never started ---------------------------------


# How often a caller that may wait (`rollout_lock`'s `wait_s`) tries a held lock again.
LOCK_POLL_S = 0.2


def never() -> bool:
    """The stop condition of a caller that is never told to stop (`rollout_lock`'s default)."""
    return False


@contextmanager
def rollout_lock(
    store: Store,
    name: str = "rollout",
    purpose: str = "",
    wait_s: float = 0.0,
    stopping: Callable[[], bool] = never,
) -> Iterator[None]:
    """One rollout ("rollout") or gate run on the staging server ("staging") at a time, across every
    host that shares the store (`Store.exclusive`). The names never block each other.

    A held lock raises RolloutBusy, naming the holder: at once by default (an operator's command,
    a reconciler tick, which skips to the next), or after trying again every `LOCK_POLL_S` for
    `wait_s` seconds (the worker's chain, ``deployer.lock_wait_s``: a registered challenger must
    not fail because a reconciler tick held the lock for a moment).

    A wait ends early, within `LOCK_POLL_S`, once `stopping` answers True (the worker's warm
    shutdown, SIGTERM): `WaitStopped`, a RolloutBusy, so a stopping worker is not held until the
    lock is free. A free lock is taken whatever `stopping` says: only the wait is given up."""
    began = time.monotonic()
    deadline = began + wait_s
    with ExitStack() as stack:
        while True:
            try:
                stack.enter_context(store.exclusive(name, purpose))
                break
            except LockBusy as exc:
                if time.monotonic() >= deadline:
                    waited = f" (waited {wait_s:g} s)" if wait_s > 0 else ""
                    raise RolloutBusy(f"another {name} is under way{waited}: {exc}") from None
                if stopping():
                    raise WaitStopped(
                        f"stopped waiting for the {name} lock after {time.monotonic() - began:.1f} s:"
                        f" this process is stopping; {exc}"
                    ) from None
            time.sleep(min(LOCK_POLL_S, max(0.0, deadline - time.monotonic())))
        yield


@dataclass(frozen=True)
class LockWait:
    """How a caller that may wait for a held deploy lock waits (`rollout_lock`): up to `wait_s`
    seconds (0: not at all), given up early once `stopping` answers True. The worker's chain passes
    ``deployer.lock_wait_s`` and its warm-shutdown flag; everyone else `NO_WAIT`."""

    wait_s: float = 0.0
    stopping: Callable[[], bool] = never

    def hold(self, store: Store, name: str, purpose: str) -> AbstractContextManager[None]:
        """`rollout_lock` of `name`, waited for this way."""
        return rollout_lock(store, name, purpose, wait_s=self.wait_s, stopping=self.stopping)


NO_WAIT = LockWait()


def server_client(settings: Settings, url: str) -> VllmClient:
    """The deployer's client of one server of ``settings.vllm`` (fleet or staging)."""
    return VllmClient(url, model=settings.vllm.served_model_name, timeout_s=settings.vllm.request_timeout_s)


def failed_step(url: str, version: int, exc: Exception) -> ServerSwap:
    """The record of a swap of `url` to `version` that failed before it changed anything."""
    return ServerSwap(
        url=url,
        version=version,
        pause_ms=0.0,
        reload_ms=0.0,
        total_ms=0.0,
        verified=False,
        max_abs_logprob_diff=None,
        digest_match=None,
        error=str(exc),
    )
