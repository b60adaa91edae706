"""Bounded on-disk spool for events the broker did not take.

When Kafka is down or slow the gateway still answers users; their events wait here and
`ingest.publisher` replays them, oldest first, once the broker is back. Layout of
``settings.gateway.spool_dir``:

- ``segment-<12-digit seq>.jsonl``: append-only segments, one `SpoolRecord` (topic, key, value,
  schema tag) per line. Only one segment is open for appends; the replayer seals it (the next
  append opens a new one) before sending it, and deletes a segment only after the broker
  acknowledged every record in it. A restarted gateway never appends to an old segment, so a line
  half-written by a crash stays the last line of its segment, where the replayer finds it.
- ``overflow.jsonl``: dead letters (`schemas.DeadLetterRecord` JSON, one per line) for records the
  spool refused because it was full (``spool_max_bytes``), for lines the replayer could not read
  (a crash mid-write) and for records Kafka will never take (over the message size limit). Nothing
  is dropped silently; the runbook (docs/runbooks/gateway.md) says how to requeue them. The
  overflow file is bounded too (``overflow_max_bytes``): past it a record is refused (`append`
  says ``dropped``, `dead_letter` returns False) and the publisher counts and logs it with the
  reason; a feedback request waiting for it is answered 503 (docs/security.md, Accepted means durable).

fsync policy: every append is written, flushed and fsynced before `append` returns
(`append_many`: one fsync for the batch, before it returns). Appends run only on the publisher's
background threads, never on the event loop (docs/security.md, Accepted means durable).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Literal

from schemas.events import DeadLetterRecord

SEGMENT_PREFIX = "segment-"
SEGMENT_SUFFIX = ".jsonl"
OVERFLOW_FILE = "overflow.jsonl"
MIN_SEGMENT_BYTES = 64 * 1024
MAX_SEGMENT_BYTES = 8 * 1024 * 1024

Appended = Literal["spooled", "overflow", "dropped"]  # in a segment / in overflow.jsonl / nowhere


@dataclass(frozen=True)
class SpoolRecord:
    """One Kafka record waiting to be produced: the exact topic, key, value and schema header."""

    topic: str
    key: str
    value: str
    schema: str
    event_id: str | None = None

    def to_line(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode() + b"\n"

    @classmethod
    def from_line(cls, line: bytes) -> SpoolRecord:
        """Parse one spool line; ValueError (with the reason) when it is not a whole record."""
        data = json.loads(line)
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"not a spool record: {exc}") from exc


@dataclass(frozen=True)
class Segment:
    """What the replayer read from one segment: the records, and lines it could not use."""

    path: Path
    records: list[SpoolRecord]
    bad_lines: list[tuple[bytes, str]]  # (raw line, reason)


class Spool:
    """Thread-safe bounded spool in `directory`. Past `max_bytes`, appends go to the overflow file;
    past `overflow_max_bytes` of that file, they are refused."""

    def __init__(
        self,
        directory: Path,
        max_bytes: int,
        segment_bytes: int | None = None,
        overflow_max_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.overflow_max_bytes = overflow_max_bytes
        self.segment_bytes = segment_bytes or min(MAX_SEGMENT_BYTES, max(MIN_SEGMENT_BYTES, max_bytes // 8))
        directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        existing = self._segment_paths()
        self._next_seq = (self._seq(existing[-1]) + 1) if existing else 1
        self._bytes = sum(p.stat().st_size for p in existing)
        overflow = self.overflow_path
        self._overflow_bytes = overflow.stat().st_size if overflow.exists() else 0
        self._active: IO[bytes] | None = None
        self._active_path: Path | None = None
        self._active_size = 0

    # -- layout --

    @staticmethod
    def _seq(path: Path) -> int:
        return int(path.name[len(SEGMENT_PREFIX) : -len(SEGMENT_SUFFIX)])

    def _segment_paths(self) -> list[Path]:
        paths = [
            p
            for p in self.directory.glob(f"{SEGMENT_PREFIX}*{SEGMENT_SUFFIX}")
            if p.name[len(SEGMENT_PREFIX) : -len(SEGMENT_SUFFIX)].isdigit()
        ]
        return sorted(paths, key=self._seq)

    @property
    def overflow_path(self) -> Path:
        return self.directory / OVERFLOW_FILE

    @property
    def size_bytes(self) -> int:
        """Bytes of records waiting in segments (what `max_bytes` bounds)."""
        with self._lock:
            return self._bytes

    @property
    def overflow_bytes(self) -> int:
        """Bytes of the overflow file (what `overflow_max_bytes` bounds)."""
        with self._lock:
            return self._overflow_bytes

    def empty(self) -> bool:
        with self._lock:
            return not self._segment_paths()

    # -- writing --

    def append(self, record: SpoolRecord) -> Appended:
        """Durably spool `record`: ``spooled``; ``overflow`` when the spool is full and it went to
        the overflow file; ``dropped`` when that is full too (written nowhere)."""
        return self.append_many([record])[0]

    def append_many(self, records: Sequence[SpoolRecord]) -> list[Appended]:
        """`append` for each record, with one fsync for the whole batch (a group commit): what the
        spool can take during an outage is not bounded by the disk's fsyncs per second."""
        outcomes: list[Appended] = []
        with self._lock:
            for record in records:
                line = record.to_line()
                if self._bytes + len(line) > self.max_bytes:
                    reason = (
                        f"spool full: {self._bytes} + {len(line)} bytes > spool_max_bytes {self.max_bytes}"
                    )
                    written = self._dead_letter_locked(line, reason, record.event_id)
                    outcomes.append("overflow" if written else "dropped")
                    continue
                if self._active is None or self._active_size + len(line) > self.segment_bytes:
                    self._sync_active_locked()
                    self._open_next_locked()
                assert self._active is not None
                self._active.write(line)
                self._active_size += len(line)
                self._bytes += len(line)
                outcomes.append("spooled")
            self._sync_active_locked()
        return outcomes

    def _sync_active_locked(self) -> None:
        if self._active is not None:
            self._active.flush()
            os.fsync(self._active.fileno())

    def _open_next_locked(self) -> None:
        self._close_active_locked()
        path = self.directory / f"{SEGMENT_PREFIX}{self._next_seq:012d}{SEGMENT_SUFFIX}"
        self._next_seq += 1
        self._active = open(path, "ab")  # kept open across appends; closed on seal
        self._active_path = path
        self._active_size = 0
        _fsync_dir(self.directory)

    def _close_active_locked(self) -> None:
        if self._active is not None:
            self._active.close()
        self._active = None
        self._active_path = None
        self._active_size = 0

    def _dead_letter_locked(self, payload: bytes, reason: str, event_id: str | None) -> bool:
        """Append a dead letter to the overflow file; False (nothing written) when that would take
        the file past `overflow_max_bytes`."""
        record = DeadLetterRecord(
            source="gateway.spool",
            original_event_id=event_id,
            reason=reason,
            payload=payload.decode("utf-8", errors="replace").rstrip("\n"),
        )
        line = record.model_dump_json().encode() + b"\n"
        if self._overflow_bytes + len(line) > self.overflow_max_bytes:
            return False
        with open(self.overflow_path, "ab") as out:
            out.write(line)
            out.flush()
            os.fsync(out.fileno())
        self._overflow_bytes += len(line)
        return True

    # -- replaying --

    def sealed_segments(self) -> list[Path]:
        """Every segment with records, oldest first; seals the open one so it can be replayed."""
        with self._lock:
            if self._active is not None and self._active_size > 0:
                self._close_active_locked()
            active = self._active_path
            return [p for p in self._segment_paths() if p != active]

    def read(self, path: Path) -> Segment:
        """Read a sealed segment. Unreadable lines (e.g. a crash mid-write) are returned with a reason."""
        records: list[SpoolRecord] = []
        bad: list[tuple[bytes, str]] = []
        data = path.read_bytes()
        lines = data.split(b"\n")
        tail = lines.pop()  # b"" when the file ends with a newline, as every complete append does
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                records.append(SpoolRecord.from_line(line))
            except ValueError as exc:
                bad.append((line, f"{path.name} line {number}: unreadable spool record: {exc}"))
        if tail:
            bad.append(
                (tail, f"{path.name}: truncated last line ({len(tail)} bytes, no newline; a crash mid-write)")
            )
        return Segment(path=path, records=records, bad_lines=bad)

    def dead_letter(self, record: SpoolRecord, reason: str) -> bool:
        """Write `record` to the overflow file with `reason`: Kafka will never take it as it is.
        False when the overflow file is full (nothing written)."""
        with self._lock:
            return self._dead_letter_locked(record.to_line(), reason, record.event_id)

    def remove(self, segment: Segment, undeliverable: Sequence[tuple[SpoolRecord, str]] = ()) -> int:
        """Delete a replayed segment, dead-lettering the lines that could not be read and the
        `undeliverable` records (with their reasons) that Kafka refused for good. Returns how many
        of those the full overflow file refused (the caller logs and counts them)."""
        dropped = 0
        with self._lock:
            for line, reason in segment.bad_lines:
                dropped += not self._dead_letter_locked(line, reason, None)
            for record, reason in undeliverable:
                dropped += not self._dead_letter_locked(record.to_line(), reason, record.event_id)
            size = segment.path.stat().st_size
            segment.path.unlink()
            _fsync_dir(self.directory)
            self._bytes = max(0, self._bytes - size)
        return dropped

    def close(self) -> None:
        with self._lock:
            self._close_active_locked()


