"""The shared-memory protocol (spec: "Shared memory flag (low-latency)"): a small flag
region in a file at a well-known path in the allocation's directory
($LATTICE_CHECKPOINT_SHM), mapped by both sides. The agent sets ``requested``; the
application polls it, writes its checkpoint, then clears ``requested`` and sets
``done`` (or ``failed``). It may publish progress (per mille) meanwhile.

Layout (``REGION_SIZE`` bytes, little-endian); lattice_sdk.checkpoint has the same
constants for the application's side:

| offset | size | field                                                  |
| 0      | 4    | magic ``LTCK``                                         |
| 4      | 1    | version (1)                                            |
| 5      | 1    | requested (agent sets 1; application clears)           |
| 6      | 1    | done (application sets 1)                              |
| 7      | 1    | failed (application sets 1)                            |
| 8      | 4    | progress, per mille (application)                      |
| 16     | 48   | checkpoint id, NUL-padded ASCII (agent)                |
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

from lattice_agent.checkpoint.base import Poll

REGION_SIZE = 64
MAGIC = b"LTCK"
VERSION = 1
OFF_REQUESTED = 5
OFF_DONE = 6
OFF_FAILED = 7
OFF_PROGRESS = 8
OFF_ID = 16
ID_SIZE = 48


def create_region(path: Path, uid: int | None = None, gid: int | None = None) -> None:
    """A fresh, zeroed region (a new run never sees the last run's flags)."""
    data = bytearray(REGION_SIZE)
    data[0:4] = MAGIC
    data[4] = VERSION
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(bytes(data))
    os.chmod(tmp, 0o600)
    if uid is not None and gid is not None:
        os.chown(tmp, uid, gid)
    os.replace(tmp, path)


class ShmemProtocol:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._map: mmap.mmap | None = None
        self._progress = 0

    def _mapped(self) -> mmap.mmap:
        if self._map is None:
            fd = os.open(self.path, os.O_RDWR)
            try:
                self._map = mmap.mmap(fd, REGION_SIZE, mmap.MAP_SHARED)
            finally:
                os.close(fd)
            if self._map[0:4] != MAGIC:
                raise ValueError(f"{self.path} is not a checkpoint flag region")
        return self._map

    async def request(
        self,
        checkpoint_id: str,
        directory: Path,
        *,
        timeout: float,
        force: bool,
        deferral_left: float,
    ) -> None:
        m = self._mapped()
        raw = checkpoint_id.encode()[:ID_SIZE]
        m[OFF_ID : OFF_ID + ID_SIZE] = raw + b"\0" * (ID_SIZE - len(raw))
        m[OFF_DONE] = m[OFF_FAILED] = 0
        m[OFF_PROGRESS : OFF_PROGRESS + 4] = struct.pack("<I", 0)
        m[OFF_REQUESTED] = 1  # last: the application sees a complete request
        self._progress = 0

    def poll(self) -> Poll:
        try:
            m = self._mapped()
        except (OSError, ValueError) as e:
            return Poll(error=f"flag region unusable: {e}")
        (progress,) = struct.unpack_from("<I", m, OFF_PROGRESS)
        moved = progress > self._progress
        self._progress = max(self._progress, progress)
        if m[OFF_FAILED]:
            return Poll(error="the application reported a failed checkpoint")
        return Poll(done=bool(m[OFF_DONE]), sign_of_life=moved)

    async def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
