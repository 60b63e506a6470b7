"""Persistence: the agent's state file, so that a restarted agent reattaches to its work.

A restarted agent is no longer the parent of the processes it started, so identity and intent
are written down after every change: pid, pgid, the kernel start time of the pid (against pid
reuse), ``started_at``, the walltime, the log paths, a termination in progress and the exit
once known. The file is replaced atomically (:func:`replace_file`, mode 0600); an unreadable one is
moved aside as ``.corrupt`` rather than silently overwritten.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from lattice_agent.lifecycle import PHASE_EXITED, PHASE_RUNNING, Lifecycle, Status
from lattice_agent.spawn import AllocPaths

log = logging.getLogger("lattice.agent.runtime")

__all__ = [
    "STATE_VERSION",
    "SavedAlloc",
    "StateFile",
    "dump_json",
    "from_entry",
    "read_json",
    "replace_file",
    "to_entry",
    "write_json_atomic",
]

STATE_VERSION = 1


def dump_json(data: Any) -> bytes:
    """``data`` as indented JSON with sorted keys: the same bytes as
    ``json.dumps(data, indent=1, sort_keys=True)``, about 20x cheaper. State files are
    written several times per job, and ``json.dumps`` with ``indent`` falls back to its
    pure-Python encoder, which made these writes a large share of an agent's CPU."""
    return msgspec.json.format(msgspec.json.encode(data, order="sorted"), indent=1)


@dataclass(frozen=True)
class SavedAlloc:
    """One allocation as the state file holds it."""

    life: Lifecycle
    pid: int
    pgid: int
    proc_start: int | None
    paths: AllocPaths


def to_entry(saved: SavedAlloc) -> dict[str, Any]:
    life = saved.life
    return {
        "id": life.allocation_id,
        "pid": saved.pid,
        "pgid": saved.pgid,
        "proc_start": saved.proc_start,
        "started_at": life.started_at,
        "walltime_seconds": life.walltime_seconds,
        "deadline": life.deadline,
        "work_dir": str(saved.paths.work_dir),
        "stdout": str(saved.paths.stdout),
        "stderr": str(saved.paths.stderr),
        "exit_file": str(saved.paths.exit_file),
        "phase": life.phase,
        "exit_code": life.exit_code,
        "reason": life.reason,
        "finished_at": life.finished_at,
        "stop_reason": life.stop_reason,
        "kill_signal": life.kill_signal,
        "peak_memory_bytes": life.peak_memory_bytes,
    }


def from_entry(d: dict[str, Any]) -> SavedAlloc:
    """Raises KeyError/TypeError/ValueError for an entry that cannot be used."""
    work_dir = Path(d["work_dir"])
    walltime = float(d.get("walltime_seconds") or 0)
    started_at = float(d["started_at"])
    phase = d.get("phase", PHASE_RUNNING)
    life = Lifecycle(
        allocation_id=str(d["id"]),
        # a running record is taken over by Recovered, which re-derives the rest
        status=Status.EXITED if phase == PHASE_EXITED else Status.RUNNING,
        started_at=started_at,
        walltime_seconds=walltime,
        deadline=started_at + walltime if walltime > 0 else d.get("deadline"),
        exit_code=d.get("exit_code"),
        reason=d.get("reason", ""),
        finished_at=d.get("finished_at"),
        peak_memory_bytes=d.get("peak_memory_bytes"),
        stop_reason=d.get("stop_reason", ""),
        kill_signal=int(d.get("kill_signal") or 0),
    )
    pid = int(d["pid"])
    return SavedAlloc(
        life=life,
        pid=pid,
        pgid=int(d.get("pgid") or pid),
        proc_start=d.get("proc_start"),
        paths=AllocPaths(
            work_dir=work_dir,
            stdout=Path(d["stdout"]),
            stderr=Path(d["stderr"]),
            exit_file=Path(d.get("exit_file") or work_dir / "exit_code"),
        ),
    )


