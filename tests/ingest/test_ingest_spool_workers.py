"""One spool per gateway worker (ingest/spool.py, `worker_spool_dir` / `adopt_spools`): what a run
with another worker count left is replayed by this one, every record once."""

from __future__ import annotations

from pathlib import Path

import pytest

from ingest.spool import OVERFLOW_FILE, Spool, SpoolRecord, adopt_spools, worker_spool_dir

pytestmark = pytest.mark.unit


def rec(i: int) -> SpoolRecord:
    return SpoolRecord(
        topic="t", key=f"k{i}", value=f'{{"n":{i}}}', schema="rtrl.interaction.v1", event_id=f"e{i}"
    )


def spool_of(directory: Path) -> Spool:
    return Spool(directory, max_bytes=1 << 20, segment_bytes=1)  # a segment per record


def leave(directory: Path, records: range) -> None:
    """What a gateway process killed with these records spooled leaves in `directory`."""
    spool = spool_of(directory)
    spool.append_many([rec(i) for i in records])
    spool.close()


def replay(directory: Path) -> list[int]:
    """Replay a spool as a worker's publisher does, oldest segment first; the records' numbers."""
    spool = spool_of(directory)
    out = []
    for path in spool.sealed_segments():
        segment = spool.read(path)
        out += [int(r.key[1:]) for r in segment.records]
        spool.remove(segment)
    return out


def test_worker_spools_are_the_spool_dir_for_one_and_subdirectories_for_several(tmp_path: Path) -> None:
    assert worker_spool_dir(tmp_path, 0, 1) == tmp_path
    assert worker_spool_dir(tmp_path, 3, 4) == tmp_path / "worker-3"


def test_three_workers_spools_go_to_two_workers_in_order_and_once(tmp_path: Path) -> None:
    for index, records in enumerate((range(0, 3), range(10, 12), range(20, 24))):
        leave(worker_spool_dir(tmp_path, index, 3), records)
    (tmp_path / "worker-2" / OVERFLOW_FILE).write_bytes(b'{"dead":"letter"}\n')
    assert adopt_spools(tmp_path, 2) == [tmp_path / "worker-2"]
    assert not (tmp_path / "worker-2").exists()
    # Orphans in order (the top-level spool, then worker-2) go round the workers: worker-2 to
    # worker-1, its segments after worker-1's own, in their order; its overflow lines with them.
    assert replay(tmp_path / "worker-0") == [0, 1, 2]
    assert replay(tmp_path / "worker-1") == [10, 11, 20, 21, 22, 23]
    assert (tmp_path / "worker-1" / OVERFLOW_FILE).read_bytes() == b'{"dead":"letter"}\n'


def test_one_process_after_several_and_several_after_one(tmp_path: Path) -> None:
    leave(tmp_path / "worker-0", range(0, 2))
    leave(tmp_path / "worker-1", range(10, 12))
    leave(tmp_path, range(30, 31))  # the one-process spool of a run before those
    assert adopt_spools(tmp_path, 1) == [tmp_path / "worker-0", tmp_path / "worker-1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"segment-{n:012d}.jsonl" for n in range(1, 6)]
    assert replay(tmp_path) == [30, 0, 1, 10, 11]
    leave(tmp_path, range(40, 42))
    assert adopt_spools(tmp_path, 2) == [tmp_path]  # the top-level spool goes to worker-0
    assert not list(tmp_path.glob("segment-*"))
    assert replay(tmp_path / "worker-0") == [40, 41]
    assert adopt_spools(tmp_path, 2) == []  # nothing left over: a second start moves nothing


def test_a_spool_dir_that_does_not_exist_yet_has_nothing_to_adopt(tmp_path: Path) -> None:
    assert adopt_spools(tmp_path / "missing", 4) == []