def _fsync_dir(directory: Path) -> None:
    # Make a segment's creation or deletion itself durable, not just its contents.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- one spool per worker (gateway.workers > 1, ingest/prefork.py) --

WORKER_PREFIX = "worker-"


def worker_spool_dir(spool_dir: Path, index: int, workers: int) -> Path:
    """The spool of worker `index` of `workers`: ``spool_dir`` itself for one process (the layout
    before workers existed), ``spool_dir/worker-<index>`` for several. Each worker appends to and
    replays only its own, so no two processes ever write or delete the same segment."""
    return spool_dir if workers == 1 else spool_dir / f"{WORKER_PREFIX}{index}"


def adopt_spools(spool_dir: Path, workers: int) -> list[Path]:
    """Before the workers start (no process has a spool open): move every segment and overflow
    line that no worker of this run would replay into one that will, so nothing a previous run left
    is lost or stranded. Orphans are the top-level spool when there are several workers, and the
    ``worker-<i>`` spools with ``i >= workers`` (all of them for one process); orphan *n* of that
    list (the top-level spool first, then the others by name) goes to worker ``n % workers``: its segments are renamed, in order, after that spool's newest (a rename
    on one file system: a segment is in one place or the other, never both, never copied), and its
    overflow lines appended to that spool's overflow file. Returns the spools emptied."""
    if not spool_dir.is_dir():
        return []
    keep = {worker_spool_dir(spool_dir, i, workers) for i in range(workers)}
    orphans = [] if spool_dir in keep else [spool_dir]
    orphans += sorted(
        (p for p in spool_dir.glob(f"{WORKER_PREFIX}*") if p.is_dir() and p not in keep),
        key=lambda p: p.name,
    )
    adopted = []
    for n, orphan in enumerate(orphans):
        target = worker_spool_dir(spool_dir, n % workers, workers)
        if _move_spool(orphan, target):
            adopted.append(orphan)
        if orphan != spool_dir:
            orphan.rmdir()  # empty now; a stray file in it fails loudly here
    return adopted


def _move_spool(source: Path, target: Path) -> bool:
    """Move `source`'s segments after `target`'s and append its overflow file to `target`'s."""
    segments = Spool(source, max_bytes=1)._segment_paths()  # the layout's parser; opens nothing
    overflow = source / OVERFLOW_FILE
    if not segments and not overflow.exists():
        return False
    target.mkdir(parents=True, exist_ok=True)
    existing = Spool(target, max_bytes=1)._segment_paths()
    seq = (Spool._seq(existing[-1]) + 1) if existing else 1
    for path in segments:
        path.rename(target / f"{SEGMENT_PREFIX}{seq:012d}{SEGMENT_SUFFIX}")
        seq += 1
    if overflow.exists():
        with open(target / OVERFLOW_FILE, "ab") as out:
            out.write(overflow.read_bytes())
            out.flush()
            os.fsync(out.fileno())
        overflow.unlink()
    _fsync_dir(target)
    _fsync_dir(source)
    return True