class StateFile:
    """``agent-state.json``: every allocation record of one node's runtime."""

    def __init__(self, path: Path, *, node_id: str, clock: Callable[[], float]) -> None:
        self.path = Path(path)
        self._node_id = node_id
        self._clock = clock

    def load(self) -> list[dict[str, Any]]:
        """The raw entries; an unreadable file is moved aside and counts as empty."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as e:
            log.error("cannot read state file %s: %s", self.path, e)
            return []
        try:
            data = json.loads(raw)
            entries = data["allocations"]
            if not isinstance(entries, list):
                raise TypeError("allocations is not a list")
        except (ValueError, KeyError, TypeError) as e:
            aside = self.path.with_name(self.path.name + ".corrupt")
            log.error("state file %s unreadable (%s); moved to %s", self.path, e, aside)
            with contextlib.suppress(OSError):
                os.replace(self.path, aside)
            return []
        return [e for e in entries if isinstance(e, dict)]

    def save(self, entries: list[dict[str, Any]]) -> None:
        data = {
            "version": STATE_VERSION,
            "node_id": self._node_id,
            "written_at": self._clock(),
            "allocations": entries,
        }
        try:
            # Atomic replace, no fsync: the file exists to survive an agent restart (the
            # page cache outlives the process); after a machine crash no workload is left
            # to reattach, and stale entries are recognised by pid start time.
            replace_file(self.path, dump_json(data))
        except OSError as e:
            log.error("cannot write state file %s: %s", self.path, e)


#: a state-file write that may wait (a removal) is done with the next write, or after this
PERSIST_LATER_SECONDS = 1.0


class WriteLater:
    """A state-file write that may wait: ``soon()`` writes (``write()``) at most
    PERSIST_LATER_SECONDS from now, once however often it is asked; the owner's own
    write calls ``done()`` first, which makes the pending one unnecessary. Without a
    running event loop it writes at once."""

    __slots__ = ("_handle", "_write")

    def __init__(self, write: Callable[[], None]) -> None:
        self._write = write
        self._handle: asyncio.TimerHandle | None = None

    def soon(self) -> None:
        if self._handle is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._write()
            return
        self._handle = loop.call_later(PERSIST_LATER_SECONDS, self._write)

    def done(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


def replace_file(path: Path, payload: bytes) -> None:
    """``path`` atomically replaced by ``payload`` (mode 0600, no fsync); the directory is
    made only when it is missing. Raises OSError.

    The bytes are written into ``.<name>.swap`` beside it, which is then exchanged with
    ``path`` (``renameat2(RENAME_EXCHANGE)``): the swap file keeps the previous version
    and is overwritten in place next time. The state files are rewritten several times
    per job, and a rename over an existing file frees an inode every time (and on ext4
    starts writing the new one back; ext4 without a journal also searches the recently
    freed inodes at every create): ten times the cost of the exchange. A plain rename
    where there is nothing to exchange with yet, or where the file system cannot."""
    path = Path(path)
    swap = path.with_name(f".{path.name}.swap")
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC
    try:
        fd = os.open(swap, flags, 0o600)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(swap, flags, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)
            view = memoryview(payload)
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], done)
            # not truncated first: a file cut to zero and rewritten is flushed at close
            os.ftruncate(fd, len(view))
        finally:
            os.close(fd)
        if not _exchange(swap, path):
            os.replace(swap, path)
    except OSError:
        with contextlib.suppress(OSError):
            swap.unlink()
        raise


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_renameat2: Any = None  # libc's, looked up once; False where there is none


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically; False when ``b`` does not exist or the kernel, the file
    system or the C library cannot (the caller renames instead)."""
    global _renameat2
    if _renameat2 is None:
        try:
            _renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
        except (AttributeError, OSError):
            _renameat2 = False
    if _renameat2 is False:
        return False
    rc = _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOENT, errno.EINVAL, errno.ENOSYS, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


def write_json_atomic(path: Path, data: Any) -> bool:
    """``data`` as JSON in ``path``, replaced atomically with mode 0600 (the state
    file's way); False (logged) when it cannot be written."""
    try:
        replace_file(path, dump_json(data))
        return True
    except OSError as e:
        log.error("cannot write %s: %s", path, e)
        return False


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object written by :func:`write_json_atomic`; None when there is none. An
    unreadable one is moved aside as ``.corrupt`` (and counts as none)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.error("cannot read %s: %s", path, e)
        return None
    try:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise TypeError("not a JSON object")
    except (ValueError, TypeError) as e:
        aside = path.with_name(path.name + ".corrupt")
        log.error("%s unreadable (%s); moved to %s", path, e, aside)
        with contextlib.suppress(OSError):
            os.replace(path, aside)
        return None
    return data
