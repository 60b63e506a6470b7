"""Checkpoints in a directory every node mounts (NFS, or any POSIX file system) (spec:
"/scratch/{tenant}/{project}/{allocation_id}/checkpoints/{checkpoint_id}/").

The root must already exist: a missing root usually means the shared file system is not
mounted, and writing into the empty mount point would put checkpoints on one node's local
disk where no other node can resume from them. All file work runs in worker threads; a
probe that hangs (a dead NFS server) is abandoned after its timeout and reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from lattice_checkpoint.storage.base import (
    DEFAULT_PROBE_BYTES,
    DEFAULT_PROBE_TIMEOUT_S,
    PROBE_DIR,
    CheckpointStorageError,
    ProbeResult,
    probe_name,
)
from lattice_checkpoint.storage.layout import (
    CHECKPOINTS_DIR,
    AllocationKey,
    CheckpointRoot,
    checkpoint_relpath,
    checkpoints_relpath,
)

__all__ = ["LocalCheckpointStore"]

_T = TypeVar("_T")


class _Failed(Exception):
    """A step of an operation failed; the message is complete."""


class LocalCheckpointStore:
    """Checkpoints under ``root`` (an absolute directory that exists)."""

    def __init__(
        self,
        root: str | Path,
        *,
        probe_bytes: int = DEFAULT_PROBE_BYTES,
        probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
    ) -> None:
        self.root = CheckpointRoot("fs", path=os.path.normpath(os.fspath(root)))
        self._root = Path(self.root.path)
        self.probe_bytes = probe_bytes
        self.probe_timeout_s = probe_timeout_s

    def __repr__(self) -> str:
        return f"LocalCheckpointStore({self.root.path!r})"

    # --- layout -------------------------------------------------------------------------

    def checkpoint_path(self, tenant: str, project: str, alloc: str, checkpoint_id: str) -> str:
        rel = checkpoint_relpath(AllocationKey(tenant, project, alloc), checkpoint_id)
        return os.path.join(self.root.path, rel) + "/"

    def _dir(self, key: AllocationKey, checkpoint_id: str) -> Path:
        return self._root / checkpoint_relpath(key, checkpoint_id)

    # --- probe --------------------------------------------------------------------------

    async def probe(self) -> ProbeResult:
        try:
            bandwidth = await asyncio.wait_for(
                asyncio.to_thread(self._probe_sync), self.probe_timeout_s
            )
        except TimeoutError:
            return ProbeResult(
                False,
                0.0,
                f"checkpoint root {self.root.path}: the write probe did not finish within "
                f"{self.probe_timeout_s:g} s (a hung mount?)",
            )
        except _Failed as e:
            return ProbeResult(False, 0.0, str(e))
        return ProbeResult(True, bandwidth)

    def _probe_sync(self) -> float:
        where = f"checkpoint root {self.root.path}"
        if not self._root.exists():
            raise _Failed(
                f"{where} does not exist (is the shared file system mounted on this host?)"
            )
        if not self._root.is_dir():
            raise _Failed(f"{where} is not a directory")
        path = self._root / probe_name()
        data = os.urandom(self.probe_bytes)
        try:
            path.parent.mkdir(exist_ok=True)
            t0 = time.perf_counter()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            elapsed = time.perf_counter() - t0
        except OSError as e:
            with contextlib.suppress(OSError):
                path.unlink()
            raise _Failed(f"{where}: cannot write a probe file: {_why(e)}") from None
        try:
            if path.read_bytes() != data:
                raise _Failed(f"{where}: the probe file read back differs from what was written")
        except OSError as e:
            raise _Failed(f"{where}: cannot read the probe file back: {_why(e)}") from None
        finally:
            with contextlib.suppress(OSError):
                path.unlink()
        if path.exists():
            raise _Failed(f"{where}: cannot delete the probe file {path}")
        return len(data) / max(elapsed, 1e-9)

    # --- checkpoints --------------------------------------------------------------------

    async def upload(self, local_dir: str | Path, key: AllocationKey, checkpoint_id: str) -> int:
        dest = self._dir(key, checkpoint_id)
        return await self._run("store", dest, lambda: self._upload_sync(Path(local_dir), dest))

    def _upload_sync(self, src: Path, dest: Path) -> int:
        if not src.is_dir():
            raise _Failed(f"no checkpoint directory {src} to store")
        self._require_root()
        with contextlib.suppress(OSError):
            if src.resolve() == dest.resolve():
                return _size(dest)  # the application wrote it in place
        dest.parent.mkdir(parents=True, exist_ok=True)
        # copied beside it, synced, then renamed: the checkpoint appears whole or not at all
        tmp = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:8]}"
        try:
            shutil.copytree(src, tmp, symlinks=False)
            _fsync_tree(tmp)
            if dest.exists():
                shutil.rmtree(dest)
            os.rename(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _fsync_dir(dest.parent)
        return _size(dest)

    async def download(self, key: AllocationKey, checkpoint_id: str, local_dir: str | Path) -> int:
        src = self._dir(key, checkpoint_id)

        def copy() -> int:
            if not src.is_dir():
                raise _Failed(f"no checkpoint {checkpoint_id} at {src}")
            shutil.copytree(src, Path(local_dir), dirs_exist_ok=True)
            return _size(src)

        return await self._run("read", src, copy)

    async def list_checkpoints(self, key: AllocationKey) -> list[str]:
        base = self._root / checkpoints_relpath(key)

        def ids() -> list[str]:
            if not base.is_dir():
                self._require_root()
                return []
            return sorted(p.name for p in base.iterdir() if p.is_dir() and _listed(p.name))

        return await self._run("list", base, ids)

    async def list_allocations(self) -> list[AllocationKey]:
        def walk() -> list[AllocationKey]:
            self._require_root()
            out: list[AllocationKey] = []
            for tenant in _subdirs(self._root):
                for project in _subdirs(tenant):
                    for alloc in _subdirs(project):
                        if (alloc / CHECKPOINTS_DIR).is_dir():
                            out.append(AllocationKey(tenant.name, project.name, alloc.name))
            return sorted(out)

        return await self._run("list", self._root, walk)

    async def checkpoint_size(self, key: AllocationKey, checkpoint_id: str) -> int:
        path = self._dir(key, checkpoint_id)
        return await self._run("measure", path, lambda: _size(path))

    async def delete_checkpoint(self, key: AllocationKey, checkpoint_id: str) -> int:
        path = self._dir(key, checkpoint_id)
        return await self._run("delete", path, lambda: _remove_tree(path))

    async def delete_allocation(self, key: AllocationKey) -> int:
        base = self._root / checkpoints_relpath(key)

        def remove() -> int:
            n = _remove_tree(base)
            # the allocation's directory goes too when nothing else (its output) is in it
            with contextlib.suppress(OSError):
                base.parent.rmdir()
            return n

        return await self._run("delete", base, remove)

    async def close(self) -> None:
        return None

    # --- helpers ------------------------------------------------------------------------

    def _require_root(self) -> None:
        if not self._root.is_dir():
            raise _Failed(
                f"checkpoint root {self.root.path} does not exist or is not a directory "
                "(is the shared file system mounted on this host?)"
            )

    async def _run(self, what: str, path: Path, fn: Callable[[], _T]) -> _T:
        try:
            return await asyncio.to_thread(fn)
        except _Failed as e:
            raise CheckpointStorageError(
                str(e), hint="Check that checkpoint.checkpoint_root is mounted and writable."
            ) from None
        except OSError as e:
            raise CheckpointStorageError(
                f"checkpoint storage {self.root.path}: cannot {what} {path}: {_why(e)}",
                hint="Check that checkpoint.checkpoint_root is mounted and writable.",
            ) from None


def _why(e: OSError) -> str:
    if e.errno is not None:
        return f"{e.strerror or os.strerror(e.errno)} ({errno.errorcode.get(e.errno, e.errno)})"
    return str(e) or type(e).__name__


def _listed(name: str) -> bool:
    # dot-names are the probe directory and copies still being written
    return not name.startswith(".") and name != PROBE_DIR


def _subdirs(p: Path) -> list[Path]:
    return sorted(c for c in p.iterdir() if _listed(c.name) and c.is_dir())


def _size(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


def _count(path: Path) -> int:
    return sum(len(files) for _d, _s, files in os.walk(path))


def _remove_tree(path: Path) -> int:
    if not path.exists():
        return 0
    n = _count(path)
    shutil.rmtree(path)
    return n


def _fsync_tree(path: Path) -> None:
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
