"""Log rotation (services/logs.py): copy-truncate under a live writer that holds the log as an O_APPEND
stdout, as the supervisor's children and the local services do; the supervisor rotating what
is in ``<run_dir>/logs/``; kafka-python's refused connections quiet while rtrl waits for its broker."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from schemas.clock import wait_until
from schemas.settings import ServicesSettings, Settings
from services.base import Service
from services.logs import backup, quiet_connection_retries, rotate
from services.supervisor import Supervisor

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
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(stop)], stdout=out, stderr=subprocess.STDOUT
        )
    try:
        rotations = 0
        while rotations < 5:
            wait_until(lambda: log.stat().st_size > 2000, timeout_s=60, what="the writer filling the log")
            before = log.read_bytes()  # written before the copy starts
            assert rotate(log, max_bytes=2000, backups=3)
            rotations += 1
            assert backup(log, 1).read_bytes().startswith(before)  # all of it is in the newest backup
        wait_until(
            lambda: log.stat().st_size > 0, timeout_s=60, what="the writer going on after the truncate"
        )
    finally:
        stop.touch()
        writer.wait(timeout=30)

    assert [p.name for p in sorted(tmp_path.glob("gateway.log.*"))] == [
        "gateway.log.1",
        "gateway.log.2",
        "gateway.log.3",
    ]
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


# ---- kafka-python's refused connections while rtrl waits for its own broker -------------------------

# What kafka-python 3.0.12 logged for one bootstrap attempt at a port nothing listened on (rtrl demo's
# start-up), logger name and message as written.
REFUSED_ATTEMPT = [
    (
        "kafka.net.connection",
        logging.ERROR,
        "<KafkaConnection node_id=bootstrap-0 broker_version=unknown "
        "(disconnected)>: Connection lost: KafkaConnectionError: 111 ECONNREFUSED",
    ),
    (
        "kafka.net.manager",
        logging.WARNING,
        "Bootstrap connection to bootstrap-0 failed: KafkaConnectionError: "
        "111 ECONNREFUSED (backoff 2.23 secs)",
    ),
    ("kafka.net.manager", logging.WARNING, "Bootstrap bootstrap-0 not ready; waiting 2.23 secs"),
    ("kafka.net.manager", logging.ERROR, "Connection failed: KafkaConnectionError: 111 ECONNREFUSED"),
    (
        "kafka.net.manager",
        logging.ERROR,
        "Bootstrap failed: KafkaTimeoutError: Unable to bootstrap from ['127.0.0.1:19092']",
    ),
]


def log_attempt() -> None:
    for name, level, message in REFUSED_ATTEMPT:
        logging.getLogger(name).log(level, message)


def kafka_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("kafka.")]


def test_refused_connections_are_dropped_only_while_the_wait_lasts(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with quiet_connection_retries("kafka"):
        log_attempt()
        logging.getLogger("kafka.net.connection").error(
            "SaslHandshake failed: IllegalSaslStateError"
        )  # not a refusal
        logging.getLogger("rtrl.labeler").error("upstream: ECONNREFUSED")  # not kafka-python's
        logging.getLogger("kafkaesque").error("ECONNREFUSED")  # another library that only starts alike
    assert kafka_lines(caplog) == ["SaslHandshake failed: IllegalSaslStateError"]
    assert [r.name for r in caplog.records] == ["kafka.net.connection", "rtrl.labeler", "kafkaesque"]
    caplog.clear()
    log_attempt()  # the broker is up now: a refusal is news again
    assert kafka_lines(caplog) == [message for _, _, message in REFUSED_ATTEMPT]
    assert all(not handler.filters for handler in logging.getLogger().handlers)


def test_where_no_handler_is_configured_the_last_resort_is_quiet_too(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`rtrl services up` configures no root handler: logging's last resort prints the records."""
    library = logging.getLogger("kafkatest")
    library.propagate = False  # no handler up the chain: what reaches it goes to logging.lastResort
    try:
        with quiet_connection_retries("kafkatest"):
            logging.getLogger("kafkatest.net").error(
                "Connection failed: KafkaConnectionError: 111 ECONNREFUSED"
            )
        assert capsys.readouterr().err == ""
        logging.getLogger("kafkatest.net").error("Connection failed: KafkaConnectionError: 111 ECONNREFUSED")
        assert capsys.readouterr().err == "Connection failed: KafkaConnectionError: 111 ECONNREFUSED\n"
    finally:
        library.propagate = True


class Starting(Service):
    """A service whose client logs like kafka-python: refused twice, then healthy."""

    name = "kafka"
    client_logger = "kafka"
    ports: tuple[int, ...] = ()
    address = "127.0.0.1:19092"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.checks = 0

    def command(self) -> list[str]:
        return []

    def pid(self) -> int | None:
        return 1

    def check(self) -> str:
        self.checks += 1
        if self.checks <= 2:
            log_attempt()
            raise RuntimeError("cannot reach Kafka at 127.0.0.1:19092")
        return "Kafka 4.1.0 KRaft"


def test_waiting_for_a_starting_broker_is_one_info_line(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    caplog.set_level(logging.INFO)
    unit = Starting(Settings(services=ServicesSettings(run_dir=tmp_path)))
    assert unit.wait_healthy(timeout_s=10) == "Kafka 4.1.0 KRaft"
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "waiting for kafka at 127.0.0.1:19092 to answer")
    ]
