"""The gateway's on-disk spool (ingest/spool.py): writes, the bound, replay order, crash safety."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ingest.spool import OVERFLOW_FILE, Spool, SpoolRecord
from schemas.events import DeadLetterRecord

pytestmark = pytest.mark.unit


def rec(i: int) -> SpoolRecord:
    return SpoolRecord(
        topic="t", key=f"k{i}", value=f'{{"n":{i}}}', schema="rtrl.interaction.v1", event_id=f"e{i}"
    )


LINE = len(rec(0).to_line())  # every rec(i) with one-digit i serializes to the same length


def replay_all(spool: Spool) -> list[SpoolRecord]:
    out: list[SpoolRecord] = []
    for path in spool.sealed_segments():
        segment = spool.read(path)
        out.extend(segment.records)
        spool.remove(segment)
    return out


def overflow(directory: Path) -> list[DeadLetterRecord]:
    path = directory / OVERFLOW_FILE
    if not path.exists():
        return []
    return [DeadLetterRecord.model_validate_json(line) for line in path.read_text().splitlines()]


def test_record_round_trip() -> None:
    assert SpoolRecord.from_line(rec(3).to_line()) == rec(3)
    with pytest.raises(ValueError, match="not a spool record"):
        SpoolRecord.from_line(b'{"topic": "t"}')


def test_append_then_replay_in_order_across_segments(tmp_path: Path) -> None:
    # Two records per segment: 5 appends make segments 1, 2 and an open segment 3.
    spool = Spool(tmp_path, max_bytes=100 * LINE, segment_bytes=2 * LINE)
    for i in range(5):
        assert spool.append(rec(i)) == "spooled"
    assert spool.size_bytes == 5 * LINE
    names = [p.name for p in spool.sealed_segments()]
    assert names == ["segment-000000000001.jsonl", "segment-000000000002.jsonl", "segment-000000000003.jsonl"]
    assert [r.key for r in replay_all(spool)] == ["k0", "k1", "k2", "k3", "k4"]
    assert spool.size_bytes == 0 and spool.empty()
    # appends after a replay go to a fresh segment, never an old one
    spool.append(rec(5))
    assert [p.name for p in spool.sealed_segments()] == ["segment-000000000004.jsonl"]


def test_a_segment_is_kept_until_removed(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=100 * LINE)
    spool.append(rec(1))
    path = spool.sealed_segments()[0]
    spool.read(path)  # a replay that did not get every ack does not call remove()
    assert path.exists() and spool.size_bytes == LINE
    spool.append(rec(2))  # lands in a new segment, after the unreplayed one
    assert [r.key for r in replay_all(spool)] == ["k1", "k2"]


def test_bound_sends_new_records_to_overflow(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=2 * LINE + 1)
    assert spool.append(rec(1)) == "spooled"
    assert spool.append(rec(2)) == "spooled"
    assert spool.append(rec(3)) == "overflow"  # would make 3 * LINE > bound
    assert spool.size_bytes == 2 * LINE
    [dead] = overflow(tmp_path)
    assert dead.source == "gateway.spool" and dead.original_event_id == "e3"
    assert dead.reason.startswith(f"spool full: {2 * LINE} + {LINE} bytes > spool_max_bytes {2 * LINE + 1}")
    assert SpoolRecord.from_line(dead.payload.encode()) == rec(3)
    # once replayed, there is room again
    assert [r.key for r in replay_all(spool)] == ["k1", "k2"]
    assert spool.append(rec(4)) == "spooled"


def test_the_overflow_file_is_bounded_too(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=LINE, overflow_max_bytes=1)
    assert spool.overflow_bytes == 0
    assert spool.append(rec(1)) == "spooled"
    assert spool.append(rec(2)) == "dropped"  # the spool is full and no dead letter fits in 1 byte
    assert overflow(tmp_path) == [] and spool.overflow_bytes == 0
    assert spool.dead_letter(rec(3), "too large") is False
    roomy = Spool(tmp_path / "roomy", max_bytes=LINE, overflow_max_bytes=10 * LINE)
    assert roomy.append_many([rec(1), rec(2)]) == ["spooled", "overflow"]
    size = (tmp_path / "roomy" / OVERFLOW_FILE).stat().st_size
    assert roomy.overflow_bytes == size > LINE
    # a restarted gateway counts what its predecessor left against the bound
    again = Spool(tmp_path / "roomy", max_bytes=LINE, overflow_max_bytes=size + 1)
    assert again.overflow_bytes == size
    assert again.append_many([rec(3), rec(4)]) == ["dropped", "dropped"]  # its segment holds rec(1)


def test_a_batch_is_written_with_one_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    spool = Spool(tmp_path, max_bytes=100 * LINE, segment_bytes=100 * LINE)
    synced.clear()  # the directory's, at creation
    assert spool.append_many([rec(i) for i in range(5)]) == ["spooled"] * 5
    assert len(synced) == 2  # the new segment's directory entry, then the five records at once
    assert [r.key for r in replay_all(spool)] == ["k0", "k1", "k2", "k3", "k4"]


def test_restart_replays_what_a_previous_process_left(tmp_path: Path) -> None:
    first = Spool(tmp_path, max_bytes=100 * LINE, segment_bytes=2 * LINE)
    for i in range(3):
        first.append(rec(i))
    # no close(): the process died
    second = Spool(tmp_path, max_bytes=100 * LINE, segment_bytes=2 * LINE)
    assert second.size_bytes == 3 * LINE
    second.append(rec(9))
    assert [r.key for r in replay_all(second)] == ["k0", "k1", "k2", "k9"]


def test_half_written_line_is_dead_lettered_not_dropped(tmp_path: Path) -> None:
    first = Spool(tmp_path, max_bytes=100 * LINE)
    first.append(rec(1))
    first.append(rec(2))
    segment_path = first.sealed_segments()[0]
    torn = rec(3).to_line()[:20]
    with open(segment_path, "ab") as f:  # a crash in the middle of the third append
        f.write(torn)
    second = Spool(tmp_path, max_bytes=100 * LINE)
    second.append(rec(4))  # the restarted process writes to a new segment
    segment = second.read(segment_path)
    assert [r.key for r in segment.records] == ["k1", "k2"]
    [(raw, reason)] = segment.bad_lines
    assert raw == torn and "truncated last line (20 bytes, no newline" in reason
    assert overflow(tmp_path) == []  # dead-lettered only once the segment is replayed
    second.remove(segment)
    [dead] = overflow(tmp_path)
    assert dead.payload == torn.decode() and "truncated last line" in dead.reason
    assert [r.key for r in replay_all(second)] == ["k4"]
    assert second.size_bytes == 0


def test_garbage_line_in_the_middle_is_dead_lettered(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=100 * LINE)
    spool.append(rec(1))
    path = spool.sealed_segments()[0]
    with open(path, "ab") as f:
        f.write(b"not json\n" + rec(2).to_line())
    segment = spool.read(path)
    assert [r.key for r in segment.records] == ["k1", "k2"]
    assert len(segment.bad_lines) == 1 and "line 2: unreadable spool record" in segment.bad_lines[0][1]
    spool.remove(segment)
    assert json.loads(overflow(tmp_path)[0].model_dump_json())["payload"] == "not json"
