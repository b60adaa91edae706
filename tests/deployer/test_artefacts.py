"""Artefact retention (deployer/artefacts.py): the policy by hand-worked cases, the scans of the
checkpoint and download folders, the store's rejected versions, `prune` on a SQLite store with a
stand-in registry (unit), and `prune` against the session's real MLflow (integration)."""

from __future__ import annotations

import json
import os
import uuid
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from factories import T0, FakeClock
from prometheus_client import REGISTRY

from deployer import artefacts
from deployer.artefacts import Artefact, CycleFact, Facts, decide, kept_versions
from registry import DOWNLOAD_COMPLETE, Registry, VersionRecord
from schemas.clock import utcnow
from schemas.settings import MlflowSettings, RetentionSettings, ServicesSettings, Settings, TrainerSettings
from store import Store

DAY = 86400.0
POLICY = RetentionSettings(keep_previous=2, min_age_s=DAY)


def _facts(**overrides: object) -> Facts:
    base: dict[str, object] = {
        "champion": 7,
        "alias": 7,
        "promoted": (7, 5, 5, 4, 3, 2, 1),  # 5 twice: promoted, rolled away from, rolled back to
        "serving": frozenset({6}),
        "in_flight": frozenset({9}),
        "anchors": frozenset({1}),
        "cycles": {
            10: CycleFact("promoted", 4),
            11: CycleFact("rejected", 8),
            12: CycleFact("failed", None),
            13: CycleFact("registered", 9),
            14: CycleFact("running", None),
            15: CycleFact("promoted", 2),
        },
        "rejected": frozenset({8, 9}),
    }
    return Facts(**{**base, **overrides})  # type: ignore[arg-type]


def _verdicts(found: list[artefacts.Decision]) -> dict[str, tuple[bool, str]]:
    return {d.artefact.name: (d.delete, d.reason) for d in found}


# ---- the policy ------------------------------------------------------------------------------------


@pytest.mark.unit
def test_kept_versions_are_the_champion_previous_n_served_in_flight_and_anchor() -> None:
    kept = kept_versions(_facts(), keep_previous=2)
    # Previous champions: 5 and 4 (5 counted once); 3 and 2 are past keep_previous.
    assert kept == {
        7: "the champion",
        5: "a previous champion (rollback)",
        4: "a previous champion (rollback)",
        6: "a serving server is announced on it",
        9: "a challenger in flight",
        1: "the anchor",
    }
    # An alias moved by hand keeps its version too; keep_previous=0 keeps no rollback target.
    assert kept_versions(_facts(alias=3), keep_previous=0) == {
        7: "the champion",
        3: "@champion in the registry",
        6: "a serving server is announced on it",
        9: "a challenger in flight",
        1: "the anchor",
    }
    assert kept_versions(Facts(champion=None), keep_previous=3) == {}


@pytest.mark.unit
def test_checkpoints_go_when_their_cycle_ended_and_its_version_is_not_kept() -> None:
    old, young = 2 * DAY, DAY / 2
    found = decide(
        [
            Artefact("checkpoint", "cycle-10", old, cycle_id=10),  # promoted v4: a previous champion
            Artefact("checkpoint", "cycle-11", old, cycle_id=11),  # rejected v8
            Artefact("checkpoint", "cycle-11.tmp", old, cycle_id=11),  # its crashed save
            Artefact("checkpoint", "cycle-12", old, cycle_id=12),  # failed before registering
            Artefact("checkpoint", "cycle-13", old, cycle_id=13),  # registered, waiting for the gate
            Artefact("checkpoint", "cycle-14", old, cycle_id=14),  # training now
            Artefact("checkpoint", "cycle-99", old, cycle_id=99),  # not in the store
            Artefact("checkpoint", "cycle-15", old, cycle_id=15),  # promoted v2, past keep_previous
            Artefact("checkpoint", "ranks/cycle-15", young, cycle_id=15),  # young
        ],
        _facts(),
        POLICY,
    )
    assert _verdicts(found) == {
        "cycle-10": (False, "v4: a previous champion (rollback)"),
        "cycle-11": (True, "cycle 11 ended rejected; v8 not kept; 2.0 days old"),
        "cycle-11.tmp": (True, "cycle 11 ended rejected; v8 not kept; 2.0 days old"),
        "cycle-12": (True, "cycle 12 ended failed; 2.0 days old"),
        "cycle-13": (False, "cycle 13 is in progress (registered)"),
        "cycle-14": (False, "cycle 14 is in progress (running)"),
        "cycle-99": (False, "no cycle 99 in the store"),
        "cycle-15": (True, "cycle 15 ended promoted; v2 not kept; 2.0 days old"),
        "ranks/cycle-15": (False, "younger than min_age_s (43200 s < 86400 s)"),
    }


