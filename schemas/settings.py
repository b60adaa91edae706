"""rtrl settings: one pydantic-settings model, read from the environment once at start-up.

Every variable is prefixed ``RTRL_`` and nested with ``__``; for example
``RTRL_KAFKA__BOOTSTRAP_SERVERS=broker:9092`` or ``RTRL_TRAINER__MIN_SAMPLES=256``.
The value ``null`` sets an optional setting to None (``RTRL_TRAINER__MAX_KL=null``). A ``.env``
file in the working directory is read too. The defaults are the one-machine deployment that
``rtrl services up`` starts on loopback under ``.rtrl/``: the store and MLflow's backend are its
PostgreSQL's databases (:func:`local_postgres_url`), which ``rtrl run`` and the operator commands
use; ``rtrl demo`` swaps the ones left unset for SQLite files (:func:`embedded_databases`).

Nothing else in rtrl reads the environment: processes build ``Settings()`` at start-up and pass
it (or the section they need) down.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.errors import OperatorError


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ServicesSettings(_Section):
    """Where `rtrl services` keeps its data and logs, and the loopback ports it starts on."""

    run_dir: Path = Field(Path(".rtrl/run"), description="Data, logs and pid files of the local services.")
    cache_dir: Path = Field(
        Path.home() / ".cache" / "rtrl",
        description="Downloads shared between checkouts (Kafka jars from Maven Central).",
    )
    host: str = Field("127.0.0.1", description="Interface the local services bind to.")
    kafka_port: int = Field(19092, description="Kafka broker (PLAINTEXT listener).")
    kafka_controller_port: int = Field(19093, description="Kafka KRaft controller listener.")
    kafka_version: str = Field("4.4.0", description="org.apache.kafka:kafka_2.13 version from Maven Central.")
    postgres_port: int = Field(15432, description="PostgreSQL server.")
    redis_port: int = Field(16379, description="Redis server (Celery broker and result backend).")
    mlflow_port: int = Field(15000, description="MLflow tracking server.")
    vllm_port: int = Field(18000, description="vLLM OpenAI-compatible server (the serving fleet of one).")
    vllm_staging_port: int | None = Field(
        18001, description="Second vLLM server the eval gate and swap verification use; None to not start it."
    )
    start_timeout_s: float = Field(
        600.0, description="How long `services up` waits for a service to be healthy."
    )
    restart_vllm: bool = Field(
        True,
        description="The fleet reconciler (`rtrl deploy reconcile`, `rtrl run`) restarts a vLLM server this run dir "
        "started when its process exits (vLLM exits when its engine dies) or its health check keeps failing; "
        "the restarted server is out of rotation until it serves @champion again.",
    )
    vllm_unhealthy_restart_s: float = Field(
        120.0, gt=0, description="How long a running vLLM server's health check may fail before the reconciler restarts it."
    )
    enabled: tuple[str, ...] = Field(
        ("kafka", "postgres", "redis", "mlflow", "vllm"),
        description="Services `rtrl services up` starts.",
    )
    log_max_bytes: int = Field(
        50 * 1024 * 1024,
        ge=0,
        description="`rtrl run` rotates a log in <run_dir>/logs/ (its processes' and the local services') once it "
        "is larger than this (copy-truncate, services/logs.py); 0 turns rotation off.",
    )
    log_backups: int = Field(
        5, ge=0, description="Rotated copies kept per log (name.log.1 is the newest); 0 keeps none."
    )


class KafkaSettings(_Section):
    """The event stream."""

    bootstrap_servers: str = Field("127.0.0.1:19092", description="Comma-separated host:port list.")
    interactions_topic: str = Field("rtrl.interactions.v1", description="InteractionEvent topic.")
    feedback_topic: str = Field("rtrl.feedback.v1", description="FeedbackEvent topic.")
    dlq_topic: str = Field("rtrl.dlq.v1", description="Dead-letter topic (DeadLetterRecord).")
    partitions: int = Field(3, ge=1, description="Partitions per topic when rtrl creates them.")
    replication_factor: int = Field(
        1, ge=1, description="Replicas per partition of the topics rtrl creates (3 on a production cluster; the local "
        "broker of `rtrl services` has one, and its topics are made with 1 whatever this says)."
    )
    min_insync_replicas: int | None = Field(
        None, ge=1, description="min.insync.replicas of the topics rtrl creates (with acks=all, a write needs this many "
        "replicas; 2 with replication_factor 3); None: the broker's default."
    )
    labeler_group: str = Field("rtrl-labeler", description="Consumer group of the feedback labeler.")
    max_message_bytes: int = Field(
        17 * 1024 * 1024,
        ge=64 * 1024,
        description="Largest record rtrl produces: the producers' max_request_size, max.message.bytes of the "
        "topics rtrl creates and of the local broker, the consumers' fetch size. A record over it is "
        "dead-lettered where it is produced. Default: the 16 MiB event limit plus room for key and headers.",
    )
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="How clients connect to the brokers."
    )
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = Field(
        None, description="SASL mechanism (with SASL_PLAINTEXT / SASL_SSL)."
    )
    sasl_username: str | None = Field(None, description="SASL user name.")
    sasl_password: SecretStr | None = Field(None, description="SASL password (never printed).")
    ssl_cafile: Path | None = Field(None, description="CA bundle that signed the brokers' certificates (SSL).")
    ssl_certfile: Path | None = Field(None, description="Client certificate, PEM (mutual TLS).")
    ssl_keyfile: Path | None = Field(None, description="Private key of the client certificate, PEM.")
    reconnect_backoff_max_ms: int = Field(
        2000,
        ge=50,
        description="Longest wait between a client's attempts to reconnect to a broker. kafka-python's own "
        "default (30 s) can keep a labeler idle for half a minute after a broker comes back.",
    )

    @model_validator(mode="after")
    def _security_complete(self) -> KafkaSettings:
        if self.security_protocol.startswith("SASL_"):
            if self.sasl_mechanism is None or not self.sasl_username or self.sasl_password is None:
                raise ValueError(
                    f"security_protocol {self.security_protocol} needs sasl_mechanism, sasl_username and sasl_password"
                )
        elif self.sasl_mechanism is not None:
            raise ValueError(f"sasl_mechanism is set but security_protocol is {self.security_protocol}")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile and ssl_keyfile go together (mutual TLS)")
        return self


class StoreSettings(_Section):
    """The SQL store of events and labelled episodes."""

    url: str = Field(
        "postgresql+psycopg://rtrl@127.0.0.1:15432/rtrl",
        description="SQLAlchemy URL: sqlite:///path or postgresql+psycopg://user@host:port/db. Unset: the "
        "postgres.database database of the local PostgreSQL (`rtrl services up`) at "
        "services.host:services.postgres_port as postgres.user (the default shown is that with the default "
        "ports); `rtrl demo` makes it sqlite:///<services.run_dir>/rtrl.db instead.",
    )


class PostgresSettings(_Section):
    """The local PostgreSQL server that `rtrl services` runs: the store and MLflow's backend by default."""

    user: str = Field("rtrl", description="Role created for rtrl (owner of both databases).")
    database: str = Field("rtrl", description="Database created for rtrl's store.")
    mlflow_database: str = Field("mlflow", description="Database created for the local MLflow server's backend.")


