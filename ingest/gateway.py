"""What the routes of one gateway instance share, and who is calling them.

`ingest.app` builds one `Gateway` in the application's lifespan; every route handler
(`ingest.completions`, `ingest.feedback_route`, `ingest.served_models`, `ingest.operations`) is a
function of it and the request. `Gateway.authenticate` is the key check all API routes make;
`Gateway.admit` the per-tenant cap on completion requests and streams in flight (`ingest.slots`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import Response

from ingest.auth import OPEN_CALLER, Caller, EventRate, KeyCache, RateLimiter, RequestIds
from ingest.canary_traffic import CanaryCounts
from ingest.forwarding import RequestPolicy
from ingest.metrics import GatewayMetrics
from ingest.publisher import Publisher
from ingest.redaction import Redactor
from ingest.responses import error
from ingest.routing import Fleet
from ingest.slots import Slot, TenantSlots
from schemas.lines import line_name
from schemas.rewards import RewardSpec
from schemas.settings import Settings


class Gateway:
    """The state of one gateway instance that its route handlers use."""

    def __init__(
        self,
        settings: Settings,
        fleet: Fleet,
        publisher: Publisher,
        metrics: GatewayMetrics,
        keys: KeyCache | None,
        ids: RequestIds,
        spec: RewardSpec,
        redactor: Redactor,
        sampling_defaults: Mapping[str, Any],
        policy: RequestPolicy,
    ) -> None:
        self.settings = settings
        self.policy = policy  # what of a request reaches vLLM (ingest/forwarding.py)
        self.sampling_defaults = sampling_defaults  # written into requests (schemas/sampling.py)
        self.lora = (
            settings.trainer.adapter == "lora"
        )  # the adapter's name, no prompt logprobs (ingest/shaping.py)
        self.redactor = redactor
        self.fleet = fleet
        self.publisher = publisher
        self.metrics = metrics
        self.keys = keys  # None in open mode
        self.ids = ids
        self.spec = spec
        self.limiter = RateLimiter(settings.gateway.rate_limit_per_s, settings.gateway.rate_limit_burst)
        self.slots = TenantSlots(
            settings.gateway.max_concurrent_per_tenant, settings.gateway.max_inflight_tokens_per_tenant
        )
        self.feedback_rate = EventRate(
            settings.gateway.feedback_events_per_s, settings.gateway.feedback_events_burst
        )
        metrics.bind(metrics.tenant_in_flight, lambda: self.slots.in_flight)
        metrics.bind(metrics.tenants_at_cap, lambda: self.slots.tenants_at_cap)
        metrics.upstream_connections.set(settings.gateway.upstream_connections)
        self.started_at = int(time.time())  # the `created` of the served model (ingest/served_models.py)
        self.tasks: set[asyncio.Task[None]] = set()  # captures of streams, held until they finish
        # A live canary's requests per arm, flushed by the rotation refresh (ingest/canary_traffic.py).
        self.canary_traffic = CanaryCounts(on_count=metrics.count_canary)
        # Big feedback bodies are parsed in a thread, one at a time (ingest/feedback_route.py): a
        # flood of them puts one thread, not one per request, beside the event loop for the GIL.
        self.feedback_parsing = anyio.CapacityLimiter(1)

    def served_name(self, tenant: str) -> str:
        """The served model `tenant`'s requests go to: its own adapter when it has one (a LoRA fleet
        with keys: `rtrl tenants set T --adapter`, schemas/lines.py), else ``vllm.served_model_name``.
        In open mode every call is the one open tenant's, which has none."""
        served = self.settings.vllm.served_model_name
        if self.lora and self.keys is not None and self.keys.has_adapter(tenant):
            return line_name(served, tenant)
        return served

    def tenant_adapter(self, forward: Mapping[str, Any]) -> str | None:
        """The tenant's own adapter a forwarded request goes to (`served_name`), else None: its
        version is read from the server, not announced (ingest/routing.py)."""
        model = forward.get("model")
        return str(model) if self.lora and model != self.settings.vllm.served_model_name else None

    def authenticate(self, request: Request, role: str | None) -> Caller | Response:
        """The caller of `request` when its key is valid, of `role` (any when None) and within its
        rate; else the error response."""
        if self.keys is None:
            return OPEN_CALLER
        if not self.keys.loaded:
            self.metrics.auth.labels("keys_not_loaded").inc()
            return error(
                503,
                "the gateway has not loaded its API keys yet (is the store up?)",
                headers={"Retry-After": "5"},
            )
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            self.metrics.auth.labels("missing_key").inc()
            return error(
                401,
                "missing API key: send Authorization: Bearer <key> (`rtrl keys create`)",
                headers={"WWW-Authenticate": "Bearer"},
            )
        caller = self.keys.lookup(key.strip())
        if caller is None:
            self.metrics.auth.labels("invalid_key").inc()
            return error(401, "invalid or revoked API key", headers={"WWW-Authenticate": "Bearer"})
        if role is not None and caller.role != role:
            self.metrics.auth.labels("wrong_role").inc()
            return error(403, f"this route needs a {role} key; this is a {caller.role} key")
        wait_s = self.limiter.take(caller)
        if wait_s is not None:
            self.metrics.auth.labels("rate_limited").inc()
            return error(
                429,
                "rate limit of this API key reached",
                headers={"Retry-After": str(max(1, math.ceil(wait_s)))},
            )
        self.metrics.auth.labels("ok").inc()
        return caller

    def admit(self, tenant: str) -> Slot | Response:
        """A slot for one more completion request or stream of `tenant` (release it when the request
        ends), or the 429 that refuses it: the tenant has ``gateway.max_concurrent_per_tenant`` in
        flight at this gateway already."""
        slot = self.slots.take(tenant)
        if slot is not None:
            return slot
        self.metrics.shed.labels("tenant_cap").inc()
        return error(
            429,
            f"this tenant has {self.slots.cap} completion requests or streams in flight at this gateway, its "
            "cap (gateway.max_concurrent_per_tenant); retry when one has ended",
            headers={"Retry-After": "1"},
        )
