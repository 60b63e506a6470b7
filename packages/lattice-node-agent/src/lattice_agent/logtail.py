"""Log tailing: per-allocation output files followed into an in-memory ring buffer.

The workload writes straight into ``stdout.log``/``stderr.log`` (see ``spawn.py``), so its
output survives the agent. The agent only *tails* those files into a bounded ring buffer that
serves ``tail`` and ``follow``; a restarted agent resumes near the end of the files, and lines
the buffer no longer holds (or never held: a forgotten allocation) are read back from the
files themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec

log = logging.getLogger("lattice.agent.runtime")

__all__ = [
    "RECOVER_TAIL_BYTES",
    "STREAMS",
    "LogRecord",
    "LogTail",
    "check_stream",
    "decode_line",
    "read_last_lines",
    "split_lines",
    "tail_files",
]

STREAMS = ("stdout", "stderr")

TAIL_INTERVAL = 0.1  # seconds between reads of the log files
_READ_CHUNK = 1 << 20  # bytes per stream per read
_MAX_LINE = 64 * 1024  # a longer line without a newline is cut into pieces
RECOVER_TAIL_BYTES = 4 << 20  # how much of an existing log a new agent loads into the ring


class LogRecord(msgspec.Struct, kw_only=True, frozen=True):
    """One line of workload output (without its newline)."""

    allocation_id: str
    stream: str  # "stdout" | "stderr"
    line: str
    timestamp: float


def decode_line(raw: bytes) -> str:
    """One line's text: a trailing CR dropped, invalid UTF-8 replaced."""
    return raw.rstrip(b"\r").decode("utf-8", "replace")


def split_lines(
    data: bytes, *, final: bool = False, max_line: int | None = None
) -> tuple[list[bytes], list[int], bytes]:
    """The lines of ``data`` (which starts at a line start) without their newlines, the
    end of each in ``data`` (after its newline) and the unterminated rest.

    A line longer than ``max_line`` bytes is cut into pieces of ``max_line`` bytes
    counted from its start, so the same bytes always give the same lines however they
    were read (the ring buffer and the log shipper see identical lines). With ``final``
    the rest is a line too."""
    limit = _MAX_LINE if max_line is None else max_line
    lines: list[bytes] = []
    ends: list[int] = []
    parts = data.split(b"\n")
    last = len(parts) - 1
    pos = 0  # where the current part starts in data
    rest = b""
    for i, part in enumerate(parts):
        cut = 0
        while len(part) - cut > limit:
            lines.append(part[cut : cut + limit])
            cut += limit
            ends.append(pos + cut)
        if i == last:  # no newline after it
            rest = part[cut:]
            if final and rest:
                lines.append(rest)
                ends.append(len(data))
                rest = b""
            break
        lines.append(part[cut:])
        pos += len(part) + 1
        ends.append(pos)
    return lines, ends, rest


def check_stream(stream: str) -> None:
    if stream not in ("both", *STREAMS):
        raise ValueError(f"stream must be stdout, stderr or both, not {stream!r}")


