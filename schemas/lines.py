"""Lines: one trained-and-served LoRA adapter each (docs/lora.md, An adapter per tenant).

The *global line* is what rtrl trains without tenants' adapters: registry model
``mlflow.model_name``, served as ``vllm.served_model_name``, trained on the episodes of every tenant
without an adapter of its own. A tenant switched on with ``rtrl tenants set T --adapter`` has a line
of its own: registry model ``<mlflow.model_name>--T`` (its own versions and aliases), served as
``<vllm.served_model_name>--T`` on the same base, trained on T's episodes only.

`Line` is the one parameter object the code paths take: its `settings` are the configured settings
with the line's two names in place, so every component that reads those names (the registry, the
trainer's registration, the gate, the swap's adapter load, the promotion records) works on the line
unchanged, and its cycle files (running baselines, optimizer states) are its own; its `tenant` is
the filter of the episodes the line trains on (store/episodes.py
`on_line`). The names are `<name>--<tenant>`: for a fixed global name that is one-to-one in the
tenant, and never the global name nor the base model's (`<served name>-base`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from schemas.errors import OperatorError
from schemas.keys import check_tenant
from schemas.settings import Settings

# Between a global name and a tenant in a line's names.
LINE_SEPARATOR = "--"


def line_name(global_name: str, tenant: str) -> str:
    """A tenant line's registry model or served adapter name, from the global one."""
    return f"{global_name}{LINE_SEPARATOR}{check_tenant(tenant)}"


class LineCapacityError(OperatorError, ValueError):
    """More tenant adapters than the servers can hold, adapters on a full-weight fleet, or with the
    live canary or weights agents, which do not work per tenant yet."""


@dataclass(frozen=True)
class Line:
    """One adapter's line: its tenant (None: the global line) and the settings that name it."""

    tenant: str | None
    settings: Settings  # the configured settings with mlflow.model_name and vllm.served_model_name the line's

    @property
    def model_name(self) -> str:
        """The registry model its versions are registered under."""
        return self.settings.mlflow.model_name

    @property
    def served_name(self) -> str:
        """The adapter name the servers serve it under, and clients (via the gateway) reach it by."""
        return self.settings.vllm.served_model_name

    @property
    def label(self) -> str:
        """How logs and reports name it: ``global`` or ``tenant <name>``."""
        return "global" if self.tenant is None else f"tenant {self.tenant}"

    def checkpoints_dir(self) -> Path:
        """Where the registry keeps local copies of the line's versions (``vN`` folders): two lines'
        ``v2`` must not share a folder. The global line keeps today's ``<run_dir>/deploy``."""
        deploy = self.settings.services.run_dir / "deploy"
        return deploy if self.tenant is None else deploy / "lines" / self.model_name


def global_line(settings: Settings) -> Line:
    """The global line: the configured settings as they are."""
    return Line(None, settings)


def tenant_line(settings: Settings, tenant: str) -> Line:
    """`tenant`'s line; TenantNameError for a name that is not a tenant's."""
    mlflow = settings.mlflow.model_copy(update={"model_name": line_name(settings.mlflow.model_name, tenant)})
    vllm = settings.vllm.model_copy(
        update={"served_model_name": line_name(settings.vllm.served_model_name, tenant)}
    )
    # Its own cycle files: the running reward baselines are per prompt, and two tenants' users
    # reward the same prompt by different preferences (trainer/checkpoint.py, CycleFiles).
    trainer = settings.trainer.model_copy(
        update={"checkpoint_dir": settings.trainer.checkpoint_dir / "lines" / check_tenant(tenant)}
    )
    return Line(tenant, settings.model_copy(update={"mlflow": mlflow, "vllm": vllm, "trainer": trainer}))


def all_lines(settings: Settings, adapter_tenants: list[str]) -> list[Line]:
    """The global line, then one per tenant with an adapter (`store.Store.adapter_tenants`), by name."""
    return [global_line(settings), *(tenant_line(settings, t) for t in sorted(adapter_tenants))]


def check_adapter_capacity(settings: Settings, adapter_tenants: int) -> None:
    """Raise LineCapacityError when the servers cannot serve the global adapter and `adapter_tenants`
    tenants' side by side (``vllm.max_loras``: vLLM would swap adapters per batch instead), when
    the fleet is not a LoRA fleet, or when the live canary or weights agents are on (neither is
    built per tenant)."""
    if settings.trainer.adapter != "lora":
        raise LineCapacityError(
            "a tenant adapter needs trainer.adapter=lora (RTRL_TRAINER__ADAPTER=lora): with full weights "
            "there is one policy for every tenant (docs/lora.md, An adapter per tenant)"
        )
    if settings.gate.canary.enabled:
        raise LineCapacityError(
            "the live canary (gate.canary.enabled) does not run for a tenant's adapter yet: every "
            "cycle of its line would be rejected (docs/lora.md, An adapter per tenant)"
        )
    if settings.vllm.weights_agents:
        raise LineCapacityError(
            "weights agents (vllm.weights_agents) download the global line's versions only: a tenant's "
            "adapter needs servers that read the deployer's downloads (docs/lora.md, An adapter per tenant)"
        )
    needed = 1 + adapter_tenants
    if settings.vllm.max_loras < needed:
        raise LineCapacityError(
            f"{adapter_tenants} tenant adapters and the global one need vllm.max_loras >= {needed}, "
            f"but it is {settings.vllm.max_loras}: raise RTRL_VLLM__MAX_LORAS and restart the vLLM "
            "servers (docs/lora.md, An adapter per tenant)"
        )
