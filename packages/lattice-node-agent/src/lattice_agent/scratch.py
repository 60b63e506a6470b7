"""Per-allocation scratch space: ``<scratch_root>/<alloc_id>``, the user's, wiped at the end.

Spec (Data Plane, allocation data lifecycle): node-local scratch is created at the start
and deleted at allocation end, so nothing of one job is left for the next (spec: data
remnants). The job finds it in ``LATTICE_SCRATCH`` and ``TMPDIR``.

* **Created** before the job's process (``create``): mode 0700, owned by the user the job
  runs as; a tmpfs of ``node_agent.scratch_tmpfs_mb`` MiB mounted on it when configured
  (nodes without local disks), else a plain directory on ``node_agent.scratch_root``.
  Task launches and attach on the allocation's other nodes (where no batch process runs)
  make it on demand (``ensure``).
* **Wiped** at the reap, on a failed start and when an allocation leaves the node
  (``wipe``): the tmpfs unmounted, the tree removed without ever following a symlink out
  of it (``shutil.rmtree`` works on directory fds; an entry that is not a directory is
  only unlinked). Idempotent.
* **Orphans** (a crash between start and wipe): every directory made here is first
  recorded as ``<scratch_root>/.lattice-scratch/<alloc_id>``; at agent start those of
  allocations with no live state entry are wiped, like orphaned cgroup scopes. Only
  recorded directories are ever wiped, so a scratch root shared with other data is safe.

The root must not be writable by the users (checked when jobs run as another user):
otherwise a job could swap its directory for a symlink between our checks and the
mount or unmount, which follow symlinks.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import shutil
import stat
import subprocess
from pathlib import Path

from lattice_agent.identity import RunAs, may_enter

log = logging.getLogger("lattice.agent.scratch")

__all__ = ["REGISTRY", "Scratch", "ScratchError", "default_root"]

#: under the scratch root: one marker per scratch directory this agent made
REGISTRY = ".lattice-scratch"
_TOOL_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"
_MOUNT_TIMEOUT = 30.0
# <sys/mount.h>
_MNT_DETACH = 2
_UMOUNT_NOFOLLOW = 8


class ScratchError(OSError):
    """A scratch directory could not be made or removed; the message says why."""


def default_root(work_dir: Path) -> Path:
    """Where scratch goes when nothing is configured: inside the agent's work dir."""
    return Path(work_dir).absolute() / ".scratch"


def _why(e: BaseException) -> str:
    if isinstance(e, ScratchError):
        return str(e)
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e) or type(e).__name__