class CelerySettings(_Section):
    """The trainer's task queue."""

    broker_url: str = Field("redis://127.0.0.1:16379/0", description="Celery broker URL.")
    result_backend: str = Field("redis://127.0.0.1:16379/1", description="Celery result backend URL.")


class MlflowSettings(_Section):
    """Experiment tracking and the model registry."""

    tracking_uri: str = Field("http://127.0.0.1:15000", description="MLflow tracking server URI.")
    backend_store_uri: str = Field(
        "postgresql+psycopg://rtrl@127.0.0.1:15432/mlflow",
        description="Database of the local MLflow server (SQLAlchemy URL). Unset: the postgres.mlflow_database "
        "database of the local PostgreSQL (`rtrl services up` starts MLflow once it is up; the default shown is "
        "that with the default ports); `rtrl demo` makes it sqlite:///<services.run_dir>/mlflow/mlflow.db instead.",
    )
    artifact_root: Path = Field(
        Path(".rtrl/run/mlflow/artifacts"), description="Artifact root of the local server."
    )
    experiment: str = Field("rtrl", description="Experiment that training cycles log to.")
    model_name: str = Field("rtrl-policy", description="Registered model name.")


class VllmSettings(_Section):
    """The vLLM fleet rtrl serves from and hot-swaps."""

    servers: tuple[str, ...] = Field(
        ("http://127.0.0.1:18000",), description="Base URLs of the vLLM OpenAI servers (the fleet)."
    )
    model_dir: Path = Field(
        Path(".rtrl/models/tiny"), description="HF-format checkpoint the local server starts on."
    )
    staging_server: str | None = Field(
        "http://127.0.0.1:18001",
        description="vLLM server for eval-gate generation and for recording a checkpoint's digests; never serves users.",
    )
    served_model_name: str = Field("rtrl-tiny", description="Model name clients send.")
    logprobs_mode: Literal["processed", "raw"] = Field(
        "processed",
        description="What the fleet's servers report as logprobs: processed (vLLM --logprobs-mode processed_logprobs, "
        "after temperature and truncation; rtrl starts its servers so) or raw (a fleet started without it: only "
        "requests sampled at temperature 1 without truncation, or greedy, are then trainable).",
    )
    sampling_defaults: dict[str, float] | None = Field(
        None,
        description="Sampling defaults the gateway writes into requests that leave them out (temperature, top_p, "
        "top_k, min_p, penalties). None: the model's generation_config.json in model_dir (none there: vLLM's "
        "neutral defaults). rtrl's servers run with --generation-config vllm, so these are the only defaults applied.",
    )

    @field_validator("sampling_defaults")
    @classmethod
    def _known_sampling_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        from schemas.sampling import GENERATION_CONFIG_KEYS

        unknown = sorted(set(value or {}) - set(GENERATION_CONFIG_KEYS))
        if unknown:
            raise ValueError(f"unknown sampling parameters {unknown}; known: {list(GENERATION_CONFIG_KEYS)}")
        return value

    @field_validator("staging_server", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        # RTRL_VLLM__STAGING_SERVER= (empty) means "no staging server", not a server at "".
        return None if isinstance(value, str) and not value.strip() else value
    weights_agents: dict[str, str] = Field(
        default_factory=dict,
        description="Server URL -> URL of the weights agent (`rtrl agent`) on that server's host, for servers "
        "that cannot see the deployer's files: the deployer asks the agent to download the version from the "
        "registry's artifact store and hands vLLM the agent's path. A server without one is handed the "
        "deployer's own download (one host, or a volume every host mounts). JSON: "
        '\'{"http://vllm-0:8000": "http://vllm-0:18090"}\'.',
    )
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32",
        description="--dtype of the vLLM servers, and the dtype the swap probe's tolerance follows "
        "(deployer.probe_tolerance). float32 (the default, for CPU): vLLM then matches the trainer's float32 "
        "transformers reference to about 1e-6; bfloat16 or float16 on a GPU; auto: the checkpoint's own dtype "
        "from config.json (a float32 checkpoint is served in bfloat16: vLLM's rule). A fleet rtrl does not "
        "start must run with the dtype named here.",
    )
    kv_cache_gib: int = Field(1, description="VLLM_CPU_KVCACHE_SPACE for the local CPU server.")
    max_model_len: int = Field(512, description="Context length of the local server.")
    request_timeout_s: float = Field(120.0, description="Timeout of one request to a vLLM server.")


