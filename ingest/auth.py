"""Who is calling the gateway, how fast they may, and which requests and episodes are theirs.

- `KeyCache`: the active API keys (`store.Store.api_keys`), by the sha256 of the key, and the tenants
  with an adapter of their own (`store.Store.adapter_tenants`, docs/lora.md "An adapter per
  tenant"), reloaded from the store every ``gateway.keys_refresh_s`` by a background thread. When the store cannot be read
  the last snapshot stays in force (users keep being served; a revoked key is refused once the
  store answers again); until a first snapshot is loaded every call is answered 503.
- `RateLimiter`: a token bucket per key (``gateway.rate_limit_per_s`` / ``rate_limit_burst``, or
  the key's own rate); an empty bucket is a 429 with the seconds until the next token.
- `RequestIds`: request ids that carry their tenant's signature (HMAC-SHA256 with
  ``gateway.request_id_secret``), so any gateway replica can tell whether a request id given with
  feedback belongs to the caller's tenant without looking anything up.
- `namespaced`: episode ids live in their tenant's namespace (``<tenant>:<episode id>``), so no
  tenant can join or squat another's episode.

The tenant always comes from the key, never from a header or a body field.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from schemas.clock import Monotonic
from schemas.events import MAX_ID_CHARS
from schemas.keys import hash_key
from schemas.secrets import kept_secret
from store import ApiKeyRecord, Store

log = logging.getLogger(__name__)

OPEN_TENANT = "default"  # the tenant of every call in open mode


@dataclass(frozen=True)
class Caller:
    """The authenticated caller of one request."""

    key_id: int | None  # None in open mode
    role: str  # tenant | admin
    tenant: str | None  # None for admin keys
    rate_per_s: float | None


OPEN_CALLER = Caller(key_id=None, role="tenant", tenant=OPEN_TENANT, rate_per_s=None)


class KeyCache:
    """The active keys, reloaded from the store in the background (see the module docstring)."""

    def __init__(self, store: Store, refresh_s: float, monotonic: Monotonic = time.monotonic) -> None:
        self._store = store
        self._refresh_s = refresh_s
        self._monotonic = monotonic
        self._keys: dict[str, Caller] | None = None
        self._adapters: frozenset[str] = frozenset()
        self._loaded_at = -math.inf
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rtrl-gateway-keys", daemon=True)

    def start(self) -> None:
        self.refresh()
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def loaded(self) -> bool:
        return self._keys is not None

    @property
    def age_s(self) -> float:
        """Seconds since the snapshot in force was read (inf before the first)."""
        return self._monotonic() - self._loaded_at

    def refresh(self) -> bool:
        """Read the active keys and the adapter tenants now; False (and the old snapshot kept) when the
        store cannot be read."""
        try:
            records = self._store.api_keys()
            adapters = frozenset(self._store.adapter_tenants())
        except Exception as exc:  # the store unreachable or not migrated: keep serving the old snapshot
            log.warning(
                "could not reload API keys (%s); keeping the %s",
                exc,
                "last snapshot" if self.loaded else "gateway closed (503) until they load",
            )
            return False
        self._keys = {record.key_hash: _caller(record) for record in records}
        self._adapters = adapters
        self._loaded_at = self._monotonic()
        return True

    def lookup(self, key: str) -> Caller | None:
        """The caller a presented key belongs to; None for an unknown or revoked key."""
        return None if self._keys is None else self._keys.get(hash_key(key))

    def has_adapter(self, tenant: str) -> bool:
        """Whether `tenant`'s requests go to an adapter of its own (as of the snapshot in force)."""
        return tenant in self._adapters

    def _loop(self) -> None:
        while not self._stop.wait(self._refresh_s):
            self.refresh()


def _caller(record: ApiKeyRecord) -> Caller:
    return Caller(key_id=record.id, role=record.role, tenant=record.tenant, rate_per_s=record.rate_per_s)


class RateLimiter:
    """A token bucket per key: `rate_per_s` tokens a second, at most `burst` saved up."""

    def __init__(self, rate_per_s: float, burst: float, monotonic: Monotonic = time.monotonic) -> None:
        self._rate = rate_per_s
        self._burst = burst
        self._monotonic = monotonic
        self._buckets: dict[int | None, tuple[float, float]] = {}  # key id -> (tokens, at)
        self._lock = threading.Lock()

    def take(self, caller: Caller) -> float | None:
        """Spend one token of the caller's bucket: None when allowed, else seconds until one is due."""
        rate = caller.rate_per_s if caller.rate_per_s is not None else self._rate
        if rate <= 0:
            return None  # rate limiting off
        burst = max(self._burst, 1.0)
        now = self._monotonic()
        with self._lock:
            tokens, at = self._buckets.get(caller.key_id, (burst, now))
            tokens = min(burst, tokens + (now - at) * rate)
            if tokens >= 1.0:
                self._buckets[caller.key_id] = (tokens - 1.0, now)
                return None
            self._buckets[caller.key_id] = (tokens, now)
            return (1.0 - tokens) / rate


class EventRate:
    """Feedback events a second per tenant (``gateway.feedback_events_per_s``): a token bucket a body
    spends its event count from, so that one tenant's flood of events about one episode cannot bury
    the labeler (issue 37: 36,000 ``accepted`` events in 10 s left it 18,000 records behind)."""

    def __init__(self, rate_per_s: float, burst: float, monotonic: Monotonic = time.monotonic) -> None:
        self._rate = rate_per_s
        self._burst = burst
        self._monotonic = monotonic
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, at); tenants come from keys
        self._lock = threading.Lock()

    def take(self, tenant: str, events: int) -> float | None:
        """Spend `events` of the tenant's bucket: None when allowed, else seconds until they are due."""
        if self._rate <= 0:
            return None  # off
        cost = min(float(events), self._burst)  # a body of more than the burst waits for a full bucket
        now = self._monotonic()
        with self._lock:
            tokens, at = self._buckets.get(tenant, (self._burst, now))
            tokens = min(self._burst, tokens + (now - at) * self._rate)
            if tokens >= cost:
                self._buckets[tenant] = (tokens - cost, now)
                return None
            self._buckets[tenant] = (tokens, now)
            return (cost - tokens) / self._rate


class RequestIds:
    """Request ids signed for their tenant: ``<32 hex random>.<16 hex signature>``."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError("the request id secret must be at least 16 bytes")
        self._secret = secret

    def _signature(self, tenant: str, nonce: str) -> str:
        return hmac.new(self._secret, f"{tenant}\0{nonce}".encode(), hashlib.sha256).hexdigest()[:16]

    def new(self, tenant: str) -> str:
        nonce = secrets.token_hex(16)
        return f"{nonce}.{self._signature(tenant, nonce)}"

    def belongs_to(self, request_id: str, tenant: str) -> bool:
        nonce, _, signature = request_id.partition(".")
        return bool(nonce) and hmac.compare_digest(signature, self._signature(tenant, nonce))


def request_id_secret(configured: str | None, run_dir: Path) -> bytes:
    """The configured secret, else one kept in ``<run_dir>/gateway.secret`` (made once, mode 0600):
    gateways on one host share it; gateways on several hosts need the setting."""
    return kept_secret(configured, run_dir / "gateway.secret")


def namespaced(tenant: str, episode_id: str) -> str:
    """The stored episode id of a tenant's episode id. Raises ValueError when it would be too long."""
    full = f"{tenant}:{episode_id}"
    if len(full) > MAX_ID_CHARS:
        raise ValueError(
            f"episode_id is {len(episode_id)} characters; at most {MAX_ID_CHARS - len(tenant) - 1} for this tenant"
        )
    return full
