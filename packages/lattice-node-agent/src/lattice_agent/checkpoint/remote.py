"""Checkpoints kept in an S3 bucket (``checkpoint_root: s3://bucket/prefix``; spec:
Checkpoint Destinations, Storage Outage Behavior).

An application cannot write into a bucket, so every run writes its checkpoint into a
staging directory on the node (the same ``{tenant}/{project}/{alloc}/checkpoints/{id}/``
layout under the agent's work directory; LATTICE_CHECKPOINT_DIR points there). Once the
protocol reports the checkpoint complete it is uploaded with
``lattice_checkpoint.storage`` and the record names the ``s3://`` path; the staged copy
is removed. A resumed run gets the checkpoint downloaded into staging before it starts
(LATTICE_CHECKPOINT_PATH is that local copy).

Outage: a checkpoint asked for by preemption or suspend first probes the bucket; when
it does not answer the application is never asked (it would write a checkpoint that
cannot be kept): its processes are stopped and the allocation ends Failed with
:data:`REASON_UNAVAILABLE`, as when an upload fails after the application wrote it.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
from lattice_common.types import Allocation

from lattice_agent.checkpoint import paths

if TYPE_CHECKING:
    from lattice_checkpoint.storage import CheckpointStore
    from lattice_common.config import StorageConfig

    from lattice_agent.checkpoint.coordinator import Outcome

log = logging.getLogger("lattice.agent.checkpoint")

REASON_UNAVAILABLE = "checkpoint storage unavailable"
"""The reason an allocation ends Failed when its checkpoint could not be stored;
``: <what failed>`` follows."""
STAGING_DIR = ".checkpoint-staging"
"""Under the agent's work directory: where applications write before the upload."""
PROBE_BYTES = 64 << 10  # a probe before each preemption: small, it only has to answer
PROBE_TIMEOUT_S = 5.0  # the preemption waits for it: a hung endpoint counts as down


def is_remote(root: str) -> bool:
    return root.strip().lower().startswith("s3://")


def open_store(root: str, storage: StorageConfig | None) -> CheckpointStore:
    """The S3 store for ``root`` (nothing is contacted yet); ValidationError with a hint
    for a malformed root or half-given credentials."""
    from lattice_checkpoint.storage import open_checkpoint_store

    return open_checkpoint_store(
        root, storage, probe_bytes=PROBE_BYTES, probe_timeout_s=PROBE_TIMEOUT_S
    )


class RemoteCheckpoints:
    """The agent's side of an S3 checkpoint root: probe, upload, download."""

    def __init__(self, store: CheckpointStore, staging: Path) -> None:
        self.store = store
        self.staging = staging
        # allocation id -> (checkpoint id, the local copy a resumed run reads) or the
        # error that kept it from being downloaded
        self._restored: dict[str, tuple[str, Path | str]] = {}
        self._dirs: dict[str, Path] = {}  # allocation id -> its staging directory

    async def probe(self) -> str:
        """'' when the bucket answers a write probe, else what failed."""
        result = await self.store.probe()
        return "" if result.ok else (result.error or "the write probe failed")

    async def publish(self, a: Allocation, outcome: Outcome) -> Outcome:
        """A completed checkpoint (staged at ``outcome.record.path``) uploaded and its
        record pointing at the bucket; a failed upload fails the outcome."""
        from lattice_checkpoint.storage import allocation_key

        if not outcome.ok or outcome.record is None:
            return outcome
        ck = outcome.record
        local = Path(ck.path)
        try:
            size = await self.store.upload(local, allocation_key(a), ck.id)
        except Exception as e:
            log.error("allocation %s: checkpoint %s not stored: %s", a.id, ck.id, e)
            try:  # a partial upload is never used (no record names it): tidy up if it can
                await asyncio.wait_for(
                    self.store.delete_checkpoint(allocation_key(a), ck.id), PROBE_TIMEOUT_S
                )
            except Exception:
                pass
            return msgspec.structs.replace(
                outcome, ok=False, record=None, reason=f"{REASON_UNAVAILABLE}: {e}"
            )
        finally:
            await asyncio.to_thread(shutil.rmtree, local, True)
        key = allocation_key(a)
        url = self.store.checkpoint_path(key.tenant, key.project, key.alloc, ck.id)
        log.info("allocation %s: checkpoint %s stored at %s (%d bytes)", a.id, ck.id, url, size)
        record = msgspec.structs.replace(ck, path=url, size_bytes=size)
        return msgspec.structs.replace(outcome, record=record)

    async def restore(self, a: Allocation) -> None:
        """Download the checkpoint a resumed run starts from (idempotent per checkpoint);
        a failure is kept and raised by :meth:`local_path` when the run is spawned."""
        from lattice_checkpoint.storage import allocation_key

        ck = a.last_checkpoint
        if not a.resume_from_checkpoint or ck is None or not is_remote(ck.path):
            return
        done = self._restored.get(a.id)
        if done is not None and done[0] == ck.id and isinstance(done[1], Path):
            return
        key = allocation_key(a)
        expected = self.store.checkpoint_path(key.tenant, key.project, key.alloc, ck.id)
        self.staged(a)
        local = paths.allocation_root(self.staging, a) / "checkpoints" / ck.id
        if ck.path.rstrip("/") != expected.rstrip("/"):
            self._restored[a.id] = (ck.id, f"{ck.path} is not under {self.store.root}")
            return
        try:
            await asyncio.to_thread(shutil.rmtree, local, True)
            size = await self.store.download(key, ck.id, local)
        except Exception as e:
            log.error("allocation %s: cannot download checkpoint %s: %s", a.id, ck.path, e)
            self._restored[a.id] = (ck.id, str(e))
            return
        log.info("allocation %s: checkpoint %s downloaded (%d bytes)", a.id, ck.path, size)
        self._restored[a.id] = (ck.id, local)

    def local_path(self, a: Allocation) -> Path | None:
        """The local copy of the checkpoint ``a`` resumes from; None when it does not
        resume from a stored one. OSError (the run fails to start, saying why) when the
        download failed: a job told to resume must never start from nothing."""
        ck = a.last_checkpoint
        if not a.resume_from_checkpoint or ck is None or not is_remote(ck.path):
            return None
        done = self._restored.get(a.id)
        if done is None or done[0] != ck.id:
            raise OSError(f"{REASON_UNAVAILABLE}: checkpoint {ck.path} was not downloaded")
        if isinstance(done[1], str):
            raise OSError(f"{REASON_UNAVAILABLE}: cannot download {ck.path}: {done[1]}")
        return done[1]

    def staged(self, a: Allocation) -> None:
        """``a`` has a staging directory on this node (removed when it leaves)."""
        self._dirs[a.id] = paths.allocation_root(self.staging, a)

    def keep(self, alloc_ids: set[str]) -> None:
        """Staging of the allocations that left this node is removed (what they wrote
        there was uploaded, or is of no use)."""
        for aid in [x for x in self._dirs if x not in alloc_ids]:
            shutil.rmtree(self._dirs.pop(aid), ignore_errors=True)
        for aid in [x for x in self._restored if x not in alloc_ids]:
            del self._restored[aid]

    async def close(self) -> None:
        await self.store.close()