class GatewaySettings(_Section):
    """The OpenAI-compatible capture gateway in front of the vLLM fleet."""

    host: str = Field("127.0.0.1", description="Bind address of `rtrl gateway`.")
    port: int = Field(18080, description="Bind port of `rtrl gateway`.")
    access_log: bool = Field(
        False,
        description="Log one line per request (uvicorn's access log). Off by default: it costs 0.1-0.3 ms "
        "of CPU per request on 2 cores, and rtrl_gateway_requests_total{endpoint,status} counts every answer.",
    )
    spool_dir: Path = Field(
        Path(".rtrl/run/spool"), description="On-disk spool for events Kafka did not take."
    )
    spool_max_bytes: int = Field(
        256 * 1024 * 1024, description="Spool bound; past it new records go to the overflow file (spool_dir/overflow.jsonl)."
    )
    publish_timeout_s: float = Field(
        5.0,
        gt=0,
        description="How long an event may wait for Kafka's acknowledgement before it is spooled to disk "
        "(a producer that does not settle its events within this plus 1 s is replaced).",
    )
    auth: Literal["keys", "open"] = Field(
        "keys",
        description="keys: every call needs an API key (`rtrl keys create`); open: no keys, one tenant "
        "'default', for local experiments only (logged loudly, shown by /readyz).",
    )
    keys_refresh_s: float = Field(5.0, gt=0, description="How often the gateway reloads the keys from the store.")
    rotation_refresh_s: float = Field(
        0.25, gt=0, le=5, description="How often the gateway reads which servers the deployer took out of rotation."
    )
    request_id_secret: SecretStr | None = Field(
        None,
        description="Secret that signs request ids for their tenant; the same on every gateway replica. "
        "Unset: one is made in <services.run_dir>/gateway.secret (enough for gateways on one host).",
    )
    rate_limit_per_s: float = Field(
        20.0, ge=0, description="Requests a second per key (0 = unlimited); a key may have its own rate."
    )
    rate_limit_burst: float = Field(40.0, ge=1, description="Requests a key may send at once before it is limited.")
    max_request_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="Largest completion request body; larger is 413, refused unread."
    )
    max_feedback_bytes: int = Field(
        1024 * 1024, ge=1024, description="Largest feedback request body; larger is 413, refused unread."
    )
    redaction: tuple[str, ...] = Field(
        ("email", "phone", "api_key"),
        description="Detectors masking text in events before they leave the gateway: email, phone, api_key "
        "or module:function (see ingest/redaction.py); [] turns redaction off.",
    )


class LimitsSettings(_Section):
    """What events rtrl accepts at all: checked by the gateway (refused) and the labeler (dead-lettered)."""

    max_future_skew_s: float = Field(
        300.0, ge=0, description="An event's created_at may be at most this far ahead of the receiver's clock."
    )
    max_event_age_s: float = Field(
        30 * 24 * 3600.0, gt=0, description="An event's created_at may be at most this old (the data's retention)."
    )


