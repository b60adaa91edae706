"""The one wait-until: returns the first truthy value, times out with the reason, never oversleeps."""

from __future__ import annotations

import pytest
from factories import FakeMonotonic

from schemas.clock import utcnow, wait_until

pytestmark = pytest.mark.unit


def test_wait_until_returns_the_first_truthy_value() -> None:
    clock = FakeMonotonic()
    answers = iter([None, 0, "", "ready"])
    result = wait_until(
        lambda: next(answers), timeout_s=10, what="x", interval_s=0.5, monotonic=clock, sleep=clock.sleep
    )
    assert result == "ready" and clock.slept == [0.5, 0.5, 0.5]


def test_wait_until_times_out_with_what_it_waited_for() -> None:
    clock = FakeMonotonic()
    with pytest.raises(TimeoutError, match="gateway not healthy after 2s"):
        wait_until(
            lambda: False,
            timeout_s=2,
            what="gateway not healthy",
            interval_s=0.5,
            monotonic=clock,
            sleep=clock.sleep,
        )
    assert sum(clock.slept) == 2.0  # checked once more at the deadline, then gave up


def test_wait_until_lets_a_real_failure_through() -> None:
    def broken() -> bool:
        raise RuntimeError("the process exited")

    with pytest.raises(RuntimeError, match="exited"):
        wait_until(broken, timeout_s=10, what="x")


def test_utcnow_is_aware() -> None:
    assert utcnow().utcoffset() is not None and utcnow().utcoffset().total_seconds() == 0  # type: ignore[union-attr]
