"""The trust boundary: tenants (whether their traffic trains, whether it trains an adapter of its
own) and the gateways' API keys.

`rtrl keys` and `rtrl tenants` (rtrl/commands/keys.py) write them; the gateway loads the active
keys (ingest/auth.py); the trainer's selection reads the tenants' switches (store/episodes.py); a tenant with ``adapter``
on is a line of its own (schemas/lines.py, docs/lora.md "An adapter per tenant").
A key itself is never stored, only its hash (schemas/keys.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select, update

from schemas.keys import check_tenant, hash_key, key_prefix, new_key
from store.base import StoreBase
from store.models import ApiKey, Tenant


@dataclass(frozen=True)
class ApiKeyRecord:
    """An API key as the store holds it (never the key itself)."""

    id: int
    key_hash: str
    prefix: str
    role: str  # tenant | admin
    tenant: str | None
    name: str
    rate_per_s: float | None
    created_at: datetime
    revoked_at: datetime | None


@dataclass(frozen=True)
class TenantRecord:
    tenant: str
    trains: bool
    train_redacted: bool
    created_at: datetime
    adapter: bool = False  # a LoRA adapter of its own (docs/lora.md, An adapter per tenant)


class TenantStore(StoreBase):
    """Tenants and API keys (see the module docstring)."""

    def set_tenant(
        self,
        tenant: str,
        *,
        trains: bool | None = None,
        train_redacted: bool | None = None,
        adapter: bool | None = None,
    ) -> TenantRecord:
        """Create the tenant if needed (training on, redacted segments off, no adapter) and apply the
        switches given. The cap on adapter tenants (``vllm.max_loras``) is the caller's to check
        (`rtrl tenants set --adapter`): the store does not read settings."""
        check_tenant(tenant)
        with self.transaction() as session:
            row = session.get(Tenant, tenant, with_for_update=True)
            if row is None:
                row = Tenant(tenant=tenant, trains=True, train_redacted=False, created_at=self.clock())
                session.add(row)
            if trains is not None:
                row.trains = trains
            if train_redacted is not None:
                row.train_redacted = train_redacted
            if adapter is not None:
                row.adapter = adapter
            session.flush()
            return _tenant_record(row)

    def tenants(self) -> list[TenantRecord]:
        with self.transaction() as session:
            return [_tenant_record(r) for r in session.scalars(select(Tenant).order_by(Tenant.tenant))]

    def adapter_tenants(self) -> list[str]:
        """The tenants with an adapter of their own, by name: the lines besides the global one
        (schemas/lines.py). Whether they train is a separate switch: a tenant switched off training
        keeps its adapter serving its champion."""
        with self.transaction() as session:
            return list(
                session.scalars(select(Tenant.tenant).where(Tenant.adapter.is_(True)).order_by(Tenant.tenant))
            )

    def create_api_key(
        self, *, role: str, tenant: str | None, name: str, rate_per_s: float | None = None
    ) -> tuple[ApiKeyRecord, str]:
        """A new key: (its record, the key itself, which is not stored and cannot be shown again).

        A tenant key creates its tenant (training on) when it does not exist yet.
        """
        if role not in ("tenant", "admin") or (role == "tenant") != (tenant is not None):
            raise ValueError(f"a {role} key needs {'a' if role == 'tenant' else 'no'} tenant")
        if tenant is not None:
            self.set_tenant(tenant)
        key = new_key()
        with self.transaction() as session:
            row = ApiKey(
                key_hash=hash_key(key),
                prefix=key_prefix(key),
                role=role,
                tenant=tenant,
                name=name[:200],
                rate_per_s=rate_per_s,
                created_at=self.clock(),
                revoked_at=None,
            )
            session.add(row)
            session.flush()
            return _key_record(row), key

    def api_keys(self, include_revoked: bool = False) -> list[ApiKeyRecord]:
        """Keys, oldest first; the gateway loads the active ones (`include_revoked=False`)."""
        with self.transaction() as session:
            query = select(ApiKey).order_by(ApiKey.id)
            if not include_revoked:
                query = query.where(ApiKey.revoked_at.is_(None))
            return [_key_record(r) for r in session.scalars(query)]

    def revoke_api_key(self, key_id: int) -> bool:
        """Revoke a key; False when there is no such active key. Gateways stop accepting it within
        ``gateway.keys_refresh_s``."""
        with self.transaction() as session:
            result = session.execute(
                update(ApiKey)
                .where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None))
                .values(revoked_at=self.clock())
            )
            return bool(result.rowcount)  # type: ignore[attr-defined]


def _tenant_record(row: Tenant) -> TenantRecord:
    return TenantRecord(row.tenant, row.trains, row.train_redacted, row.created_at, bool(row.adapter))


def _key_record(row: ApiKey) -> ApiKeyRecord:
    return ApiKeyRecord(
        id=row.id,
        key_hash=row.key_hash,
        prefix=row.prefix,
        role=row.role,
        tenant=row.tenant,
        name=row.name,
        rate_per_s=row.rate_per_s,
        created_at=row.created_at,
        revoked_at=row.revoked_at,
    )