class Scratch:
    """The scratch directories of one agent under ``root``."""

    def __init__(self, root: str | Path, *, tmpfs_mb: int = 0) -> None:
        if tmpfs_mb < 0:
            raise ValueError("scratch_tmpfs_mb must be >= 0")
        self.root = Path(root).absolute()
        self.tmpfs_mb = tmpfs_mb
        self._registry = self.root / REGISTRY

    def path(self, alloc_id: str) -> Path:
        if not alloc_id or "/" in alloc_id or alloc_id in (".", "..", REGISTRY):
            raise ValueError(f"allocation id not usable as a scratch directory: {alloc_id!r}")
        return self.root / alloc_id

    # ------------------------------------------------------------------ create

    def create(self, alloc_id: str, run_as: RunAs) -> Path:
        """A fresh, empty scratch directory for ``alloc_id`` (a stale one is wiped first)."""
        path = self.path(alloc_id)
        try:
            self._prepare_root(run_as)
            self.wipe(alloc_id)
            # recorded before it exists: a crash from here on leaves an orphan we know
            (self._registry / alloc_id).touch(mode=0o600)
            os.mkdir(path, 0o700)
            if self.tmpfs_mb > 0:
                self._mount(path, run_as)
            else:
                self._own(path, run_as)
            self._check_reachable(path, run_as)
        except (OSError, subprocess.SubprocessError) as e:
            with contextlib.suppress(OSError):
                self.wipe(alloc_id)
            raise ScratchError(f"could not create scratch directory {path}: {_why(e)}") from e
        return path

    def ensure(self, alloc_id: str, run_as: RunAs) -> Path:
        """The allocation's scratch directory, created when this node has none yet (its
        other nodes: task launches, attach); an existing one is kept as it is."""
        path = self.path(alloc_id)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return self.create(alloc_id, run_as)
        if stat.S_ISDIR(st.st_mode) and (self._registry / alloc_id).exists():
            return path
        return self.create(alloc_id, run_as)

    def _prepare_root(self, run_as: RunAs) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._registry.mkdir(mode=0o700, exist_ok=True)
        if not run_as.switches:
            return
        st = os.stat(self.root)
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or st.st_uid != os.geteuid():
            raise ScratchError(
                f"scratch root {self.root} is writable by other users (mode "
                f"{stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}). Hint: give the agent "
                "its own directory, e.g. mode 0755 owned by root, in node_agent.scratch_root"
            )

    def _own(self, path: Path, run_as: RunAs) -> None:
        # through an fd opened without following symlinks: exactly the directory we made
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.fchmod(fd, 0o700)  # mkdir's mode went through the umask
            if run_as.switches:
                os.fchown(fd, run_as.uid, run_as.gid)
        finally:
            os.close(fd)

    def _mount(self, path: Path, run_as: RunAs) -> None:
        mount = shutil.which("mount", path=_TOOL_PATH)
        if not mount:
            raise ScratchError("mount (util-linux) not found")
        options = f"size={self.tmpfs_mb}m,mode=0700,uid={run_as.uid},gid={run_as.gid}"
        r = subprocess.run(
            [mount, "-t", "tmpfs", "-o", options, "lattice-scratch", str(path)],
            capture_output=True,
            text=True,
            timeout=_MOUNT_TIMEOUT,
            check=False,
        )
        if r.returncode != 0:
            raise ScratchError(f"tmpfs mount failed: {(r.stderr or r.stdout).strip()}")

    def _check_reachable(self, path: Path, run_as: RunAs) -> None:
        # the agent made it, so the agent reaches it: only another user needs a look
        if run_as.switches and may_enter(str(path), run_as) is False:
            raise ScratchError(
                f"user {run_as.name} cannot reach it (a directory above it is not "
                "searchable). Hint: make node_agent.scratch_root and its parents "
                "searchable by all users (mode 0755)"
            )

    # ------------------------------------------------------------------ wipe

    def wipe(self, alloc_id: str) -> None:
        """Remove ``alloc_id``'s scratch directory (unmount, rm -rf) and its record.
        Nothing there is fine; raises ScratchError when something is left."""
        path = self.path(alloc_id)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        except OSError as e:
            raise ScratchError(f"scratch directory {path}: {_why(e)}") from e
        if st is not None:
            try:
                if not stat.S_ISDIR(st.st_mode):
                    os.unlink(path)  # a symlink (or file) in its place: only the entry goes
                else:
                    if os.path.ismount(path):
                        _unmount(path)
                    shutil.rmtree(path)
            except OSError as e:
                raise ScratchError(f"could not wipe scratch directory {path}: {_why(e)}") from e
        (self._registry / alloc_id).unlink(missing_ok=True)

    def orphans(self, known: set[str]) -> list[str]:
        """Allocations with a recorded scratch directory that are not in ``known``."""
        try:
            names = os.listdir(self._registry)
        except FileNotFoundError:
            return []
        return sorted(n for n in names if n not in known)

    def wipe_orphans(self, known: set[str]) -> list[str]:
        """At agent start: wipe the scratch of every allocation not in ``known``."""
        wiped = []
        for alloc_id in self.orphans(known):
            try:
                self.wipe(alloc_id)
            except (ScratchError, ValueError) as e:
                log.warning("orphaned scratch of allocation %s: %s", alloc_id, e)
                continue
            log.warning("wiped orphaned scratch directory of allocation %s", alloc_id)
            wiped.append(alloc_id)
        return wiped


def _unmount(path: Path) -> None:
    """umount2 without following a symlink; lazily when still busy (a process that
    escaped the group still has a file open there: it goes when that process does)."""
    libc = ctypes.CDLL(None, use_errno=True)
    target = os.fsencode(path)
    if libc.umount2(target, _UMOUNT_NOFOLLOW) == 0:
        return
    err = ctypes.get_errno()
    if err == errno.EBUSY and libc.umount2(target, _UMOUNT_NOFOLLOW | _MNT_DETACH) == 0:
        return
    err = ctypes.get_errno() or err
    raise OSError(err, f"umount: {os.strerror(err)}", str(path))
