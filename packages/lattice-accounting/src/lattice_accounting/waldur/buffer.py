"""The event buffer between the quorum and Waldur: memory first, then an on-disk WAL.

Why this module exists: Waldur being down must never block scheduling nor lose billing
(spec: Accounting via Waldur, "Failure Handling"). Events wait in a bounded in-memory
queue (``accounting.buffer_size``); when it is full, newer events go to an append-only
log on disk (``accounting.disk_buffer_path``); all of them are pushed in the order they
happened; an alert is raised past ``disk_buffer_max_events`` events on disk; only when
memory and disk are both full is an event dropped, counted by
``lattice_accounting_events_dropped_total``.

The queue is one sequence ordered by a sequence number: an in-memory head, then the
disk tail (``memory < disk`` always holds, so as soon as anything is on disk, new events
go to disk too, behind it). Consumers :meth:`EventBuffer.peek` from the head and
:meth:`EventBuffer.ack` what Waldur accepted.

On disk (one directory):

* segment files ``<first seq, 20 digits>.wal`` holding records, each
  ``length (u32) | crc32 (u32) | seq (u64) | payload`` (big-endian; the CRC covers the
  seq and the payload), written with one ``fsync`` per appended batch; a new segment
  starts past ``segment_bytes``;
* ``acked``: the highest acknowledged sequence number, replaced atomically (write, fsync,
  rename) at each acknowledgement; segments holding only acknowledged records are
  deleted.

Opening the directory after a crash replays what the segments hold past ``acked``. A
torn or corrupt record (bad length, short read, CRC mismatch) ends its segment: the
file is truncated there, a warning is logged and
``lattice_accounting_wal_corrupt_records_total`` counts it. On a clean :meth:`close`
the memory head is written to disk too (a segment named by its first, lower sequence
number, so it replays first); after a crash, what was only in memory is regenerated
from the quorum (the service's durable cursor never moves past events held only in
memory: :meth:`EventBuffer.durable_revision`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import zlib
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from lattice_accounting.waldur.events import AccountingEvent, decode_event, encode_event
from lattice_accounting.waldur.metrics import WaldurMetrics

__all__ = [
    "AppendResult",
    "DiskLog",
    "EventBuffer",
    "decode_records",
    "encode_record",
]

log = logging.getLogger("lattice.accounting.waldur.buffer")

HEADER = struct.Struct(">IIQ")
MAX_RECORD = 16 << 20  # no event is near this; a larger length is corruption
SEGMENT_SUFFIX = ".wal"
ACKED_FILE = "acked"
DEFAULT_SEGMENT_BYTES = 8 << 20


# --- the record format (pure) ---------------------------------------------------------


def _crc(seq: int, payload: bytes) -> int:
    return zlib.crc32(payload, zlib.crc32(seq.to_bytes(8, "big"))) & 0xFFFFFFFF


def encode_record(seq: int, payload: bytes) -> bytes:
    return HEADER.pack(len(payload), _crc(seq, payload), seq) + payload


def decode_records(data: bytes) -> tuple[list[tuple[int, bytes, int]], int, bool]:
    """``([(seq, payload, end offset)], good length, corrupt)``: the records ``data``
    holds up to the first torn or damaged one; ``good length`` is where that one
    starts (the whole length when ``corrupt`` is False)."""
    out: list[tuple[int, bytes, int]] = []
    pos, end = 0, len(data)
    while pos < end:
        if end - pos < HEADER.size:
            return out, pos, True
        length, crc, seq = HEADER.unpack_from(data, pos)
        stop = pos + HEADER.size + length
        if length > MAX_RECORD or stop > end:
            return out, pos, True
        payload = bytes(data[pos + HEADER.size : stop])
        if _crc(seq, payload) != crc:
            return out, pos, True
        out.append((seq, payload, stop))
        pos = stop
    return out, pos, False


# --- the disk log ---------------------------------------------------------------------


@dataclass
class _Segment:
    first_seq: int
    path: Path
    size: int
    count: int  # records in the file, acknowledged or not


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DiskLog:
    """The append-only segment log of :class:`EventBuffer` (see the module docstring).

    ``max_bytes`` is "disk full": an append that would pass it (or that the file system
    refuses) writes nothing more and says how many records it wrote."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_bytes: int,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        sync: bool = True,
        metrics: WaldurMetrics | None = None,
    ) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.sync = sync
        self.metrics = metrics
        self.acked = 0
        self.count = 0  # unacknowledged records on disk
        self.last_seq = 0  # highest sequence number ever written (or acknowledged)
        self.corrupt_records = 0
        self._segments: deque[_Segment] = deque()
        # the read position of the first unacknowledged record
        self._head_offset = 0
        self._open()

    # -- opening -------------------------------------------------------------------------

    def _open(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError, ValueError):
            self.acked = int((self.path / ACKED_FILE).read_text().strip() or 0)
        self.last_seq = self.acked
        for p in sorted(self.path.glob("*" + SEGMENT_SUFFIX)):
            try:
                first = int(p.name.removesuffix(SEGMENT_SUFFIX))
            except ValueError:
                continue
            data = p.read_bytes()
            records, good, corrupt = decode_records(data)
            if corrupt:
                self.corrupt_records += 1
                if self.metrics is not None:
                    self.metrics.wal_corrupt.inc()
                log.warning(
                    "accounting WAL segment %s: damaged record at byte %d of %d; "
                    "truncating it there (%d intact records kept)",
                    p,
                    good,
                    len(data),
                    len(records),
                )
                with open(p, "r+b") as f:
                    f.truncate(good)
                    f.flush()
                    os.fsync(f.fileno())
            live = [r for r in records if r[0] > self.acked]
            if records:
                self.last_seq = max(self.last_seq, records[-1][0])
            if not live:
                p.unlink()
                continue
            self._segments.append(_Segment(first, p, good, len(records)))
            self.count += len(live)
        if self._segments:
            # skip the acknowledged records at the front of the first segment
            seg = self._segments[0]
            records, _, _ = decode_records(seg.path.read_bytes())
            self._head_offset = 0
            for seq, _payload, end in records:
                if seq > self.acked:
                    break
                self._head_offset = end
        if self.sync:
            _fsync_dir(self.path)

    # -- state ---------------------------------------------------------------------------

    @property
    def bytes(self) -> int:
        return sum(s.size for s in self._segments)

    # -- writing -------------------------------------------------------------------------

    def append(self, records: Sequence[tuple[int, bytes]]) -> int:
        """Write ``(seq, payload)`` records (sequence numbers increasing, above every
        record on disk) with one fsync; return how many were written (fewer when the
        disk is full)."""
        written = 0
        used = self.bytes
        f = None
        seg: _Segment | None = self._segments[-1] if self._segments else None
        try:
            for seq, payload in records:
                rec = encode_record(seq, payload)
                if used + len(rec) > self.max_bytes:
                    break
                if seg is None or seg.size >= self.segment_bytes:
                    if f is not None:
                        self._finish(f)
                        f = None
                    seg = _Segment(seq, self.path / f"{seq:020d}{SEGMENT_SUFFIX}", 0, 0)
                    self._segments.append(seg)
                if f is None:
                    f = open(seg.path, "ab")  # noqa: SIM115 - closed in _finish
                try:
                    f.write(rec)
                    f.flush()
                except OSError as e:
                    # the file system is full (or failing): cut the torn record off
                    log.warning("accounting WAL: cannot write to %s: %s", seg.path, e.strerror)
                    with contextlib.suppress(OSError):
                        f.truncate(seg.size)
                    break
                seg.size += len(rec)
                seg.count += 1
                used += len(rec)
                written += 1
                self.count += 1
                self.last_seq = max(self.last_seq, seq)
        finally:
            if f is not None:
                self._finish(f)
            if self._segments and self._segments[-1].count == 0:
                empty = self._segments.pop()
                with contextlib.suppress(FileNotFoundError):
                    empty.path.unlink()
        return written

    def prepend(self, records: Sequence[tuple[int, bytes]]) -> int:
        """Write records older than everything on disk into their own segment (the
        memory head at a clean shutdown). Returns how many fit."""
        if not records:
            return 0
        if self._segments and records[-1][0] >= self._segments[0].first_seq:
            raise ValueError("prepended records must be older than the log")
        first = records[0][0]
        seg = _Segment(first, self.path / f"{first:020d}{SEGMENT_SUFFIX}", 0, 0)
        used = self.bytes
        data = bytearray()
        n = 0
        for seq, payload in records:
            rec = encode_record(seq, payload)
            if used + len(data) + len(rec) > self.max_bytes:
                break
            data += rec
            n += 1
        if n == 0:
            return 0
        with open(seg.path, "wb") as f:
            f.write(data)
            self._finish(f)
        seg.size, seg.count = len(data), n
        self._segments.appendleft(seg)
        self._head_offset = 0
        self.count += n
        return n

    def _finish(self, f: BinaryIO) -> None:
        f.flush()
        if self.sync:
            os.fsync(f.fileno())
        f.close()

    # -- reading and acknowledging -----------------------------------------------------

    def peek(self, n: int) -> list[tuple[int, bytes]]:
        """The first ``n`` unacknowledged records, oldest first."""
        out: list[tuple[int, bytes]] = []
        offset = self._head_offset
        for seg in self._segments:
            if len(out) >= n:
                break
            with open(seg.path, "rb") as f:
                f.seek(offset)
                data = f.read()
            records, _, _ = decode_records(data)
            for seq, payload, _end in records:
                if seq <= self.acked:
                    continue
                out.append((seq, payload))
                if len(out) >= n:
                    break
            offset = 0
        return out

    def ack(self, upto_seq: int) -> int:
        """Acknowledge every record with ``seq <= upto_seq``; return how many that was."""
        if upto_seq <= self.acked:
            return 0
        removed = 0
        done: list[_Segment] = []
        head = self._head_offset
        for seg in self._segments:
            with open(seg.path, "rb") as f:
                f.seek(head)
                records, _, _ = decode_records(f.read())
            pos, stopped = head, False
            for seq, _payload, end in records:
                if seq > upto_seq:
                    stopped = True
                    break
                if seq > self.acked:
                    removed += 1
                pos = head + end
            if stopped:
                head = pos
                break
            done.append(seg)
            head = 0
        # record the acknowledgement first: a crash before the unlinks below only
        # leaves files whose records are all acknowledged (removed at the next open)
        self.acked = upto_seq
        self.last_seq = max(self.last_seq, self.acked)
        self._write_acked()
        for seg in done:
            self._segments.popleft()
            with contextlib.suppress(FileNotFoundError):
                seg.path.unlink()
        self._head_offset = head
        self.count -= removed
        return removed

    def _write_acked(self) -> None:
        tmp = self.path / (ACKED_FILE + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(self.acked))
            f.flush()
            if self.sync:
                os.fsync(f.fileno())
        os.replace(tmp, self.path / ACKED_FILE)
        if self.sync:
            _fsync_dir(self.path)


