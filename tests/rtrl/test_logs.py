"""Log rotation (rtrl/logs.py): copy-truncate under a live writer that holds the log as an O_APPEND
stdout, as the supervisor's children and the local services do; and the supervisor rotating what
is in ``<run_dir>/logs/``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rtrl.logs import backup, rotate
from rtrl.supervisor import Supervisor
from schemas.clock import wait_until
from schemas.settings import ServicesSettings, Settings

pytestmark = pytest.mark.unit

# Prints 0, 1, 2, ... one line per write(), about one per millisecond, until the file `stop` exists.
WRITER = """
import os, sys, time
i = 0
while not os.path.exists(sys.argv[1]):
    sys.stdout.write(f"{i}\\n"); sys.stdout.flush(); i += 1
    time.sleep(0.001)
"""


def lines(path: Path) -> list[int]:
    data = path.read_bytes()
    assert b"\0" not in data  # O_APPEND: the writer went on at the new start, no hole in front
    return [int(line) for line in data.decode().splitlines()]


def test_rotation_under_a_live_writer_loses_nothing_written_before_the_copy(tmp_path: Path) -> None:
    log, stop = tmp_path / "gateway.log", tmp_path / "stop"
    with log.open("ab") as out:  # as Supervisor._spawn opens a child's log
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(stop)], stdout=out, stderr=subprocess.STDOUT)
    try:
        rotations = 0
        while rotations < 5:
            wait_until(lambda: log.stat().st_size > 2000, timeout_s=60, what="the writer filling the log")
            before = log.read_bytes()  # written before the copy starts
            assert rotate(log, max_bytes=2000, backups=3)
            rotations += 1
            assert backup(log, 1).read_bytes().startswith(before)  # all of it is in the newest backup
        wait_until(lambda: log.stat().st_size > 0, timeout_s=60, what="the writer going on after the truncate")
    finally:
        stop.touch()
        writer.wait(timeout=30)

    assert [p.name for p in sorted(tmp_path.glob("gateway.log.*"))] == ["gateway.log.1", "gateway.log.2", "gateway.log.3"]
    kept = [*lines(backup(log, 3)), *lines(backup(log, 2)), *lines(backup(log, 1)), *lines(log)]
    assert kept == sorted(kept) and len(set(kept)) == len(kept)  # oldest backup first, nothing twice
    # Only the lines written between a copy's last read and its truncate (microseconds) can be
    # missing: at one line a millisecond, at most one per rotation, and mostly none.
    missing = set(range(kept[0], kept[-1] + 1)) - set(kept)
    assert len(missing) <= rotations, missing
    assert lines(log)[0] > lines(backup(log, 1))[-1]  # the writer went on into the truncated file


def test_rotation_limits_backups_and_off_switch(tmp_path: Path) -> None:
    log = tmp_path / "labeler.log"
    log.write_bytes(b"x" * 10)
    assert not rotate(log, max_bytes=10, backups=2)  # not over the limit
    assert not rotate(log, max_bytes=0, backups=2)  # rotation off
    assert not rotate(tmp_path / "absent.log", max_bytes=1, backups=2)
    for n in range(1, 6):
        log.write_bytes(f"{n}\n".encode() * 20)
        assert rotate(log, max_bytes=10, backups=2)
        assert log.stat().st_size == 0
    assert backup(log, 1).read_bytes() == b"5\n" * 20 and backup(log, 2).read_bytes() == b"4\n" * 20
    assert not backup(log, 3).exists() and not (tmp_path / "labeler.log.partial").exists()

    backup(log, 7).write_bytes(b"left by a larger setting")
    log.write_bytes(b"y" * 20)
    assert rotate(log, max_bytes=10, backups=0)  # no backups: truncated only, stale ones removed
    assert log.stat().st_size == 0 and not list(tmp_path.glob("labeler.log.*"))


def test_the_supervisor_rotates_every_log_of_its_run_dir(tmp_path: Path) -> None:
    settings = Settings(services=ServicesSettings(run_dir=tmp_path / "run", log_max_bytes=100, log_backups=1))
    supervisor = Supervisor(settings, names=())  # starts nothing
    logs = tmp_path / "run" / "logs"
    (logs / "labeler.log").write_bytes(b"a" * 101)  # a child's
    (logs / "kafka.log").write_bytes(b"b" * 101)  # a local service's (rtrl services up)
    (logs / "redis.log").write_bytes(b"c" * 100)  # not over the limit
    assert supervisor.rotate_logs() == [logs / "kafka.log", logs / "labeler.log"]
    assert (logs / "kafka.log.1").read_bytes() == b"b" * 101 and (logs / "kafka.log").stat().st_size == 0
    assert not (logs / "redis.log.1").exists()
    assert supervisor.rotate_logs() == []
