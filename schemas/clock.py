"""Time for every rtrl process: the one ``utcnow`` and the one ``wait_until``.

Code that decides by time takes a clock argument defaulting to these, so tests move time forward
instead of sleeping (``Clock`` for wall-clock datetimes, ``Monotonic`` for durations).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TypeVar

T = TypeVar("T")

Clock = Callable[[], datetime]
Monotonic = Callable[[], float]
Sleep = Callable[[float], None]


def utcnow() -> datetime:
    """Now, timezone-aware, in UTC."""
    return datetime.now(UTC)


def wait_until(
    condition: Callable[[], T | None],
    *,
    timeout_s: float,
    what: str,
    interval_s: float = 0.2,
    monotonic: Monotonic = time.monotonic,
    sleep: Sleep = time.sleep,
) -> T:
    """Call `condition` until it returns something truthy, and return that.

    Raises ``TimeoutError("<what> after <timeout_s>s")`` when `timeout_s` passes first. An
    exception raised by `condition` propagates: catch inside it what means "not yet".
    """
    deadline = monotonic() + timeout_s
    while True:
        result = condition()
        if result:
            return result
        if monotonic() >= deadline:
            raise TimeoutError(f"{what} after {timeout_s:g}s")
        sleep(interval_s)