@pytest.mark.unit
def test_downloads_go_unless_kept_and_registry_versions_only_when_rejected() -> None:
    old = 3 * DAY
    items = [
        Artefact("download", "deploy/v7", old, version=7),
        Artefact("download", "deploy/v3", old, version=3),
        Artefact("download", "deploy/v3-young", DAY - 1, version=3),
        Artefact("download", "deploy/.v3.download-42", old),
        Artefact("registry", "m v8", old, version=8),  # rejected
        Artefact("registry", "m v8-young", 60.0, version=8),
        Artefact("registry", "m v9", old, version=9),  # rejected, but a challenger in flight
        Artefact("registry", "m v3", old, version=3),  # promoted once, not kept: its files go, it stays
        Artefact("registry", "m v1", old, version=1),
    ]
    assert _verdicts(decide(items, _facts(), POLICY)) == {
        "deploy/v7": (False, "v7: the champion"),
        "deploy/v3": (True, "a downloaded copy; v3 not kept; 3.0 days old"),
        "deploy/v3-young": (False, "younger than min_age_s (86399 s < 86400 s)"),
        "deploy/.v3.download-42": (True, "an unfinished download; 3.0 days old"),
        "m v8": (True, "rejected by the gate, never promoted; v8 not kept; 3.0 days old"),
        "m v8-young": (False, "younger than min_age_s (60 s < 86400 s)"),
        "m v9": (False, "v9: a challenger in flight"),
        "m v3": (False, "not rejected by the gate"),
        "m v1": (False, "v1: the anchor"),
    }
    off = RetentionSettings(min_age_s=DAY, prune_registry=False)
    assert decide([items[4]], _facts(), off)[0].reason == "deployer.retention.prune_registry is off"


# ---- what there is -----------------------------------------------------------------------------------


def _aged(path: Path, now: datetime, age_s: float) -> Path:
    stamp = now.timestamp() - age_s
    os.utime(path, (stamp, stamp))
    return path


@pytest.mark.unit
def test_scans_find_what_the_trainer_and_the_registry_write(tmp_path: Path) -> None:
    from trainer.checkpoint import CycleFiles, optimizer_dir

    now = T0
    root = tmp_path / "checkpoints"
    files = CycleFiles(root, "exclaim@1", 3)
    for path in (files.out_dir, files.ranks_dir, root / "cycle-4.tmp", optimizer_dir(root, 3)):
        path.mkdir(parents=True)
        _aged(path, now, DAY)
    (root / "baselines-exclaim_1.json").write_text("{}")
    found = {(a.name, a.cycle_id, a.age_s) for a in artefacts.scan_checkpoints(root, now.timestamp())}
    assert found == {
        (str(files.out_dir), 3, DAY),
        (str(files.ranks_dir), 3, DAY),
        (str(root / "cycle-4.tmp"), 4, DAY),
    }  # the optimizer states and the baselines are not the checkpoints'

    deploy = tmp_path / "deploy"
    (deploy / "v2").mkdir(parents=True)
    _aged(_touch(deploy / "v2" / DOWNLOAD_COMPLETE), now, 60.0)  # used a minute ago
    _aged(deploy / "v2", now, 9 * DAY)
    (deploy / ".v5.download-123").mkdir()
    _aged(deploy / ".v5.download-123", now, 2 * DAY)
    (deploy / "v1-base").mkdir()  # the bootstrap's source, not a download
    (deploy / "probes").mkdir()
    downloads = artefacts.scan_downloads(deploy, now.timestamp())
    assert [(a.name, a.version, a.age_s, a.paths) for a in downloads] == [
        (str(deploy / ".v5.download-123"), None, 2 * DAY, (deploy / ".v5.download-123",)),
        (str(deploy / "v2"), 2, 60.0, (deploy / "v2", deploy / "probes" / "v2.json")),
    ]
    assert artefacts.scan_checkpoints(tmp_path / "nowhere", 0.0) == []

    records = [
        VersionRecord(1, "s3://a/1", None, now - timedelta(days=30)),
        VersionRecord(2, "s3://a/2", "r2", now - timedelta(days=30)),
    ]
    scanned = artefacts.scan_registry("m", records, {2: now - timedelta(days=2)}, now)
    assert [(a.name, a.age_s, a.source) for a in scanned] == [
        ("m v1", 30 * DAY, "s3://a/1"),
        ("m v2", 2 * DAY, "s3://a/2"),
    ]


