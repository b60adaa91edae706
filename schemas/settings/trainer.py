"""Settings of the Celery-scheduled training cycle, its LoRA adapter and its trust region."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from schemas.settings.losses import CispoLoss, LossSettings
from schemas.settings.section import Section

# The trust region's default, from the loop on the tiny model (docs/algorithms.md, Stable updates):
# cycles measured 0.01-0.64 nats per token at their last step and spikes above 1; 0.25 kept one
# more cycle from a converged champion within 0.3 points (none: -3.0), 0.1 within 0.3 too at about
# the same speed, and with 0.25 the eval gate's alarms rejected the first challenger of the demo
# (punctuation-only answers 20 % vs 0 %), with 0.1 they passed it (docs/gate.md).
MAX_KL_DEFAULT = 0.1
# The replay file's caps (schemas/replay.py `read_replay_file`): every cycle reads it into memory.
REPLAY_MAX_BYTES = 256 * 2**20
REPLAY_MAX_LINE_BYTES = 2**20
# Failed cycles an episode may be claimed by before it is quarantined (docs/security.md, Poisoned
# episodes): the store's default too, for callers without settings.
MAX_EPISODE_FAILURES_DEFAULT = 3


class LoraSettings(Section):
    """The LoRA adapter of ``trainer.adapter=lora`` cycles (PEFT; docs/lora.md)."""

    rank: int = Field(
        8, ge=1, le=256, description="Rank r of every adapter matrix; also the servers' --max-lora-rank."
    )
    alpha: int = Field(16, ge=1, description="Scaling alpha (the update is scaled by alpha / rank).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input while training.")
    lr: float = Field(
        1e-2,
        gt=0,
        description="AdamW learning rate of adapter cycles, in place of trainer.lr (an adapter needs about 10x a "
        "full fine-tune's: measured on the demo, 1e-3 left acceptance flat, 1e-2 moved it 0.25 -> 0.44-0.58).",
    )
    target_modules: tuple[str, ...] = Field(
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        min_length=1,
        description="Linear modules that get an adapter (names as in the base model; the default fits Llama, "
        "Qwen and Mistral).",
    )


class ReplaySettings(Section):
    """Replay of retention data in every cycle (docs/algorithms.md, Keeping what the model knows):
    rows of a file of examples the model should keep answering, trained with a supervised term
    beside the policy objective (trainer/replay.py). Off while ``path`` is None."""

    path: Path | None = Field(
        None,
        description='JSONL file of examples, one a line: {"messages": [chat messages], "completion": "..."} '
        "(schemas/replay.py); read and checked by each cycle before it takes the lease, a bad line is an "
        "error naming it. None: no replay.",
    )
    weight: float = Field(
        0.1,
        ge=0,
        description="Coefficient of the replay term: loss = policy loss + weight x mean token NLL of the replay "
        "completions. 0: the rows are scored (the NLL is still reported) and add no gradient.",
    )
    per_cycle: int = Field(
        32,
        ge=1,
        description="Examples drawn from the file per cycle, without replacement (all of them when the file "
        "has fewer), seeded by trainer.seed and the cycle's id.",
    )
    max_bytes: int = Field(
        REPLAY_MAX_BYTES,
        ge=1,
        description="The largest replay file read (bytes; 256 MiB): every cycle reads the whole file into "
        "memory, so a larger one (a wrong path, a log file) fails the cycle before it takes the lease, naming "
        "the file, its size and this setting.",
    )
    max_line_bytes: int = Field(
        REPLAY_MAX_LINE_BYTES,
        ge=1,
        description="The longest line of the replay file (bytes; 1 MiB): a longer one fails the cycle before "
        "it takes the lease, naming the file, the line and this setting.",
    )


class TrainerSettings(Section):
    """The Celery-scheduled training cycle."""

    interval_s: float = Field(60.0, description="Beat checks for a cycle this often.")
    cadence_s: float = Field(
        5 * 3600.0,
        ge=0,
        description="At most one cycle per this many seconds: beat starts the next cycle only when the last one "
        "that spent its episodes (promoted or rejected) started at least this long ago (Cursor retrains about "
        "every 5 hours). 0: as soon as min_samples episodes are trainable. Failed and skipped cycles do not "
        "count; `rtrl train now` and the demo start cycles whatever the cadence.",
    )
    min_samples: int = Field(
        32, ge=1, description="Settled episodes of the champion needed to start a cycle."
    )
    max_episodes: int = Field(512, ge=1, description="At most this many episodes per cycle (newest first).")
    max_policy_lag: int = Field(
        0,
        ge=0,
        description="Use episodes of the champion and of the this-many versions that served users most "
        "recently before it (0 = on-policy; versions the gate rejected never served and do not count).",
    )
    steps: int = Field(4, ge=1, description="Optimizer steps per cycle.")
    min_signal: float = Field(
        0.05,
        ge=0,
        le=1,
        description="A cycle trains only when more than this fraction of its episodes carries user feedback or a "
        "judge's grade (never decided on advantages, which a running baseline makes non-zero); otherwise it is "
        "skipped (its episodes are spent, nothing is registered).",
    )
    lr: float = Field(
        1e-3, gt=0, description="AdamW learning rate (of full-weight cycles; adapters: trainer.lora.lr)."
    )
    max_kl: float | None = Field(
        MAX_KL_DEFAULT,
        gt=0,
        description="Trust region of one cycle: once a step's forward passes measure KL(champion || policy) above "
        "this (k3 estimate, mean per trainable token), that step's update is not applied and the cycle stops "
        "there. None: every step runs.",
    )
    carry_optimizer: bool = Field(
        True,
        description="Continue AdamW's moments from the cycle that produced the champion, when this worker kept "
        "them (same ZeRO stage and precision): a fresh AdamW takes steps of about lr whatever the size of the "
        "gradient. Off: every cycle starts a fresh optimizer.",
    )
    warmup_steps: int = Field(
        8,
        ge=0,
        description="Linear learning-rate warm-up over the optimizer's first N steps: step t (counted over the "
        "optimizer's life, carried ones included) runs at lr x min(1, t / N). A fresh AdamW's first step moves "
        "every weight by about lr whatever its gradient (docs/algorithms.md, Keeping what the model knows). "
        "0: none.",
    )
    keep_optimizer_states: int = Field(
        3,
        ge=1,
        description="Optimizer states kept on the worker's disk (the newest cycles'); each is about 2x the weights.",
    )
    micro_batch: int = Field(32, ge=1, description="Sequences per forward pass.")
    ranks: int = Field(
        1,
        ge=1,
        le=64,
        description="DeepSpeed data-parallel ranks of a cycle: 1 trains inside the worker process; N > 1 launches N "
        "rank processes on the worker's host with torch.distributed.run (one per GPU; on CPU, one per core), each "
        "taking every N-th micro-batch; one rank of the worker's host saves the checkpoint, the worker registers "
        "it (trainer/ranks.py). With trainer.nodes > 1, the ranks of each host.",
    )
    nodes: int = Field(
        1,
        ge=1,
        le=64,
        description="Hosts a cycle's ranks span: 1 = the worker's host only; N > 1 = the worker's host and N - 1 "
        "hosts running `rtrl train node`, each starting trainer.ranks ranks per cycle, meeting at "
        "trainer.rendezvous (torch.distributed.run's c10d rendezvous). Every host reads the cycle's job and the "
        "champion and writes its optimizer state at the same paths: trainer.checkpoint_dir and "
        "<services.run_dir>/deploy must be one shared filesystem (docs/scaling.md, Training across hosts).",
    )
    rendezvous: str | None = Field(
        None,
        description="host:port where the ranks of a multi-node cycle (trainer.nodes > 1) meet: the worker's "
        "launcher hosts the rendezvous there for each cycle (it binds the port on the worker's host), and every "
        "`rtrl train node` connects to it, so host must be the worker's address as the other hosts reach it. "
        "Required when trainer.nodes > 1.",
    )
    rendezvous_timeout_s: float = Field(
        600.0,
        gt=0,
        description="How long a multi-node cycle waits for all trainer.nodes hosts to join its rendezvous; a "
        "host that has not joined by then fails the cycle; its episodes go back to the pool uncounted (a lost "
        "host is not the data's fault: trainer/ranks.py `HostsFailed`).",
    )
    collective_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="How long a rank of a multi-rank cycle waits for the others in a collective or in setting up "
        "its process groups before it fails, and the cycle with it: what ends a cycle whose host vanished "
        "without closing its connections (a host whose processes die closes them, and its peers fail at "
        "their next collective). DeepSpeed's default, 30 minutes; each host uses its own.",
    )
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage.")
    adapter: Literal["full", "lora"] = Field(
        "full",
        description="What a cycle trains and the fleet swaps: full = every weight, loaded with vLLM's "
        "reload_weights; lora = a LoRA adapter on vllm.model_dir (trainer.lora), loaded in place under "
        "vllm.served_model_name with vLLM's runtime adapter loading (docs/lora.md). Chosen once per "
        "registry: a registry's versions are all adapters or all full weights.",
    )
    lora: LoraSettings = Field(
        default_factory=LoraSettings, description="The adapter of adapter=lora cycles."
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="Training precision: auto = bf16 when DeepSpeed's accelerator is a GPU (DS_ACCELERATOR=cuda), "
        "fp32 on the CPU accelerator (the default).",
    )
    offload: Literal["none", "cpu"] = Field(
        "none",
        description="ZeRO offload to CPU memory: the optimizer state (stage >= 1) and, at stage 3, the parameters. "
        "Needs a GPU (DeepSpeed's CPU Adam).",
    )
    loss: LossSettings = Field(
        default_factory=CispoLoss,
        description="Policy-gradient loss or objective (see LossSettings). Written corrections are distilled into "
        "it by the reward spec's hindsight term (RewardSpec.hindsight, trainer/hindsight.py), not by a setting here.",
    )
    reference: str = Field(
        "base",
        pattern=r"^(base|[1-9][0-9]*)$",
        description="The fixed version of the loss' ref_kl_coef penalty, KL(pi_theta || pi_ref): base (the first "
        "registered version, as gate.anchor's base) or a version number. Read only when ref_kl_coef > 0; a "
        "version that is not registered fails the cycle before it takes the lease (trainer/reference.py).",
    )
    checkpoint_dir: Path = Field(
        Path(".rtrl/run/checkpoints"), description="Where cycle checkpoints are written."
    )
    lease_ttl_s: float = Field(
        120.0,
        gt=0,
        description="The cycle lease: its worker renews it every quarter of this while the job runs (training, "
        "gate, swap); one not renewed for this long belongs to a dead worker, and the cycle is failed and "
        "its episodes released at the next check (trainer/lease.py).",
    )
    max_episode_failures: int = Field(
        MAX_EPISODE_FAILURES_DEFAULT,
        ge=1,
        le=100,
        description="An episode claimed by this many failed cycles (failed in training, or whose worker died) is "
        "quarantined with the last cycle's error instead of going back to the pool: never selected again until "
        "`rtrl dlq episodes --release ID` (docs/security.md, Poisoned episodes). A whole batch is counted, so an "
        "innocent episode needs this many failures, each beside whatever broke it; 1 quarantines a batch on "
        "its first failure.",
    )
    max_cycle_s: float = Field(
        6 * 3600.0,
        gt=0,
        description="The longest a cycle job (train, gate, swap) may run: Redis redelivers an unacknowledged "
        "job after this (Celery's visibility timeout), and the redelivered job takes the cycle over.",
    )
    replay: ReplaySettings = Field(
        default_factory=ReplaySettings,
        description="Replay of retention data beside the policy objective (off by default).",
    )
    seed: int = Field(0, description="Seed of the training cycle.")

    @property
    def learning_rate(self) -> float:
        """The learning rate of this mode's cycles: trainer.lr, or trainer.lora.lr for adapters."""
        return self.lora.lr if self.adapter == "lora" else self.lr

    @model_validator(mode="after")
    def _offload_needs_zero(self) -> TrainerSettings:
        if self.offload != "none" and self.zero_stage == 0:
            raise ValueError("offload=cpu needs zero_stage >= 1 (ZeRO partitions what it offloads)")
        if self.nodes > 1 and self.rendezvous is None:
            raise ValueError("trainer.nodes > 1 needs trainer.rendezvous (host:port of the worker's host)")
        if self.nodes == 1 and self.rendezvous is not None:
            raise ValueError(
                "trainer.rendezvous is read only when trainer.nodes > 1: set trainer.nodes, or unset the rendezvous"
            )
        if self.adapter == "lora" and self.zero_stage == 3:
            raise ValueError(
                "adapter=lora runs at zero_stage 0-2 (stage 3 would partition the frozen base "
                "model too; a LoRA cycle trains a few MB)"
            )
        if self.replay.path is not None and (self.ranks > 1 or self.nodes > 1):
            raise ValueError(
                "trainer.replay runs on one rank of one host (trainer.ranks=1, trainer.nodes=1): the rank "
                "processes do not take the replay rows yet"
            )
        return self

    @field_validator("rendezvous")
    @classmethod
    def _host_and_port(cls, value: str | None) -> str | None:
        if value is None:
            return value
        host, _, port = value.rpartition(":")
        if ":" in host and not (host.startswith("[") and host.endswith("]")):
            raise ValueError(
                f"trainer.rendezvous must be host:port, an IPv6 host in brackets ([::1]:29400), not {value!r}"
            )
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"trainer.rendezvous must be host:port with a port in 1-65535, not {value!r}")
        return value

    @field_validator("loss", mode="before")
    @classmethod
    def _cispo_unless_named(cls, value: object) -> object:
        # RTRL_TRAINER__LOSS__EPS_HIGH=0.3 alone tunes the default loss.
        if isinstance(value, dict) and "type" not in value:
            return {**value, "type": "cispo"}
        return value
