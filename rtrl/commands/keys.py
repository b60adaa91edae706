"""`rtrl keys` and `rtrl tenants`: who may call the gateway, and whose traffic trains the model.

    rtrl keys create --tenant acme [--name ci] [--rate 50]   print a new key once (only its hash is kept)
    rtrl keys create --admin --name ops                      a key for /metrics (no tenant)
    rtrl keys list [--all]                                   id, prefix, role, tenant, name, rate, revoked
    rtrl keys revoke ID                                      gateways refuse it within gateway.keys_refresh_s
    rtrl tenants list
    rtrl tenants set acme --no-train | --train-redacted      the per-tenant training switches
    rtrl tenants set acme --adapter | --no-adapter           a LoRA adapter of its own (docs/lora.md)

Keys live in the SQL store (``settings.store.url``); the commands that write migrate it first.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from store import Store
    from store.tenants import TenantRecord

keys_app = typer.Typer(no_args_is_help=True, help="API keys of the gateway (stored hashed).")
tenants_app = typer.Typer(
    no_args_is_help=True,
    help="Tenants, whether their traffic trains, and whether it trains an adapter of its own.",
)


@contextmanager
def _store(migrate: bool) -> Iterator[Store]:
    """The store, migrated (commands that write) or checked (commands that read); closed after."""
    from schemas.settings import load_settings
    from store import Store

    with Store(load_settings().store.url) as store:
        if migrate:
            store.migrate()
        else:
            store.check_schema()
        yield store


@keys_app.command("create")
def create(
    tenant: str | None = typer.Option(None, help="Tenant the key calls as (created, training on, if new)."),
    admin: bool = typer.Option(False, "--admin", help="An admin key (/metrics) instead of a tenant key."),
    name: str = typer.Option("", help="What the key is for, shown by `rtrl keys list`."),
    rate: float | None = typer.Option(
        None, min=0, help="Requests a second for this key (default: the gateway's setting; 0 = unlimited)."
    ),
) -> None:
    """Create an API key and print it. It is shown only now: the store keeps its sha256."""
    if admin == (tenant is not None):
        raise typer.BadParameter("give either --tenant NAME or --admin", param_hint="--tenant/--admin")
    with _store(migrate=True) as store:
        record, key = store.create_api_key(
            role="admin" if admin else "tenant",
            tenant=tenant,
            name=name or (tenant or "admin"),
            rate_per_s=rate,
        )
    typer.echo(key)
    typer.echo(
        f"key {record.id} ({record.role}{'' if record.tenant is None else ', tenant ' + record.tenant}) "
        "created; it is shown only once, keep it secret",
        err=True,
    )


@keys_app.command("list")
def list_keys(include_revoked: bool = typer.Option(False, "--all", help="Include revoked keys.")) -> None:
    """The keys, as JSON lines (never the keys themselves)."""
    with _store(migrate=False) as store:
        for k in store.api_keys(include_revoked=include_revoked):
            typer.echo(
                json.dumps(
                    {
                        "id": k.id,
                        "prefix": k.prefix,
                        "role": k.role,
                        "tenant": k.tenant,
                        "name": k.name,
                        "rate_per_s": k.rate_per_s,
                        "created_at": k.created_at.isoformat(),
                        "revoked_at": None if k.revoked_at is None else k.revoked_at.isoformat(),
                    }
                )
            )


@keys_app.command("revoke")
def revoke(key_id: int = typer.Argument(..., help="Id from `rtrl keys list`.")) -> None:
    """Revoke a key; gateways refuse it once they reload their keys (gateway.keys_refresh_s)."""
    with _store(migrate=True) as store:
        if not store.revoke_api_key(key_id):
            raise typer.BadParameter(f"no active key {key_id} (see `rtrl keys list --all`)", param_hint="ID")
    typer.echo(f"key {key_id} revoked")


@tenants_app.command("list")
def list_tenants() -> None:
    """Tenants and their training switches, as JSON lines."""
    with _store(migrate=False) as store:
        for t in store.tenants():
            typer.echo(json.dumps(_tenant_json(t)))


@tenants_app.command("set")
def set_tenant(
    tenant: str = typer.Argument(..., help="Tenant name."),
    train: bool | None = typer.Option(
        None, "--train/--no-train", help="Whether its episodes train the model."
    ),
    train_redacted: bool | None = typer.Option(
        None,
        "--train-redacted/--no-train-redacted",
        help="Whether its segments with redacted text train (their token ids still carry the text).",
    ),
    adapter: bool | None = typer.Option(
        None,
        "--adapter/--no-adapter",
        help="Whether it has a LoRA adapter of its own on the shared base (trainer.adapter=lora; at most "
        "vllm.max_loras - 1 tenants): its episodes train only it, and its requests are served by it.",
    ),
) -> None:
    """Create a tenant or change its switches; a cycle honours them when it selects its batch."""
    from schemas.lines import check_adapter_capacity
    from schemas.settings import load_settings

    with _store(migrate=True) as store:
        if adapter:
            others = [t for t in store.adapter_tenants() if t != tenant]
            check_adapter_capacity(load_settings(), len(others) + 1)
        record = store.set_tenant(tenant, trains=train, train_redacted=train_redacted, adapter=adapter)
    typer.echo(json.dumps(_tenant_json(record)))


def _tenant_json(record: TenantRecord) -> dict[str, object]:
    return {
        "tenant": record.tenant,
        "trains": record.trains,
        "train_redacted": record.train_redacted,
        "adapter": record.adapter,
    }


def register(app: typer.Typer) -> None:
    """Add `rtrl keys` and `rtrl tenants` to the root app."""
    app.add_typer(keys_app, name="keys")
    app.add_typer(tenants_app, name="tenants")