# --- the buffer -----------------------------------------------------------------------


@dataclass(frozen=True)
class AppendResult:
    memory: int
    disk: int
    dropped: int
    #: per appended event, in order: "memory", "disk" or "dropped"
    placement: tuple[str, ...] = ()


class EventBuffer:
    """Bounded memory queue, overflow to :class:`DiskLog`, drop only when both are full."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        memory_max: int,
        disk_max_bytes: int,
        disk_alert_events: int,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        sync: bool = True,
        metrics: WaldurMetrics | None = None,
    ) -> None:
        if memory_max < 1:
            raise ValueError("memory_max must be at least 1")
        self.memory_max = memory_max
        self.disk_alert_events = disk_alert_events
        self.metrics = metrics
        self.disk = DiskLog(
            path, max_bytes=disk_max_bytes, segment_bytes=segment_bytes, sync=sync, metrics=metrics
        )
        self._mem: deque[tuple[int, AccountingEvent]] = deque()
        self._next_seq = self.disk.last_seq + 1
        self.dropped = 0
        self.closed = False
        self._update_metrics()

    # -- state ---------------------------------------------------------------------------

    @property
    def buffered(self) -> int:
        """Events in memory."""
        return len(self._mem)

    @property
    def wal_events(self) -> int:
        """Events waiting on disk."""
        return self.disk.count

    def __len__(self) -> int:
        return len(self._mem) + self.disk.count

    @property
    def disk_alert(self) -> bool:
        """More events on disk than ``disk_buffer_max_events`` (spec: raise an alert)."""
        return self.disk.count > self.disk_alert_events

    def durable_revision(self, latest: int) -> int:
        """How far a durable cursor over the quorum's revisions may advance once the
        events of every revision up to ``latest`` were appended: up to just before the
        oldest revision still held only in memory."""
        revs = [e.revision for _, e in self._mem if e.revision > 0]
        return min(latest, min(revs) - 1) if revs else latest

    # -- appending -----------------------------------------------------------------------

    def append(self, events: Iterable[AccountingEvent]) -> AppendResult:
        """Queue ``events`` in order. Never blocks on the network; one fsync for the part
        that goes to disk."""
        placement: list[str] = []
        to_disk: list[tuple[int, bytes]] = []
        for e in events:
            seq = self._next_seq
            self._next_seq += 1
            if not to_disk and self.disk.count == 0 and len(self._mem) < self.memory_max:
                self._mem.append((seq, e))
                placement.append("memory")
            else:
                to_disk.append((seq, encode_event(e)))
                placement.append("disk")
        if to_disk:
            written = self.disk.append(to_disk)
            lost = len(to_disk) - written
            if lost:
                # the disk tail must stay contiguous and in order: every event after the
                # first that did not fit is dropped too
                for i in range(len(placement) - 1, -1, -1):
                    if lost == 0:
                        break
                    if placement[i] == "disk":
                        placement[i] = "dropped"
                        lost -= 1
                self._drop(len(to_disk) - written)
        self._update_metrics()
        return AppendResult(
            memory=placement.count("memory"),
            disk=placement.count("disk"),
            dropped=placement.count("dropped"),
            placement=tuple(placement),
        )

    def _drop(self, n: int) -> None:
        self.dropped += n
        if self.metrics is not None:
            self.metrics.dropped.inc(n)
        log.error(
            "accounting buffer full (memory %d events, disk %d bytes): %d event(s) dropped; "
            "Hint: check Waldur with `lattice admin accounting status`, then regenerate "
            "them with `lattice admin accounting reconcile --since ... --until ...`",
            self.memory_max,
            self.disk.max_bytes,
            n,
        )

    # -- consuming -----------------------------------------------------------------------

    def peek(self, n: int) -> list[tuple[int, AccountingEvent]]:
        """The ``n`` oldest waiting events with their sequence numbers."""
        out = [item for _, item in zip(range(n), self._mem, strict=False)]
        if len(out) < n:
            out += [(seq, decode_event(raw)) for seq, raw in self.disk.peek(n - len(out))]
        return out

    def ack(self, upto_seq: int) -> int:
        """Forget every event with a sequence number up to ``upto_seq`` (Waldur has it)."""
        n = 0
        while self._mem and self._mem[0][0] <= upto_seq:
            self._mem.popleft()
            n += 1
        if self.disk.count and upto_seq > self.disk.acked:
            n += self.disk.ack(upto_seq)
        self._update_metrics()
        return n

    # -- closing -------------------------------------------------------------------------

    def close(self) -> None:
        """Write the memory head to disk (it replays first after the restart)."""
        if self.closed:
            return
        self.closed = True
        if self._mem:
            records = [(seq, encode_event(e)) for seq, e in self._mem]
            kept = self.disk.prepend(records)
            if kept < len(records):
                self._drop(len(records) - kept)
            self._mem.clear()
        self._update_metrics()

    def _update_metrics(self) -> None:
        m = self.metrics
        if m is None:
            return
        m.buffered.labels(where="memory").set(len(self._mem))
        m.buffered.labels(where="disk").set(self.disk.count)
        m.disk_alert.set(1 if self.disk_alert else 0)