def _touch(path: Path) -> Path:
    path.write_text("")
    return path


@pytest.mark.unit
def test_the_store_names_versions_the_gate_rejected_and_rtrl_never_promoted(store: Store) -> None:
    def decision(version: int, passed: bool, model: str | None = "m") -> None:
        store.record_gate_decision(version, 1, passed, "r", {}, store.clock(), model=model)

    decision(2, False)
    decision(3, False)
    decision(3, True)  # judged again and passed: the newest decision counts
    decision(4, True)
    decision(4, False)
    decision(5, False, model="other")
    decision(6, False, model=None)  # recorded before decisions named their model
    decision(7, False)
    store.record_promotion("m", 7, "force", "me", "by hand in a test")
    assert store.rejected_versions("m") == {2: T0, 4: T0, 6: T0}
    assert store.rejected_versions("other") == {5: T0, 6: T0}


# ---- prune ------------------------------------------------------------------------------------------


class StandIn:
    """The part of `registry.Registry` that `prune` uses, in memory (the integration test below
    runs it on the real one)."""

    def __init__(self, checkpoints_dir: Path, records: list[VersionRecord]) -> None:
        self.model_name = "m"
        self.checkpoints_dir = checkpoints_dir
        self.records = records
        self.aliases: dict[str, int] = {"champion": 3}
        self.deleted_artifacts: list[str] = []

    def alias(self, name: str) -> int | None:
        return self.aliases.get(name)

    def versions(self) -> list[int]:
        return [r.version for r in self.records]

    def version_records(self) -> list[VersionRecord]:
        return list(self.records)

    def delete_checkpoint_artifacts(self, source: str) -> None:
        self.deleted_artifacts.append(source)

    def delete_version(self, version: int) -> None:
        self.records = [r for r in self.records if r.version != version]


def _pruned(kind: str) -> float:
    return REGISTRY.get_sample_value("rtrl_artefacts_pruned_total", {"kind": kind}) or 0.0


@pytest.mark.unit
def test_prune_deletes_what_the_policy_lets_go_once_and_spares_a_cycle_in_progress(
    store: Store, tmp_path: Path
) -> None:
    now = T0 + timedelta(days=10)
    settings = Settings(trainer=TrainerSettings(checkpoint_dir=tmp_path / "checkpoints"))
    records = [VersionRecord(v, f"mem://v{v}", None, T0) for v in (1, 2, 3, 4)]
    registry = StandIn(tmp_path / "deploy", records)
    # v1 bootstrap, v2 promoted then v3; v4 rejected (cycle 3), and cycle 4 training now.
    for version, grounds in ((1, "bootstrap"), (2, "gate"), (3, "gate")):
        store.record_promotion("m", version, grounds, "me", "test")
    store.record_gate_decision(4, 3, False, "inferior", {}, T0, model="m")
    for status, version in (("promoted", 2), ("promoted", 3), ("rejected", 4)):
        cycle = store.acquire_cycle("w", 60.0, 1)
        assert cycle is not None
        store.finish_cycle(cycle, status, challenger=version)
    active = store.acquire_cycle("w", 60.0, 3)
    assert active == 4
    root = settings.trainer.checkpoint_dir
    for name in ("cycle-1", "cycle-2", "cycle-3", "cycle-4.tmp"):
        (root / name).mkdir(parents=True)
        (root / name / "model.safetensors").write_bytes(b"\0" * 1024)
        _aged(root / name, now, 5 * DAY)
    for version in (1, 2, 3, 4):
        (registry.checkpoints_dir / f"v{version}").mkdir(parents=True)
        _aged(_touch(registry.checkpoints_dir / f"v{version}" / DOWNLOAD_COMPLETE), now, 5 * DAY)
    (registry.checkpoints_dir / "probes").mkdir()
    _touch(registry.checkpoints_dir / "probes" / "v4.json")

    before = {kind: _pruned(kind) for kind in artefacts.KINDS}
    dry = artefacts.prune(settings, registry, store, dry_run=True, now=now)  # type: ignore[arg-type]
    assert {d.artefact.name for d in dry.deletions} == {
        "m v4",
        str(registry.checkpoints_dir / "v4"),
        str(root / "cycle-3"),  # rejected v4's checkpoint (cycle 3 registered v4)
    }
    assert dry.deleted == {"checkpoint": 1, "download": 1, "registry": 1} and dry.freed_bytes == 1024
    assert (root / "cycle-3").is_dir() and registry.versions() == [1, 2, 3, 4]

    report = artefacts.prune(settings, registry, store, now=now)  # type: ignore[arg-type]
    assert [d.artefact.name for d in report.deletions] == [d.artefact.name for d in dry.deletions]
    assert report.summary().startswith("deleted 1 checkpoint, 1 download, 1 registry")
    assert registry.versions() == [1, 2, 3] and registry.deleted_artifacts == ["mem://v4"]
    assert not (root / "cycle-3").exists() and not (registry.checkpoints_dir / "v4").exists()
    assert not (registry.checkpoints_dir / "probes" / "v4.json").exists()
    assert (root / "cycle-4.tmp").is_dir()  # cycle 4 is training: its save in progress stays
    assert (root / "cycle-1").is_dir() and (
        root / "cycle-2"
    ).is_dir()  # v2 the previous champion, v3 champion
    assert {kind: _pruned(kind) - before[kind] for kind in artefacts.KINDS} == {
        "checkpoint": 1,
        "download": 1,
        "registry": 1,
    }

    again = artefacts.prune(settings, registry, store, now=now)  # type: ignore[arg-type]
    assert again.deletions == [] and again.errors == []


