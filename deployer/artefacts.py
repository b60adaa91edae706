"""Artefact retention: what rtrl keeps of cycle checkpoints, downloaded versions and rejected
registry versions, and `prune`, which deletes the rest (docs/runbooks/deployer.md, Artefact retention).

Started by ``rtrl deploy prune [--dry-run]`` (the Kubernetes CronJob ``rtrl-prune-artefacts``)
and by beat's ``rtrl.prune_artefacts`` on the worker, every ``deployer.retention.interval_s``.

What there is (`scan_checkpoints`, `scan_downloads`, the registry's `version_records`):

- ``checkpoint``: a cycle's checkpoint ``<trainer.checkpoint_dir>/cycle-<id>`` (a crashed save's
  ``cycle-<id>.tmp`` too) and its ranks' work directory ``ranks/cycle-<id>`` (trainer/checkpoint.py).
  The optimizer states beside them have their own pruning (``trainer.keep_optimizer_states``);
- ``download``: the deployer's copy of version N, ``<services.run_dir>/deploy/vN`` with its probe
  reference ``deploy/probes/vN.json``, and a download that never finished (``.vN.download-<pid>``);
- ``registry``: a registered version of ``mlflow.model_name``.

What is kept (`decide`, a pure function of the artefacts and the `Facts` read from the store and the
registry; ``deployer.retention``, `RetentionSettings`): every artefact of a kept version
(`kept_versions`: the champion, by rtrl's record and by the @champion alias; the
``keep_previous`` champions before it, the rollback targets; every version a serving server is
announced on; the challenger of a cycle in progress and @challenger; the gate's anchor, the
trainer's KL reference (``trainer.reference`` while ``trainer.loss.ref_kl_coef`` > 0) and the
bootstrap's base); a checkpoint whose cycle is in progress or unknown to the store; anything younger
than ``min_age_s``; and every registry version but those the gate rejected and rtrl never promoted
(store/promotions.py `rejected_versions`). A rejected version goes with its checkpoint artifacts;
its MLflow run (metrics, the gate's record) stays.

Concurrency: `prune` takes no deploy lock (a promotion that found it held would fail its cycle).
It lists the files first and reads the store after, so a cycle that starts meanwhile has an id the
listing did not see, or a row the store read finds in progress; a final status never changes. A
download's age is its last use (`registry.Registry.download_checkpoint` touches its marker), so a
version a rollout is loading is young. What is left, a forced promotion of an old unkept version
in the same second, fails that swap cleanly (the fleet stays on the champion) and a retry
downloads again. Each deletion is logged and counted (``rtrl_artefacts_pruned_total{kind}``);
running it again deletes nothing more (idempotent).
"""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from deployer import metrics
from registry import CHALLENGER, CHAMPION, DOWNLOAD_COMPLETE, Registry, RegistryError, VersionRecord
from schemas.settings import RetentionSettings, Settings
from schemas.versions import format_version
from store import Store
from store.models import ACTIVE_CYCLE_STATUSES

log = logging.getLogger(__name__)

KINDS = ("checkpoint", "download", "registry")
_CYCLE_DIR = re.compile(r"^cycle-([0-9]+)(\.tmp)?$")  # trainer/checkpoint.py, CycleFiles
_VERSION_DIR = re.compile(r"^v([1-9][0-9]*)$")  # registry/client.py, download_checkpoint
_UNFINISHED_DOWNLOAD = re.compile(r"^\.v[1-9][0-9]*\.download-[0-9]+$")


@dataclass(frozen=True)
class Artefact:
    """One thing retention may delete."""

    kind: str  # checkpoint | download | registry
    name: str  # what the log says: a path, or "<model> vN"
    age_s: float  # since it was last written or used (a registry version: since it was rejected)
    version: int | None = None  # the version it holds (download, registry; a checkpoint's is its cycle's)
    cycle_id: int | None = None  # checkpoint: the cycle that wrote it
    paths: tuple[Path, ...] = ()  # what goes with it on disk
    source: str | None = None  # registry: the artifact URI of its checkpoint


@dataclass(frozen=True)
class CycleFact:
    """A cycle as retention sees it."""

    status: str
    version: int | None  # the version it registered, if any


@dataclass(frozen=True)
class Facts:
    """What the store and the registry say, read once before deciding (`read_facts`)."""

    champion: int | None  # rtrl's record of its promotions (store/promotions.py)
    alias: int | None = None  # @champion in the registry (kept too, even when moved by hand)
    promoted: tuple[int, ...] = ()  # the versions rtrl promoted, newest first
    serving: frozenset[int] = frozenset()  # announced by the deployer on a serving server
    in_flight: frozenset[int] = frozenset()  # challengers of cycles in progress, and @challenger
    anchors: frozenset[int] = frozenset()  # the gate's anchor, the trainer's KL reference, the base
    cycles: Mapping[int, CycleFact] = field(default_factory=dict)  # of the checkpoints listed
    rejected: frozenset[int] = frozenset()  # newest gate decision failed, never promoted


@dataclass(frozen=True)
class Decision:
    """Whether an artefact goes, and why."""

    artefact: Artefact
    delete: bool
    reason: str


