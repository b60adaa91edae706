"""Settings of the rolling hot-swap of the vLLM fleet and of the weights agent on each vLLM host."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr

from schemas.settings.section import Section


class RetentionSettings(Section):
    """Which artefacts `rtrl deploy prune` keeps (deployer/artefacts.py; docs/runbooks/deployer.md,
    Artefact retention): cycle checkpoints, downloaded versions, and registry versions the gate rejected."""

    keep_previous: int = Field(
        3,
        ge=0,
        description="Champions before the current one that are kept, by rtrl's record of its promotions: what "
        "`rtrl deploy rollback` can go back to without a download from a pruned registry. The champion, any version a "
        "server is announced on, the challenger of a cycle in progress, @challenger and the gate's anchor (and the "
        "bootstrap's base) are always kept.",
    )
    min_age_s: float = Field(
        86400.0,
        ge=0,
        description="Nothing younger is deleted: a checkpoint or leftover by its modification time, a download by "
        "its last use, a rejected registry version by the gate decision that rejected it.",
    )
    prune_registry: bool = Field(
        True,
        description="Also delete registry versions the gate rejected (and never served), with their checkpoint "
        "artifacts; their MLflow runs (metrics, the gate's record) stay. False: only local files are pruned.",
    )
    interval_s: float | None = Field(
        86400.0,
        gt=0,
        description="Beat enqueues the prune on the worker this often (between cycles, task rtrl.prune_artefacts). "
        "null: beat does not schedule it (the Kubernetes manifests run `rtrl deploy prune` as a CronJob instead).",
    )


class DeployerSettings(Section):
    """The rolling hot-swap of the vLLM fleet."""

    retention: RetentionSettings = Field(
        default_factory=RetentionSettings,
        description="What `rtrl deploy prune` keeps of checkpoints, downloads and rejected registry versions.",
    )

    probe_tolerance: float | None = Field(
        None,
        gt=0,
        description="Max |logprob| difference vLLM vs transformers (float32) on the swap probe. None: by the dtype "
        "the servers compute in (vllm.dtype resolved against the checkpoint's config.json), from the table "
        "PROBE_TOLERANCES in deployer/probe.py (docs/platform.md, Verification tolerances). A number overrides it.",
    )
    pause_mode: Literal["wait", "abort", "keep"] = Field(
        "wait", description="vLLM /pause mode during a swap."
    )
    reconcile_interval_s: float = Field(
        30.0,
        gt=0,
        description="`rtrl run`'s reconciler checks every server this often: one restarted on base weights or "
        "on another version is swapped back to @champion (verified), one left paused or out of rotation by a "
        "deployer that died is resumed and put back.",
    )
    lock_wait_s: float = Field(
        300.0,
        ge=0,
        description="How long the worker's chain waits for a deploy lock another process holds (the staging "
        "server for the gate, the canary, the fleet for the promotion) before its cycle fails: a reconciler "
        "tick holds the fleet for a moment every reconcile_interval_s. Operators' commands and the reconciler "
        "never wait (docs/runbooks/deployer.md, Locks).",
    )
    drain_timeout_s: float = Field(
        30.0,
        gt=0,
        description="With more than one serving server: how long a server taken out of the gateways' rotation "
        "may take to finish the requests it has before it is paused anyway.",
    )


class AgentSettings(Section):
    """The weights agent on each vLLM host (`rtrl agent`, deployer/agent.py; docs/scaling.md)."""

    host: str = Field(
        "127.0.0.1", description="Bind address of `rtrl agent` (the deployer's hosts must reach it)."
    )
    port: int = Field(18090, ge=1, le=65535, description="Bind port of `rtrl agent`.")
    cache_dir: Path = Field(
        Path(".rtrl/agent"),
        description="Where the agent keeps the versions it downloaded (visible to the vLLM "
        "servers of its host).",
    )
    keep_versions: int = Field(
        4,
        ge=2,
        description="Versions kept in cache_dir, the most recently asked for (a rollback needs the one before).",
    )
    token: SecretStr | None = Field(
        None,
        description="When set, the agent asks for `Authorization: Bearer <token>` and the deployer sends it (one "
        "secret shared by the deployer's processes and every agent).",
    )
