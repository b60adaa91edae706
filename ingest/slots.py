"""How many completion requests and streams each tenant has in flight at this gateway, capped.

Every request and stream in flight holds a connection of the gateway's upstream pool
(``gateway.upstream_connections``) until it ends, and a stream lasts as long as its client keeps it
open. Without a cap, one tenant opening more streams than the pool has connections, and reading
none, left every other tenant waiting for a connection (issue 37). `TenantSlots` gives each tenant
at most ``gateway.max_concurrent_per_tenant`` at once; the settings keep that cap at most a
quarter of the pool (`schemas.settings.gateway.TENANTS_TO_FILL_THE_POOL`), so it takes several
tenants at their cap to fill it, and the pool's acquire timeout answers 503 then, not a hang.

Tokens are budgeted the same way: a request's ``max_tokens`` (times ``n``) is reserved on its slot
once its body is read (`Slot.reserve`), and a tenant's requests in flight may together ask for at
most ``gateway.max_inflight_tokens_per_tenant``: 64 streams asking for a whole context each cost a
CPU or GPU server ~100x what 64 one-line answers do, and every tenant's requests share its batch.

A `Slot` is taken when a completion request is authenticated (`ingest.completions.generate`) and
given back exactly once however the request ends: with its response (a whole body), or when its
stream's relay closes (`ingest.relay.Relay.close`: finished, failed, the client gone or too slow
to read). Everything runs on the gateway's event loop, so the counts need no lock.
"""

from __future__ import annotations


class Slot:
    """One request's place in its tenant's count; `release` it once done (again is a no-op)."""

    def __init__(self, slots: TenantSlots, tenant: str) -> None:
        self._slots = slots
        self.tenant = tenant
        self._held = True
        self.tokens = 0

    def reserve(self, tokens: int) -> bool:
        """Count the `tokens` this request may generate against its tenant's budget of tokens in flight
        (``gateway.max_inflight_tokens_per_tenant``); False, and nothing counted, when over it. A
        request alone is never refused by it: only one that would join others past the budget."""
        if not self._held or self.tokens:
            raise RuntimeError("reserve tokens once, on a slot that is held")
        if not self._slots.fits(self.tenant, tokens):
            return False
        self.tokens = tokens
        self._slots._tokens[self.tenant] = self._slots._tokens.get(self.tenant, 0) + tokens
        return True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._slots._give_back(self.tenant, self.tokens)


class TenantSlots:
    """Requests in flight per tenant, at most `cap` each (0: no cap), and the tokens they may generate,
    at most `max_tokens` each (0: no budget)."""

    def __init__(self, cap: int, max_tokens: int = 0) -> None:
        if cap < 0 or max_tokens < 0:
            raise ValueError(f"the caps per tenant must be >= 0, not {cap} requests, {max_tokens} tokens")
        self.cap = cap
        self.max_tokens = max_tokens
        self._held: dict[str, int] = {}  # only tenants with requests in flight
        self._tokens: dict[str, int] = {}  # only tenants with tokens reserved

    def fits(self, tenant: str, tokens: int) -> bool:
        """Whether `tokens` more fit in `tenant`'s budget (always, for a tenant with none reserved)."""
        held = self._tokens.get(tenant, 0)
        return not self.max_tokens or not held or held + tokens <= self.max_tokens

    def tokens(self, tenant: str) -> int:
        """Tokens `tenant`'s requests in flight may still generate, as reserved."""
        return self._tokens.get(tenant, 0)

    def take(self, tenant: str) -> Slot | None:
        """A slot for one more request of `tenant`; None when it has `cap` in flight already."""
        held = self._held.get(tenant, 0)
        if self.cap and held >= self.cap:
            return None
        self._held[tenant] = held + 1
        return Slot(self, tenant)

    def held(self, tenant: str) -> int:
        """Requests `tenant` has in flight now."""
        return self._held.get(tenant, 0)

    @property
    def in_flight(self) -> int:
        """Requests in flight, all tenants together."""
        return sum(self._held.values())

    @property
    def tenants_at_cap(self) -> int:
        """Tenants with `cap` requests in flight now (0 without a cap)."""
        return sum(1 for held in self._held.values() if held >= self.cap) if self.cap else 0

    def _give_back(self, tenant: str, tokens: int) -> None:
        if tokens:
            left = self._tokens[tenant] - tokens
            if left:
                self._tokens[tenant] = left
            else:
                del self._tokens[tenant]
        held = self._held[tenant] - 1
        if held:
            self._held[tenant] = held
        else:
            del self._held[tenant]  # the map holds only tenants in flight: it cannot grow without bound