class _Loss(_Section):
    """What every loss has: the behaviour-weight cap and an optional KL penalty to the champion."""

    is_cap: float = Field(
        2.0, gt=0, description="Truncation C of the behaviour importance weight min(pi_old/mu, C)."
    )
    kl_coef: float = Field(
        0.0, ge=0, description="Weight beta of KL(pi_theta || pi_old), pi_old being the champion the cycle "
        "started from; 0 = no penalty."
    )
    kl_estimator: Literal["k1", "k3"] = Field("k3", description="KL estimator on the sampled tokens.")


class CispoLoss(_Loss):
    """CISPO (MiniMax-M1, arXiv 2506.13585 §3.1): the clipped ratio is a stop-gradient weight, so
    every token keeps its gradient; no lower bound, the upper bound of DAPO's clip-higher."""

    type: Literal["cispo"] = "cispo"
    eps_low: float = Field(1.0, ge=0, le=1, description="Lower clip of the ratio weight (1.0 = no lower bound).")
    eps_high: float = Field(0.28, gt=0, description="Upper clip of the ratio weight.")
    # rtrl's default loss keeps each cycle near the champion: without the penalty, bench_learning's
    # gate rejected most challengers for lost held-out answers (docs/algorithms.md, Keeping what the
    # model knows).
    kl_coef: float = Field(
        0.5, ge=0, description="Weight beta of KL(pi_theta || pi_old), pi_old being the champion the cycle "
        "started from; 0 = no penalty."
    )


class PpoLoss(_Loss):
    """PPO-clip (arXiv 1707.06347), token-level mean; clipped tokens get no gradient."""

    type: Literal["ppo"] = "ppo"
    eps_low: float = Field(0.2, ge=0, le=1, description="Lower clip of the ratio.")
    eps_high: float = Field(0.2, gt=0, description="Upper clip of the ratio.")


class GrpoLoss(_Loss):
    """GRPO (DeepSeekMath, arXiv 2402.03300): PPO-clip averaged per sequence, KL penalty k3 with
    beta 0.04."""

    type: Literal["grpo"] = "grpo"
    eps_low: float = Field(0.2, ge=0, le=1, description="Lower clip of the ratio.")
    eps_high: float = Field(0.2, gt=0, description="Upper clip of the ratio.")
    kl_coef: float = Field(0.04, ge=0, description="Weight beta of KL(pi_theta || pi_old).")


class DapoLoss(_Loss):
    """DAPO (arXiv 2503.14476): clip-higher (0.2 / 0.28), token-level mean, dynamic sampling and
    overlong reward shaping."""

    type: Literal["dapo"] = "dapo"
    eps_low: float = Field(0.2, ge=0, le=1, description="Lower clip of the ratio.")
    eps_high: float = Field(0.28, gt=0, description="Upper clip of the ratio (clip-higher).")
    dynamic_sampling: bool = Field(
        True, description="Leave rows whose advantage is 0 (no signal) out of the batch and its normaliser."
    )
    overlong_buffer: float = Field(
        0.2, ge=0, lt=1, description="Soft overlong penalty: a completion longer than (1 - buffer) x its max_tokens "
        "loses up to 1 reward linearly until max_tokens (DAPO's 4096 of 20480); 0 = off."
    )


class DrGrpoLoss(_Loss):
    """Dr. GRPO (arXiv 2503.20783): GRPO without the length bias, every token divided by the same
    constant instead of its sequence's length."""

    type: Literal["dr_grpo"] = "dr_grpo"
    eps_low: float = Field(0.2, ge=0, le=1, description="Lower clip of the ratio.")
    eps_high: float = Field(0.2, gt=0, description="Upper clip of the ratio.")
    norm_tokens: int = Field(512, ge=1, description="The constant L of 1/(G L): the generation budget in tokens.")


class GspoLoss(_Loss):
    """GSPO (Qwen, arXiv 2507.18071): one length-normalised ratio per sequence, clipped tightly."""

    type: Literal["gspo"] = "gspo"
    eps_low: float = Field(3e-4, ge=0, le=1, description="Lower clip of the sequence ratio.")
    eps_high: float = Field(4e-4, gt=0, description="Upper clip of the sequence ratio.")


LossSettings = Annotated[
    CispoLoss | PpoLoss | GrpoLoss | DapoLoss | DrGrpoLoss | GspoLoss, Field(discriminator="type")
]
"""The policy-gradient loss, a tagged union on ``type`` (trainer/losses.py); each loss has its
own defaults, from its paper. ``RTRL_TRAINER__LOSS__TYPE=ppo`` picks PPO with PPO's defaults."""
LOSS_TYPES = ("cispo", "ppo", "grpo", "dapo", "dr_grpo", "gspo")


# The trust region's default, from the loop on the tiny model (docs/algorithms.md, Stable updates):
# cycles measured 0.01-0.64 nats per token at their last step and spikes above 1; 0.25 kept one
# more cycle from a converged champion within 0.3 points (none: -3.0), 0.1 within 0.3 too at about
# the same speed, and with 0.25 the eval gate's alarms rejected the first challenger of the demo
# (punctuation-only answers 20 % vs 0 %), with 0.1 they passed it (docs/gate.md).
MAX_KL_DEFAULT = 0.1


