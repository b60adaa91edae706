"""`feedback.labeler.freeze_heap`: what `rtrl labeler` does to its heap before its loop."""

from __future__ import annotations

import gc
import weakref

import pytest

from feedback.labeler import freeze_heap

pytestmark = pytest.mark.unit


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_freezing_the_heap_collects_its_garbage_first_and_leaves_the_rest_out_of_later_passes() -> None:
    garbage = _Node()
    garbage.other = _Node()
    garbage.other.other = garbage  # a reference cycle: only the collector frees it
    gone = weakref.ref(garbage)
    alive = _Node()
    del garbage
    try:
        freeze_heap()
        assert gone() is None  # collected before the freeze, not kept forever
        assert gc.get_freeze_count() > 0
        assert not any(obj is alive for obj in gc.get_objects())  # frozen: no collector pass visits it
    finally:
        gc.unfreeze()
    assert any(obj is alive for obj in gc.get_objects())
