"""Logging set-up shared by every rtrl process: one line per record, UTC timestamps, to stderr."""

from __future__ import annotations

import logging
import time


def setup_logging(level: str | None = None) -> None:
    """Configure the root logger once (level from the argument, else INFO)."""
    logging.Formatter.converter = time.gmtime
    logging.basicConfig(
        level=(level or "INFO").upper(),
        format="%(asctime)sZ %(levelname)s %(name)s [%(process)d] %(message)s",
    )
    # Third-party chatter that drowns the loop's own lines at INFO.
    for noisy in ("kafka", "httpx", "urllib3", "alembic.runtime.migration", "mlflow"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