def read_last_lines(path: Path, n: int | None, max_bytes: int = RECOVER_TAIL_BYTES) -> list[str]:
    """The last ``n`` lines (all if None) among the last ``max_bytes`` of a file."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            start = max(0, size - max_bytes)
            f.seek(start)
            data = f.read()
    except OSError:
        return []
    lines = data.split(b"\n")
    if start > 0:
        lines = lines[1:]  # first one is probably cut
    if lines and lines[-1] == b"":
        lines.pop()
    if n is not None:
        lines = lines[-n:] if n > 0 else []
    return [decode_line(ln) for ln in lines]


def tail_files(
    alloc_id: str, paths: dict[str, Path], n: int | None, stream: str
) -> list[LogRecord]:
    """The last ``n`` lines of ``stream`` read from the files (timestamp: the file's mtime)."""
    out: list[LogRecord] = []
    for s in STREAMS:
        if stream not in ("both", s):
            continue
        try:
            ts = paths[s].stat().st_mtime
        except OSError:
            continue
        for line in read_last_lines(paths[s], n):
            out.append(LogRecord(allocation_id=alloc_id, stream=s, line=line, timestamp=ts))
    return out[-n:] if n is not None else out


class LogTail:
    """One allocation's ring buffer and the state of tailing its two files."""

    def __init__(
        self,
        alloc_id: str,
        paths: dict[str, Path],
        *,
        ring_lines: int,
        clock: Callable[[], float],
        offsets: dict[str, int] | None = None,
        resume: bool = False,
    ) -> None:
        """A new allocation tails from the ``offsets`` taken at spawn (a recovered one
        whose output is shipped to the log store: from where the shipper got to); a
        recovered one (``resume``) starts near the end of the existing files (the last
        ``RECOVER_TAIL_BYTES``), skipping the first, probably cut, line."""
        self.alloc_id = alloc_id
        self.paths = paths
        self._clock = clock
        self.buf: deque[LogRecord] = deque(maxlen=ring_lines)
        self.total = 0  # lines ever appended to buf
        self.offsets: dict[str, int] = dict(offsets or {})
        # per stream: the file offset just after the last line appended to buf
        self.line_end: dict[str, int] = {}
        # the log shipper's hooks: every appended batch of lines (stream, the file offset
        # after it, its timestamp) and a file read again from its start (truncated)
        self.on_batch: Callable[[str, int, float], None] | None = None
        self.on_reset: Callable[[str], None] | None = None
        self.partial: dict[str, bytes] = {}
        self.skip_first: dict[str, bool] = {}
        self.files: dict[str, Any] = {}
        self.event = asyncio.Event()
        self.drained = False  # no more lines will come
        for s in STREAMS:
            self.partial[s] = b""
            if resume:
                try:
                    size = paths[s].stat().st_size
                except OSError:
                    size = 0
                self.offsets[s] = max(0, size - RECOVER_TAIL_BYTES)
                self.skip_first[s] = self.offsets[s] > 0
            self.offsets.setdefault(s, 0)
            self.line_end[s] = self.offsets[s]

    async def run(self, done: asyncio.Event) -> None:
        """Tail until ``done`` is set, then drain what is left."""
        try:
            while not self.drained:
                exited = done.is_set()
                if self.read():
                    await asyncio.sleep(0)  # more is waiting; let others run
                    continue
                if exited:
                    self.drain()
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), TAIL_INTERVAL)
        finally:
            self.close_files()

    def drain(self) -> None:
        """Read everything left (an unterminated last line included) and end the tail."""
        while self.read():
            pass
        for s in STREAMS:
            rest = self.partial.get(s, b"")
            self.partial[s] = b""
            if rest:
                self.line_end[s] = self.offsets[s]
                self._append(s, [rest])
        self.close_files()
        self.mark_drained()

    def read(self) -> bool:
        """Read new bytes of both files into the ring buffer. True if a read hit the chunk size."""
        more = False
        for s in STREAMS:
            f = self.files.get(s)
            if f is None:
                try:
                    f = open(self.paths[s], "rb")  # noqa: SIM115 - kept open across reads
                except OSError:
                    continue
                self.files[s] = f
            try:
                if os.fstat(f.fileno()).st_size < self.offsets[s]:  # truncated under us
                    self.offsets[s] = 0
                    self.line_end[s] = 0
                    self.partial[s] = b""
                    if self.on_reset is not None:
                        self.on_reset(s)
                f.seek(self.offsets[s])
                data = f.read(_READ_CHUNK)
            except OSError as e:
                log.warning("reading %s of %s: %s", s, self.alloc_id, e)
                continue
            if not data:
                continue
            self.offsets[s] += len(data)
            more = more or len(data) == _READ_CHUNK
            chunk = self.partial[s] + data
            if self.skip_first.get(s):  # resumed mid-file: the first line is probably cut
                nl = chunk.find(b"\n")
                if nl < 0:
                    self.partial[s] = b""
                    self.line_end[s] = self.offsets[s]
                    continue
                chunk = chunk[nl + 1 :]
                self.skip_first[s] = False
            lines, _, rest = split_lines(chunk)
            self.partial[s] = rest
            self.line_end[s] = self.offsets[s] - len(rest)
            if lines:
                self._append(s, lines)
        return more

    def _append(self, stream: str, lines: list[bytes]) -> None:
        now = self._clock()
        for raw in lines:
            self.buf.append(
                LogRecord(
                    allocation_id=self.alloc_id,
                    stream=stream,
                    line=decode_line(raw),
                    timestamp=now,
                )
            )
        self.total += len(lines)
        if self.on_batch is not None:
            self.on_batch(stream, self.line_end[stream], now)
        self.notify()

    def notify(self) -> None:
        """Wake every follower."""
        ev = self.event
        self.event = asyncio.Event()
        ev.set()

    def mark_drained(self) -> None:
        self.drained = True
        self.notify()

    def close_files(self) -> None:
        for f in self.files.values():
            with contextlib.suppress(OSError):
                f.close()
        self.files.clear()

    def buffered(self, n: int | None, stream: str) -> list[LogRecord]:
        """The last ``n`` buffered lines of ``stream`` (all if None), reading news first."""
        if not self.drained:
            self.read()
        out = [r for r in self.buf if stream in ("both", r.stream)]
        return out[-n:] if n is not None else out

    async def follow(self, stream: str, n: int | None) -> AsyncIterator[LogRecord]:
        """The buffered lines (the last ``n`` if given), then new ones until drained.

        A follower slower than the ring buffer skips the lines that were overwritten.
        """
        if not self.drained:
            self.read()
        initial = [r for r in self.buf if stream in ("both", r.stream)]
        if n is not None:
            initial = initial[-n:] if n > 0 else []
        pos = self.total
        for r in initial:
            yield r
        while True:
            if pos >= self.total:
                if self.drained:
                    return
                await self.event.wait()
                continue
            first = self.total - len(self.buf)
            pos = max(pos, first)
            new = list(itertools.islice(self.buf, pos - first, None))
            pos = self.total
            for r in new:
                if stream in ("both", r.stream):
                    yield r
