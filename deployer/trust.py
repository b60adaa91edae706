"""The registry as a trust boundary: only versions rtrl promoted serve (docs/security.md, The registry).

MLflow's ``@champion`` alias can be moved by anyone who can write the registry; the reconciler
would then move the whole fleet within one tick, and a trainer would train from that version,
without the eval gate. So the alias is a mirror, and the authority is rtrl's record of its own
promotions (store/promotions.py):

- `champion` is the version the fleet serves, the trainer trains from and the gate compares
  against: the newest promotion rtrl recorded (the alias found then is adopted once, when a store
  has no record yet);
- `grounds` says why a version may be promoted: its newest gate decision passed, or it served
  before (a rollback); an operator may force one with a reason, recorded with who;
- `guard_alias` (the reconciler, every tick) puts back an alias found on another version, logs it,
  and counts it (``rtrl_deployer_alias_refused_total``, alert RtrlChampionAliasMoved); ``rtrl
  deploy status`` shows both.
"""

from __future__ import annotations

import getpass
import logging
import os
import socket
from dataclasses import dataclass

from deployer import metrics
from deployer.errors import NotAuthorized
from registry import CHAMPION, Registry
from store import Store

log = logging.getLogger(__name__)


def actor(role: str = "") -> str:
    """Who acts, for the record: ``user@host`` (and the process role, when given)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container's arbitrary uid)
        user = f"uid{os.getuid()}"
    return f"{user}@{socket.gethostname()}" + (f" ({role})" if role else "")


def champion(registry: Registry, store: Store) -> int:
    """The version rtrl promoted last (see the module docstring). Raises `registry.NoChampion`
    when neither a record nor an alias exists yet (before ``rtrl deploy bootstrap``)."""
    return store.recorded_champion(registry.model_name, registry.champion, actor("adopted"))


@dataclass(frozen=True)
class Grounds:
    """Why a version may become @champion."""

    kind: str  # gate | served | force (store/promotions.py, GROUNDS)
    reason: str
    gate_decision_id: int | None = None


def grounds(registry: Registry, store: Store, version: int, force_reason: str | None = None) -> Grounds:
    """The grounds to promote `version`; raises NotAuthorized when it has none and no
    `force_reason` is given."""
    if force_reason is not None:
        if not force_reason.strip():
            raise NotAuthorized("--force needs a reason: --reason 'WHY' (it is recorded with who forced it)")
        return Grounds("force", force_reason.strip())
    found = store.promotion_grounds(registry.model_name, version)
    if found is None:
        raise NotAuthorized(
            f"v{version} has no passing gate decision and never served; run `rtrl gate run {version}` first, "
            f"or `rtrl deploy promote {version} --force --reason 'WHY'` to serve it anyway (recorded)"
        )
    kind, decision = found
    reason = f"gate decision {decision} passed" if kind == "gate" else "served before (rollback)"
    return Grounds(kind, reason, decision)


@dataclass(frozen=True)
class AliasCheck:
    """The registry's @champion against rtrl's record."""

    champion: int  # rtrl's record
    alias: int | None  # the registry's alias (None: missing)

    @property
    def agrees(self) -> bool:
        return self.alias == self.champion


def check_alias(registry: Registry, store: Store) -> AliasCheck:
    """Compare the alias with the record (adopting the alias when there is no record yet)."""
    recorded = champion(registry, store)
    return AliasCheck(recorded, registry.alias(CHAMPION))


def guard_alias(registry: Registry, store: Store) -> AliasCheck:
    """`check_alias`, and an alias found elsewhere is put back on rtrl's champion, logged and
    counted. Called with the fleet lock held (no promotion is half-way)."""
    found = check_alias(registry, store)
    if not found.agrees:
        metrics.ALIAS_REFUSED.inc()
        log.error(
            "@%s of %s points at v%s, which rtrl did not promote (its record: v%d); put back on v%d. "
            "To serve v%s, run `rtrl deploy promote %s` (a passing gate decision) or add --force --reason",
            CHAMPION,
            registry.model_name,
            found.alias,
            found.champion,
            found.champion,
            found.alias,
            found.alias,
        )
        registry.set_alias(CHAMPION, found.champion)
    return found