class LoraSettings(_Section):
    """The LoRA adapter of ``trainer.adapter=lora`` cycles (PEFT; docs/lora.md)."""

    rank: int = Field(8, ge=1, le=256, description="Rank r of every adapter matrix; also the servers' --max-lora-rank.")
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


class TrainerSettings(_Section):
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
        0, ge=0, description="Use episodes of the champion and of the this-many versions that served users most "
        "recently before it (0 = on-policy; versions the gate rejected never served and do not count)."
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
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate (of full-weight cycles; adapters: trainer.lora.lr).")
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
        3, ge=1, description="Optimizer states kept on the worker's disk (the newest cycles'); each is about 2x the weights."
    )
    micro_batch: int = Field(32, ge=1, description="Sequences per forward pass.")
    ranks: int = Field(
        1,
        ge=1,
        le=64,
        description="DeepSpeed data-parallel ranks of a cycle: 1 trains inside the worker process; N > 1 launches N "
        "rank processes on the worker's host with torch.distributed.run (one per GPU; on CPU, one per core), each "
        "taking every N-th micro-batch; rank 0 saves the checkpoint, the worker registers it (trainer/ranks.py).",
    )
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage.")
    adapter: Literal["full", "lora"] = Field(
        "full",
        description="What a cycle trains and the fleet swaps: full = every weight, loaded with vLLM's "
        "reload_weights; lora = a LoRA adapter on vllm.model_dir (trainer.lora), loaded in place under "
        "vllm.served_model_name with vLLM's runtime adapter loading (docs/lora.md). Chosen once per "
        "registry: a registry's versions are all adapters or all full weights.",
    )
    lora: LoraSettings = Field(default_factory=LoraSettings, description="The adapter of adapter=lora cycles.")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="Training precision: auto = bf16 when DeepSpeed's accelerator is a GPU (DS_ACCELERATOR=cuda), "
        "fp32 on the CPU accelerator (the default).",
    )
    offload: Literal["none", "cpu"] = Field(
        "none",
        description="ZeRO offload to CPU memory: the optimizer state (stage >= 1) and, at stage 3, the parameters. "
        "Needs a GPU (DeepSpeed's CPU Adam).",
    )
    loss: LossSettings = Field(default_factory=CispoLoss, description="Policy-gradient loss (see LossSettings).")
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
    max_cycle_s: float = Field(
        6 * 3600.0,
        gt=0,
        description="The longest a cycle job (train, gate, swap) may run: Redis redelivers an unacknowledged "
        "job after this (Celery's visibility timeout), and the redelivered job takes the cycle over.",
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
        if self.adapter == "lora" and self.zero_stage == 3:
            raise ValueError("adapter=lora runs at zero_stage 0-2 (stage 3 would partition the frozen base "
                             "model too; a LoRA cycle trains a few MB)")
        return self

    @field_validator("loss", mode="before")
    @classmethod
    def _cispo_unless_named(cls, value: object) -> object:
        # RTRL_TRAINER__LOSS__EPS_HIGH=0.3 alone tunes the default loss.
        if isinstance(value, dict) and "type" not in value:
            return {**value, "type": "cispo"}
        return value


GateSuite = Literal["ope", "retention", "oracle", "judge"]


class OpeSettings(_Section):
    """The gate's off-policy estimate on held-out logged traffic (docs/gate.md, Off-policy evaluation)."""

    holdout_percent: int = Field(
        10, ge=0, le=50,
        description="Percent of episodes (by a hash of the episode id) kept for the gate and never trained on; "
        "0 turns the held-out slice, and so the suite, off.",
    )
    max_episodes: int = Field(512, ge=1, description="Newest held-out episodes the estimate uses.")
    min_ess: float = Field(
        32.0, gt=0,
        description="Below this effective sample size (of the challenger's or the champion's weights) the "
        "estimate is inconclusive and does not decide.",
    )
    clip: float = Field(10.0, gt=1, description="Importance weights are clipped at this value.")


class AlarmSettings(_Section):
    """Behaviour alarms on the challenger (docs/gate.md, Alarms): any alarm blocks promotion."""

    length_ratio: float = Field(
        2.0, gt=1, description="Challenger's mean completion length above this multiple of the champion's (+2 tokens)."
    )
    entropy_ratio: float = Field(
        0.2, ge=0, lt=1,
        description="Challenger's per-token entropy (estimated from its sampled tokens' logprobs) below this "
        "fraction of the champion's.",
    )
    repetition_rate: float = Field(
        0.2, gt=0, le=1, description="Share of repetitive completions up by more than this over the champion's."
    )
    truncation_rate: float = Field(
        0.1, gt=0, le=1,
        description="Share of completions cut off by max_tokens (no answer within the budget) up by more than this.",
    )
    kl_budget: float = Field(
        1.0, gt=0, description="Per-token KL(champion || challenger) on held-out logged traffic above this (nats)."
    )
    no_action_rate: float = Field(
        0.1, gt=0, le=1,
        description="Share of non-answers (no_action_pattern) in the challenger's completions, or its estimated "
        "share of episodes without feedback on held-out traffic, up by more than this over the champion's.",
    )
    no_action_pattern: str = Field(
        r"^[^\w]*$|\?\s*$",
        description="Regular expression (Python, searched) that marks a completion as a non-answer: by default "
        "nothing alphanumeric, or a question.",
    )


class OfflineSuiteSettings(_Section):
    """A prompt set with a verifiable scorer (docs/gate.md, Offline suites)."""

    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    path: Path = Field(..., description='JSONL: one {"prompt": ..., "answers": [...]} or {"prompt": ..., '
                       '"pattern": ...} object per line.')  # fmt: skip
    scorer: Literal["exact", "contains", "regex", "function"] = Field(
        "contains",
        description="exact: the stripped completion equals an answer; contains: an answer appears as a whole "
        "word; regex: the line's pattern matches; function: `function` decides.",
    )
    function: str | None = Field(
        None, description='"module:function" called as f(prompt, completion, line) -> float in [0, 1] (scorer=function).'
    )
    max_tokens: int = Field(32, ge=1, le=4096)
    stop: tuple[str, ...] = ("\n",)


DEFAULT_RUBRIC = (
    "You grade an assistant's answer to a user's request.\n"
    "Request: {prompt}\n"
    "Answer: {completion}\n"
    "Is the answer correct, helpful and complete? Reply with one digit from 1 (useless or wrong) to {scale} "
    "(excellent) and nothing else.\n"
    "Grade:"
)


class JudgeSettings(_Section):
    """An OpenAI-compatible model that grades completions against a rubric (evals/judge.py; docs/gate.md, Judge)."""

    url: str = Field(
        ..., min_length=1,
        description="Base URL of an OpenAI-compatible API, up to and including /v1 (http://judge:8000/v1); "
        "the judge is asked on <url>/chat/completions.",
    )
    model: str = Field(..., min_length=1, description="The judge's model name at that endpoint.")
    api_key: SecretStr | None = Field(None, description="Bearer key for the judge endpoint (never printed).")
    rubric: str = Field(
        DEFAULT_RUBRIC,
        description="The judge's instructions; {prompt}, {completion} and {scale} are replaced (nothing else is "
        "a placeholder). The judge answers with one digit from 1 to `scale`.",
    )
    scale: int = Field(5, ge=2, le=9, description="Scores run from 1 to this; normalised to [0, 1].")
    timeout_s: float = Field(30.0, gt=0, description="Per judgement, each try.")
    retries: int = Field(2, ge=0, le=10, description="Further tries after a timeout, a refused connection, 429 or 5xx.")
    concurrency: int = Field(4, ge=1, le=64, description="Judgements in flight at once.")
    max_failure_rate: float = Field(
        0.1, ge=0, lt=1,
        description="More failed judgements than this share (after retries) is an outage: see `outage`.",
    )
    outage: Literal["inconclusive", "block"] = Field(
        "inconclusive",
        description="When the judge is out: inconclusive (the suite does not decide; the others still do) or block "
        "(the gate fails).",
    )

    @field_validator("rubric")
    @classmethod
    def _placeholders(cls, value: str) -> str:
        missing = [p for p in ("{prompt}", "{completion}") if p not in value]
        if missing:
            raise ValueError(f"the rubric must contain {' and '.join(missing)}")
        return value


class LabelerSettings(_Section):
    """The feedback labeler: consume, store, join, settle, reward."""

    settle_window_s: float = Field(
        30.0, description="An episode with no terminal feedback settles this long after its last event."
    )
    poll_timeout_ms: int = Field(500, description="Kafka poll timeout.")
    max_poll_records: int = Field(500, description="Records per poll (one DB transaction).")
    reward_spec: str = Field("tab-v1", description="Name of the reward spec (schemas/rewards.py) or a path to a .json spec.")
    judge: JudgeSettings | None = Field(
        None,
        description="The endpoint that grades episodes under a reward spec with a judge term (feedback/judging.py); "
        "its rubric is the spec's. Needed by such a spec, unused otherwise.",
    )
    judge_batch: int = Field(64, ge=1, le=10_000, description="Episodes graded per judge pass of the labeler.")


class GateSettings(_Section):
    """The eval gate between @challenger and @champion (deployer/gate.py, docs/gate.md)."""

    tolerance: float = Field(
        0.05, ge=0,
        description="Non-inferiority margin: a suite passes when the lower confidence bound of challenger minus "
        "champion is above -tolerance (in the suite's units: mean reward, or share of correct answers).",
    )
    margins: dict[str, Annotated[float, Field(ge=0)]] = Field(
        default_factory=dict,
        description='Per-suite margins that replace `tolerance`, by suite name (e.g. {"retention": 0.1}).',
    )
    confidence: float = Field(0.95, gt=0.5, lt=1, description="One-sided confidence of each suite's lower bound.")
    bootstrap_resamples: int = Field(1000, ge=100, description="Bootstrap resamples per interval.")
    seed: int = Field(20240917, description="Sampling seed (the same for both models) and bootstrap seed.")
    suites: tuple[GateSuite, ...] = Field(
        ("ope", "retention"),
        description="ope: off-policy estimate on held-out logged traffic (no oracle); retention: the task's "
        "held-out questions scored by their known answers; oracle: the task's preference function (only where "
        "one exists: the demo's simulated users); judge: the task's held-out prompts graded by `judge`. Offline "
        "JSONL suites are added with `offline`.",
    )
    offline: tuple[OfflineSuiteSettings, ...] = Field((), description="Extra prompt sets with verifiable scorers.")
    eval_prompts: int = Field(48, ge=1, description="Held-out prompts of the task (retention, oracle) per model.")
    samples_per_prompt: int = Field(4, ge=1, description="Completions per prompt.")
    task: str = Field(
        "exclaim", description="Task (evals/tasks.py) whose held-out questions the retention and oracle suites use."
    )
    preference: str | None = Field(
        None, description='The oracle suite\'s preference, "module:function" (default: the task\'s own).'
    )
    ope: OpeSettings = OpeSettings()
    alarms: AlarmSettings = AlarmSettings()
    judge: JudgeSettings | None = Field(None, description='The judge suite\'s endpoint (needed when suites has "judge").')
    anchor: str = Field(
        "base", pattern=r"^(base|none|[1-9][0-9]*)$",
        description="A fixed version the challenger must also not fall below on `anchor_suites`: base (the first "
        "registered version), a version number, or none. Non-inferiority against the champion alone lets small "
        "losses add up over promotions; the anchor bounds their sum by `anchor_margin`.",
    )
    anchor_suites: tuple[str, ...] = Field(
        ("retention",), description="Prompt suites (by name) on which the challenger is also compared with the anchor."
    )
    anchor_margin: float = Field(0.05, ge=0, description="Non-inferiority margin against the anchor.")

    @model_validator(mode="after")
    def _judge_configured(self) -> GateSettings:
        if "judge" in self.suites and self.judge is None:
            raise ValueError('gate.suites has "judge" but gate.judge is not set (RTRL_GATE__JUDGE__URL and '
                             'RTRL_GATE__JUDGE__MODEL)')  # fmt: skip
        return self


class DeployerSettings(_Section):
    """The rolling hot-swap of the vLLM fleet."""

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
    drain_timeout_s: float = Field(
        30.0,
        gt=0,
        description="With more than one serving server: how long a server taken out of the gateways' rotation "
        "may take to finish the requests it has before it is paused anyway.",
    )


class AgentSettings(_Section):
    """The weights agent on each vLLM host (`rtrl agent`, deployer/agent.py; docs/scaling.md)."""

    host: str = Field("127.0.0.1", description="Bind address of `rtrl agent` (the deployer's hosts must reach it).")
    port: int = Field(18090, ge=1, le=65535, description="Bind port of `rtrl agent`.")
    cache_dir: Path = Field(
        Path(".rtrl/agent"), description="Where the agent keeps the versions it downloaded (visible to the vLLM "
        "servers of its host)."
    )
    keep_versions: int = Field(
        4, ge=2, description="Versions kept in cache_dir, the most recently asked for (a rollback needs the one before)."
    )
    token: SecretStr | None = Field(
        None,
        description="When set, the agent asks for `Authorization: Bearer <token>` and the deployer sends it (one "
        "secret shared by the deployer's processes and every agent).",
    )


class MetricsSettings(_Section):
    """Prometheus metrics, health and readiness of each process (telemetry/; docs/metrics.md).

    Each process serves ``/metrics``, ``/healthz`` and ``/readyz`` on its own port (0: none); the
    gateway serves them on its own port. Two replicas of a process on one host need two ports
    (``RTRL_METRICS__LABELER_PORT=...`` per replica)."""

    host: str = Field(
        "127.0.0.1",
        description="Bind address of every process's endpoint (0.0.0.0 for a Prometheus elsewhere; "
        "then set a token).",
    )
    token: SecretStr | None = Field(
        None,
        description="When set, /metrics asks for `Authorization: Bearer <token>` (health endpoints never do).",
    )
    supervisor_port: int = Field(
        19100, ge=0, le=65535, description="`rtrl run` / `rtrl demo` (the supervisor)."
    )
    labeler_port: int = Field(19101, ge=0, le=65535, description="`rtrl labeler`.")
    worker_port: int = Field(
        19102, ge=0, le=65535, description="`rtrl worker` (training cycles, gate, swaps)."
    )
    beat_port: int = Field(19103, ge=0, le=65535, description="`rtrl beat`.")
    reconciler_port: int = Field(19104, ge=0, le=65535, description="`rtrl deploy reconcile --forever`.")


class Settings(BaseSettings):
    """All of rtrl's configuration. See the module docstring for how to set it."""

    model_config = SettingsConfigDict(
        env_prefix="RTRL_",
        env_nested_delimiter="__",
        env_file=".env",
        env_parse_none_str="null",  # RTRL_TRAINER__MAX_KL=null: an optional setting turned off
        extra="ignore",
        frozen=True,
    )

    services: ServicesSettings = ServicesSettings()
    kafka: KafkaSettings = KafkaSettings()
    store: StoreSettings = StoreSettings()
    postgres: PostgresSettings = PostgresSettings()
    celery: CelerySettings = CelerySettings()
    mlflow: MlflowSettings = MlflowSettings()
    vllm: VllmSettings = VllmSettings()
    gateway: GatewaySettings = GatewaySettings()
    limits: LimitsSettings = LimitsSettings()
    labeler: LabelerSettings = LabelerSettings()
    trainer: TrainerSettings = TrainerSettings()
    gate: GateSettings = GateSettings()
    deployer: DeployerSettings = DeployerSettings()
    agent: AgentSettings = AgentSettings()
    metrics: MetricsSettings = MetricsSettings()

    @model_validator(mode="after")
    def _local_databases(self) -> Settings:
        # Unset databases follow services and postgres: the local PostgreSQL on its port, as its user.
        _default(self, "store", "url", local_postgres_url(self))
        _default(self, "mlflow", "backend_store_uri", local_postgres_url(self, self.postgres.mlflow_database))
        return self


def local_postgres_url(settings: Settings, database: str | None = None) -> str:
    """SQLAlchemy URL of `database` (default: postgres.database, the store's) on the local PostgreSQL
    that `rtrl services up` runs, as postgres.user (trusted on loopback: no password)."""
    s = settings.services
    return f"postgresql+psycopg://{settings.postgres.user}@{s.host}:{s.postgres_port}/{database or settings.postgres.database}"


def embedded_databases(settings: Settings) -> Settings:
    """`settings` with the store and MLflow's backend, where not set, as SQLite files in the run dir
    (``sqlite:///<services.run_dir>/rtrl.db`` and ``.../mlflow/mlflow.db``) instead of the local
    PostgreSQL's databases: the embedded deployment of ``rtrl demo``, which needs no PostgreSQL.
    What the operator set is left alone."""
    run_dir = settings.services.run_dir
    embedded = settings.model_copy()
    _default(embedded, "store", "url", f"sqlite:///{run_dir / 'rtrl.db'}")
    _default(embedded, "mlflow", "backend_store_uri", f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}")
    return embedded


def _default(settings: Settings, section: str, field: str, value: str) -> None:
    """Give `section.field` a default that depends on other sections, unless the operator set it.

    The field still counts as not set (the section's ``model_fields_set``), so that a later default
    (:func:`embedded_databases`) may replace it. Settings are frozen: this is the one place a
    section is replaced, while they are validated or on a copy no one holds yet.
    """
    current = getattr(settings, section)
    if field in current.model_fields_set:
        return
    values = {**dict(current), field: value}
    settings.__dict__[section] = type(current).model_construct(_fields_set=set(current.model_fields_set), **values)


def to_env(settings: Settings) -> dict[str, str]:
    """The ``RTRL_*`` environment that makes ``Settings()`` in a child process equal ``settings``.

    One JSON document per section (``RTRL_KAFKA={...}``), which pydantic-settings reads like the
    nested ``RTRL_KAFKA__...`` form; secrets are written in clear, as the child needs them. Used
    to hand a configuration to the processes rtrl starts (``services.launch.child_env``).
    """
    env = {}
    for name, value in settings.model_dump(mode="python").items():
        env[f"RTRL_{name.upper()}"] = json.dumps(value, default=_plain)
    return env


def _plain(value: object) -> object:
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot hand {type(value).__name__} to a child process")


class SettingsError(OperatorError):
    """The environment (or .env) holds a setting rtrl cannot use; the message names the variable."""


def load_settings() -> Settings:
    """``Settings()`` from the environment and .env, with a one-line error naming the variable.

    What every entry point calls once at start-up.
    """
    try:
        return Settings()
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            variable = "RTRL_" + "__".join(str(part).upper() for part in error["loc"])
            value = error.get("input")
            if error["type"] == "union_tag_invalid":  # a tagged union (trainer.loss): name its tag
                context = error.get("ctx", {})
                variable += "__" + str(context.get("discriminator", "type")).strip("'").upper()
                error = {**error, "msg": f"Input should be one of {context.get('expected_tags')}"}
                value = context.get("tag")
            # A whole section (a model validator's error) may hold a secret; a secret never shows.
            shown = "" if isinstance(value, dict) or "PASSWORD" in variable else f" (got {value!r:.80})"
            problems.append(f"{variable}: {error['msg']}{shown}")
        raise SettingsError("bad setting: " + "; ".join(problems) + " (fix the environment or .env)") from None
