"""API keys and tenant names: the format the gateway accepts and the store keeps.

A key is ``rtrl_`` + 43 URL-safe characters (256 random bits). The store keeps only its sha256
(`hash_key`) and its first characters (`key_prefix`) to recognise it in lists; the key itself is
shown once, when ``rtrl keys create`` makes it. With 256 random bits a fast hash is enough: nobody
can search for a preimage. Tenant names double as the namespace of client-chosen episode ids
(``<tenant>:<episode id>``), so they cannot contain ``:``.
"""

from __future__ import annotations

import hashlib
import re
import secrets

from schemas.errors import OperatorError

KEY_PREFIX = "rtrl_"
TENANT_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class TenantNameError(OperatorError, ValueError):
    """A tenant name rtrl cannot use."""


def new_key() -> str:
    """A fresh API key."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    """What the store keeps of a key, and what the gateway looks a presented key up by."""
    return hashlib.sha256(key.encode()).hexdigest()


def key_prefix(key: str) -> str:
    """The first characters of a key, safe to show."""
    return key[: len(KEY_PREFIX) + 6]


def check_tenant(name: str) -> str:
    """`name` when it is a valid tenant name, else TenantNameError saying what is allowed."""
    if not TENANT_PATTERN.match(name):
        raise TenantNameError(
            f"tenant {name!r} is not a valid name: 1-64 letters, digits, '_', '.', '-', starting with a letter or digit"
        )
    return name
