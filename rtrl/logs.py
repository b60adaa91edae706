"""Logging set-up shared by every rtrl process: one line per record, UTC timestamps, to stderr."""

from __future__ import annotations

import logging
import os
import time


def setup_logging(level: str | None = None) -> None:
    """Configure the root logger once (level from the argument, else INFO)."""
    logging.Formatter.converter = time.gmtime
    logging.basicConfig(
        level=(level or "INFO").upper(),
        format="%(asctime)sZ %(levelname)s %(name)s [%(process)d] %(message)s",
    )
    # Third-party chatter that drowns the loop's own lines at INFO.
    for noisy in ("kafka", "httpx", "httpx2", "openai", "urllib3", "alembic", "mlflow", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # Progress bars of artifact downloads and checkpoint loads are noise in a daemon's log.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
