"""What every checkpoint storage backend offers (:class:`CheckpointStore`) and what a
write probe reports (:class:`ProbeResult`)."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path
from typing import Protocol, runtime_checkable

import msgspec
from lattice_common.errors import Unavailable

from lattice_checkpoint.storage.layout import AllocationKey, CheckpointRoot

__all__ = [
    "DEFAULT_PROBE_BYTES",
    "DEFAULT_PROBE_TIMEOUT_S",
    "CheckpointStorageError",
    "CheckpointStore",
    "ProbeResult",
    "probe_name",
]

#: the probe object: large enough that the time is not only round trips, small enough
#: to write every evaluation interval without competing with real checkpoints
DEFAULT_PROBE_BYTES = 1 << 20
#: a hung NFS mount or an S3 endpoint that accepts but never answers counts as down
DEFAULT_PROBE_TIMEOUT_S = 10.0
PROBE_DIR = ".lattice-probe"


class ProbeResult(msgspec.Struct, frozen=True):
    """One write probe: ``ok`` when the object was written (and synced), read back
    identical and deleted; ``write_bandwidth_bytes_per_s`` is the probe's size over the
    time of the write alone (0.0 when not ok); ``error`` says what failed."""

    ok: bool
    write_bandwidth_bytes_per_s: float
    error: str | None = None


class CheckpointStorageError(Unavailable):
    """A checkpoint storage operation failed (the destination is down, refuses, or the
    checkpoint is not there); the message names the destination, never a credential."""


def probe_name() -> str:
    """A probe's name, distinct per host, process and probe (several brokers, or a
    broker and agents, may probe one destination at once)."""
    return f"{PROBE_DIR}/{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


@runtime_checkable
class CheckpointStore(Protocol):
    """One checkpoint destination (a shared directory or an S3 bucket and prefix).

    Paths are ``{checkpoint_root}/{tenant}/{project}/{alloc}/checkpoints/{id}/``;
    ``key`` names the allocation (:func:`lattice_checkpoint.storage.allocation_key`).
    Operations other than :meth:`probe` raise :class:`CheckpointStorageError` when the
    destination cannot be used; :meth:`probe` never raises for that, it reports.
    """

    root: CheckpointRoot

    def checkpoint_path(self, tenant: str, project: str, alloc: str, checkpoint_id: str) -> str:
        """Where the checkpoint is (a directory, or an ``s3://`` URL), ending in ``/``:
        what LATTICE_CHECKPOINT_PATH says and what a CheckpointRecord keeps."""
        ...

    async def probe(self) -> ProbeResult:
        """Write a probe object (synced), read it back, delete it, time the write."""
        ...

    async def upload(self, local_dir: str | Path, key: AllocationKey, checkpoint_id: str) -> int:
        """Put a checkpoint the application wrote in ``local_dir`` (node-local) at its
        place; the bytes stored. A failed upload may leave part of it behind (remove it
        with :meth:`delete_checkpoint`): a checkpoint is usable once the quorum records
        it (CheckpointRecord), which happens only after a successful upload."""
        ...

    async def download(self, key: AllocationKey, checkpoint_id: str, local_dir: str | Path) -> int:
        """Copy a stored checkpoint into ``local_dir`` (to resume from it); the bytes."""
        ...

    async def list_checkpoints(self, key: AllocationKey) -> list[str]:
        """The checkpoint ids stored for the allocation, sorted; [] when none."""
        ...

    async def list_allocations(self) -> list[AllocationKey]:
        """Every allocation that has something under ``checkpoints/``, sorted."""
        ...

    async def checkpoint_size(self, key: AllocationKey, checkpoint_id: str) -> int:
        """Bytes stored for the checkpoint (0 when there is none)."""
        ...

    async def delete_checkpoint(self, key: AllocationKey, checkpoint_id: str) -> int:
        """Remove one checkpoint; the files (objects) removed (0 when none)."""
        ...

    async def delete_allocation(self, key: AllocationKey) -> int:
        """Remove all checkpoints of the allocation; the files (objects) removed."""
        ...

    async def close(self) -> None: ...
