"""Secrets a service makes for itself when the operator sets none: `kept_secret`.

Used for the gateway's request-id key (``<run_dir>/gateway.secret``, ingest/auth.py) and the labeler's
held-out key (``<run_dir>/labeler.holdout_secret``, feedback/holdout.py): made once, mode 0600, shared
by every process on the host that reads the same run dir. Processes on several hosts need the setting.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def kept_secret(configured: str | None, path: Path) -> bytes:
    """The configured secret, else the one kept in `path` (made once: 32 random bytes as hex, mode 0600)."""
    if configured:
        return configured.encode()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp-{secrets.token_hex(4)}")
        # never readable by others, not even briefly
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(32))
        try:
            os.link(tmp, path)  # atomic and never overwrites: a process starting at the same time wins once
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return path.read_text().strip().encode()