# ---- the policy (pure; unit-tested) ---------------------------------------------------------------


def kept_versions(facts: Facts, keep_previous: int) -> dict[int, str]:
    """Every version whose artefacts are kept, with why (the first reason that applies)."""
    kept: dict[int, str] = {}

    def keep(version: int | None, why: str) -> None:
        if version is not None:
            kept.setdefault(version, why)

    keep(facts.champion, "the champion")
    keep(facts.alias, "@champion in the registry")
    previous = [v for v in dict.fromkeys(facts.promoted) if v != facts.champion][:keep_previous]
    for version in previous:
        keep(version, "a previous champion (rollback)")
    for version in sorted(facts.serving):
        keep(version, "a serving server is announced on it")
    for version in sorted(facts.in_flight):
        keep(version, "a challenger in flight")
    for version in sorted(facts.anchors):
        keep(version, "the anchor")
    return kept


def decide(artefacts: Iterable[Artefact], facts: Facts, policy: RetentionSettings) -> list[Decision]:
    """Keep or delete each artefact (see the module docstring)."""
    kept = kept_versions(facts, policy.keep_previous)
    return [Decision(a, *_verdict(a, facts, kept, policy)) for a in artefacts]


def _verdict(
    artefact: Artefact, facts: Facts, kept: Mapping[int, str], policy: RetentionSettings
) -> tuple[bool, str]:
    version = artefact.version
    what = ""
    if artefact.kind == "checkpoint":
        cycle = facts.cycles.get(artefact.cycle_id) if artefact.cycle_id is not None else None
        if cycle is None:
            return False, f"no cycle {artefact.cycle_id} in the store"
        if cycle.status in ACTIVE_CYCLE_STATUSES:
            return False, f"cycle {artefact.cycle_id} is in progress ({cycle.status})"
        version = cycle.version
        what = f"cycle {artefact.cycle_id} ended {cycle.status}"
    if version is not None and version in kept:
        return False, f"v{version}: {kept[version]}"
    if artefact.kind == "registry":
        if not policy.prune_registry:
            return False, "deployer.retention.prune_registry is off"
        if version not in facts.rejected:
            return False, "not rejected by the gate"
        what = "rejected by the gate, never promoted"
    if artefact.age_s < policy.min_age_s:
        return False, f"younger than min_age_s ({artefact.age_s:.0f} s < {policy.min_age_s:g} s)"
    if artefact.kind == "download":
        what = "an unfinished download" if version is None else "a downloaded copy"
    not_kept = "" if version is None else f"v{version} not kept; "
    return True, f"{what}; {not_kept}{artefact.age_s / 86400:.1f} days old"


# ---- what there is ------------------------------------------------------------------------------


def _age_s(path: Path, now: float) -> float:
    return max(0.0, now - path.stat().st_mtime)


def _children(directory: Path) -> list[Path]:
    return sorted(directory.iterdir()) if directory.is_dir() else []


def scan_checkpoints(checkpoint_dir: Path, now: float) -> list[Artefact]:
    """The cycles' checkpoints and ranks' work directories under `checkpoint_dir` (`now`: Unix time)."""
    found = []
    for path in _children(checkpoint_dir) + _children(checkpoint_dir / "ranks"):
        match = _CYCLE_DIR.match(path.name)
        if match is not None and path.is_dir():
            found.append(
                Artefact("checkpoint", str(path), _age_s(path, now), cycle_id=int(match[1]), paths=(path,))
            )
    return found


def scan_downloads(deploy_dir: Path, now: float) -> list[Artefact]:
    """The deployer's downloaded versions under `deploy_dir` (a complete one aged by its last use,
    its marker's time), and the downloads that never finished."""
    found = []
    for path in _children(deploy_dir):
        match = _VERSION_DIR.match(path.name)
        if match is not None and path.is_dir():
            marker = path / DOWNLOAD_COMPLETE
            probe = deploy_dir / "probes" / f"{path.name}.json"
            age = _age_s(marker if marker.is_file() else path, now)
            found.append(Artefact("download", str(path), age, version=int(match[1]), paths=(path, probe)))
        elif _UNFINISHED_DOWNLOAD.match(path.name) and path.is_dir():
            found.append(Artefact("download", str(path), _age_s(path, now), paths=(path,)))
    return found


def scan_registry(
    model: str, records: Iterable[VersionRecord], rejected: Mapping[int, datetime], now: datetime
) -> list[Artefact]:
    """The registry's versions; a rejected one is aged from its rejection, any other from its registration."""
    return [
        Artefact(
            "registry",
            f"{model} {format_version(r.version)}",
            max(0.0, (now - rejected.get(r.version, r.created_at)).total_seconds()),
            version=r.version,
            source=r.source,
        )
        for r in records
    ]