# ---- against the real MLflow ---------------------------------------------------------------------------


def _checkpoint(directory: Path, marker: str) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"marker": marker}))
    (directory / "model.safetensors").write_bytes(b"\0" * 4096)
    return directory


@pytest.mark.integration
def test_prune_deletes_rejected_registry_versions(
    mlflow_service: Settings, store: Store, clock: FakeClock, tmp_path: Path
) -> None:
    """A version the gate rejected a while ago goes from MLflow with its checkpoint artifacts and its
    local copy; the champion, the previous champion, the base and a version rejected just now stay;
    a second run deletes nothing."""
    from mlflow.artifacts import list_artifacts

    clock.now = utcnow()  # the local copies' times are the wall clock's
    later = clock.now + timedelta(days=2)
    tag = uuid.uuid4().hex[:8]
    settings = mlflow_service.model_copy(
        update={
            "mlflow": MlflowSettings(
                **{
                    **mlflow_service.mlflow.model_dump(),
                    "model_name": f"retention-{tag}",
                    "experiment": f"retention-{tag}",
                }
            ),
            "services": ServicesSettings(
                **{**mlflow_service.services.model_dump(), "run_dir": tmp_path / "run"}
            ),
            "trainer": TrainerSettings(checkpoint_dir=tmp_path / "checkpoints"),
        }
    )
    registry = Registry(settings.mlflow, tmp_path / "run" / "deploy", mlflow_service.services.run_dir)
    versions = [registry.register_checkpoint(_checkpoint(tmp_path / f"c{i}", str(i))) for i in range(1, 6)]
    assert versions == [1, 2, 3, 4, 5]
    store.record_promotion(registry.model_name, 1, "bootstrap", "me", "base")
    store.record_promotion(registry.model_name, 2, "force", "me", "by hand in a test")
    store.record_promotion(registry.model_name, 3, "force", "me", "by hand in a test")
    registry.set_alias("champion", 3)
    long_ago = store.clock() - timedelta(days=3)
    store.record_gate_decision(4, 3, False, "inferior", {}, long_ago, model=registry.model_name)
    rejected_now = later - timedelta(hours=1)
    store.record_gate_decision(5, 3, False, "inferior", {}, rejected_now, model=registry.model_name)
    copy = registry.download_checkpoint(4)
    source = registry.version_records()[3].source
    assert [a.path for a in list_artifacts(artifact_uri=source, tracking_uri=settings.mlflow.tracking_uri)]

    dry = artefacts.prune(settings, registry, store, dry_run=True, now=store.clock())
    assert [d.artefact.name for d in dry.deletions] == [f"{registry.model_name} v4"]
    assert registry.versions() == [1, 2, 3, 4, 5]

    # The local copy was used just now (young); two days later it and v4 go, and v5 (rejected an
    # hour before then) stays.
    report = artefacts.prune(settings, registry, store, now=later)
    print(report.summary())
    assert report.errors == []
    assert {d.artefact.name for d in report.deletions} == {f"{registry.model_name} v4", str(copy)}
    assert registry.versions() == [1, 2, 3, 5]
    assert not copy.exists()
    assert list_artifacts(artifact_uri=source, tracking_uri=settings.mlflow.tracking_uri) == []
    assert registry.download_checkpoint(3).is_dir()  # the champion is still whole

    again = artefacts.prune(settings, registry, store, now=later)
    assert again.deletions == [] and again.errors == []