def read_facts(
    settings: Settings,
    registry: Registry,
    store: Store,
    cycle_ids: Iterable[int],
    rejected: Mapping[int, datetime],
) -> Facts:
    """What the store and the registry say now (after the files were listed: see the module
    docstring); `rejected` is the store's `rejected_versions`."""
    model = registry.model_name
    history = store.promotions(model, limit=10_000)
    in_flight = {
        c.challenger
        for c in store.recent_cycles(5)  # one cycle is active at a time, the newest
        if c.status in ACTIVE_CYCLE_STATUSES and c.challenger is not None
    }
    challenger = registry.alias(CHALLENGER)
    if challenger is not None:
        in_flight.add(challenger)
    anchors = {p.version for p in history if p.grounds == "bootstrap"}
    anchor = settings.gate.anchor
    if anchor == "base":
        versions = registry.versions()
        anchors.update(versions[:1])
    elif anchor != "none":
        anchors.add(int(anchor))
    reference = settings.trainer.reference  # the trainer's fixed KL reference (trainer/reference.py)
    if settings.trainer.loss.ref_kl_coef > 0:
        anchors.update(registry.versions()[:1] if reference == "base" else [int(reference)])
    cycles = {}
    for cycle_id in sorted(set(cycle_ids)):
        found = store.get_cycle(cycle_id)
        if found is not None:
            cycles[cycle_id] = CycleFact(found.status, found.challenger)
    return Facts(
        champion=history[0].version if history else None,
        alias=registry.alias(CHAMPION),
        promoted=tuple(p.version for p in history),
        serving=frozenset(r.version for r in store.rotation().values() if r.version is not None),
        in_flight=frozenset(in_flight),
        anchors=frozenset(anchors),
        cycles=cycles,
        rejected=frozenset(rejected),
    )


# ---- deleting -----------------------------------------------------------------------------------


@dataclass
class PruneReport:
    """What `prune` decided and did."""

    dry_run: bool
    decisions: list[Decision] = field(default_factory=list)
    deleted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    kept: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    freed_bytes: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def deletions(self) -> list[Decision]:
        return [d for d in self.decisions if d.delete]

    def summary(self) -> str:
        verb = "would delete" if self.dry_run else "deleted"
        counts = ", ".join(f"{self.deleted[k]} {k}" for k in KINDS)
        kept = ", ".join(f"{self.kept[k]} {k}" for k in KINDS)
        line = f"{verb} {counts} ({self.freed_bytes / 2**30:.2f} GiB on disk); kept {kept}"
        return line + (f"; {len(self.errors)} errors" if self.errors else "")


def prune(
    settings: Settings,
    registry: Registry,
    store: Store,
    *,
    dry_run: bool = False,
    now: datetime | None = None,
) -> PruneReport:
    """Delete the artefacts ``deployer.retention`` does not keep (see the module docstring); with
    `dry_run`, decide and change nothing. A deletion that fails is logged and reported, and the
    rest go on (the next run tries it again)."""
    policy = settings.deployer.retention
    when = now or store.clock()
    # The files first, the store after (module docstring, Concurrency).
    local = scan_checkpoints(settings.trainer.checkpoint_dir, when.timestamp())
    local += scan_downloads(registry.checkpoints_dir, when.timestamp())
    rejected = store.rejected_versions(registry.model_name)
    facts = read_facts(
        settings, registry, store, (a.cycle_id for a in local if a.cycle_id is not None), rejected
    )
    records = registry.version_records() if policy.prune_registry else []
    artefacts = scan_registry(registry.model_name, records, rejected, when) + local
    report = PruneReport(dry_run=dry_run, decisions=decide(artefacts, facts, policy))
    shared = _shared_sources(records)
    for decision in report.decisions:
        kind = decision.artefact.kind
        if not decision.delete:
            report.kept[kind] += 1
            continue
        size = sum(_size(p) for p in decision.artefact.paths)
        if not dry_run:
            try:
                _delete(registry, decision.artefact, shared)
            except (OSError, RegistryError) as exc:  # this one stays; the next run tries again
                log.error("could not delete %s %s: %s", kind, decision.artefact.name, exc)
                report.errors.append(f"{kind} {decision.artefact.name}: {exc}")
                continue
            metrics.ARTEFACTS_PRUNED.labels(kind).inc()
            log.info("pruned %s %s (%s)", kind, decision.artefact.name, decision.reason)
        report.deleted[kind] += 1
        report.freed_bytes += size
    return report


def _shared_sources(records: list[VersionRecord]) -> dict[str, int]:
    """How many versions were registered from each artifact URI (one shared is not deleted)."""
    counts: dict[str, int] = {}
    for record in records:
        counts[record.source] = counts.get(record.source, 0) + 1
    return counts


def _delete(registry: Registry, artefact: Artefact, shared: Mapping[str, int]) -> None:
    if artefact.kind == "registry":
        assert artefact.version is not None
        # Its checkpoint first: a version deleted first would leave its files with no version to find them.
        if artefact.source and shared.get(artefact.source, 0) <= 1:
            registry.delete_checkpoint_artifacts(artefact.source)
        registry.delete_version(artefact.version)
        return
    for path in artefact.paths:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def _size(path: Path) -> int:
    """Bytes of a file, or of every file under a directory (0 when it is gone)."""
    try:
        if path.is_file():
            return path.stat().st_size
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    except OSError:
        return 0
