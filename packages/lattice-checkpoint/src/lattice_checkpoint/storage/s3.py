"""Checkpoints in an S3-compatible bucket (spec:
"s3://{tenant}/{project}/{allocation_id}/checkpoints/{checkpoint_id}/", here under one
configured bucket and prefix).

The client is lattice_common.logstore.S3LogStore's (aiobotocore, path-style addressing,
the storage section's endpoint and credentials, one client per event loop); what it has
(put, get, list, delete by prefix) is used as is, and its client directly for what a
checkpoint needs beyond logs: sizes, delimiter listings and multipart uploads of large
files. Applications write a checkpoint to node-local disk; :meth:`upload` puts it here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Coroutine, Iterable
from pathlib import Path
from typing import Any, TypeVar

from lattice_common.logstore import LogStoreError, S3LogStore

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

__all__ = ["MIN_PART_BYTES", "S3CheckpointStore"]

_T = TypeVar("_T")

#: S3's smallest part (all but the last) of a multipart upload
MIN_PART_BYTES = 5 << 20
_DEFAULT_PART_BYTES = 32 << 20
_READ_CHUNK = 8 << 20
_HINT = "Check storage.s3_endpoint, the S3 credentials of the storage section and that the bucket exists."


class S3CheckpointStore:
    """Checkpoints under ``s3://{bucket}/{prefix}/``. Files up to ``part_bytes`` are one
    PUT, larger ones a multipart upload of ``part_bytes`` parts; at most ``concurrency``
    PUTs are in flight (which also bounds the memory held: concurrency x part_bytes)."""

    def __init__(
        self,
        root: CheckpointRoot,
        *,
        endpoint_url: str = "",
        region: str = "",
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        probe_bytes: int = DEFAULT_PROBE_BYTES,
        probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
        part_bytes: int = _DEFAULT_PART_BYTES,
        concurrency: int = 4,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 60.0,
    ) -> None:
        if root.kind != "s3":
            raise ValueError(f"not an S3 checkpoint root: {root}")
        self.root = root
        self.probe_bytes = probe_bytes
        self.probe_timeout_s = probe_timeout_s
        self.part_bytes = max(MIN_PART_BYTES, part_bytes)
        self.concurrency = max(1, concurrency)
        self._store = S3LogStore(
            bucket=root.bucket,
            endpoint_url=endpoint_url,
            region=region,
            access_key_id=access_key_id,
            secret_access_key=secret_access_key,
            key_prefix=root.prefix,
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
        )
        self._prefix = self._store.key_prefix  # "" or "prefix/"
        self.name = f"{root}" + (f" at {endpoint_url}" if endpoint_url else "")

    def __repr__(self) -> str:
        return f"S3CheckpointStore({self.name!r})"

    # --- layout -------------------------------------------------------------------------

    def checkpoint_path(self, tenant: str, project: str, alloc: str, checkpoint_id: str) -> str:
        rel = checkpoint_relpath(AllocationKey(tenant, project, alloc), checkpoint_id)
        return f"s3://{self.root.bucket}/{self._prefix}{rel}/"

    # --- probe --------------------------------------------------------------------------

    async def probe(self) -> ProbeResult:
        key = probe_name()
        data = os.urandom(self.probe_bytes)
        step = "write"

        async def run() -> float:
            nonlocal step
            t0 = time.perf_counter()
            await self._store.put(key, data)
            elapsed = time.perf_counter() - t0
            step = "read back"
            if await self._store.get(key) != data:
                raise ValueError("the probe object read back differs from what was written")
            step = "delete"
            client = await self._client()
            await client.delete_object(Bucket=self.root.bucket, Key=self._prefix + key)
            return elapsed

        try:
            elapsed = await asyncio.wait_for(run(), self.probe_timeout_s)
        except TimeoutError:
            return ProbeResult(
                False,
                0.0,
                f"checkpoint storage {self.name}: the write probe ({step}) did not finish "
                f"within {self.probe_timeout_s:g} s",
            )
        except Exception as e:
            return ProbeResult(
                False, 0.0, f"checkpoint storage {self.name}: probe {step} failed: {_text(e)}"
            )
        return ProbeResult(True, len(data) / max(elapsed, 1e-9))

    # --- checkpoints --------------------------------------------------------------------

    async def upload(self, local_dir: str | Path, key: AllocationKey, checkpoint_id: str) -> int:
        src = Path(local_dir)
        base = self._prefix + checkpoint_relpath(key, checkpoint_id) + "/"
        try:
            files = await asyncio.to_thread(_files_of, src)
        except OSError as e:
            raise CheckpointStorageError(f"cannot read the checkpoint in {src}: {e}") from None
        if files is None:
            raise CheckpointStorageError(f"no checkpoint directory {src} to store")
        client = await self._client()
        gate = asyncio.Semaphore(self.concurrency)

        async def one(rel: str, size: int) -> None:
            if size <= self.part_bytes:
                async with gate:
                    body = await asyncio.to_thread(_read_range, src / rel, 0, size)
                    await client.put_object(Bucket=self.root.bucket, Key=base + rel, Body=body)
            else:
                await self._multipart(client, gate, src / rel, base + rel, size)

        try:
            await _all(one(rel, size) for rel, size in files)
        except _LocalReadError as e:
            raise CheckpointStorageError(
                f"cannot read the checkpoint in {src}: {e}", hint="Check the local directory."
            ) from None
        except Exception as e:
            raise self._error("store", base, e) from None
        return sum(size for _rel, size in files)

    async def _multipart(
        self, client: Any, gate: asyncio.Semaphore, path: Path, key: str, size: int
    ) -> None:
        bucket = self.root.bucket
        up = await client.create_multipart_upload(Bucket=bucket, Key=key)
        upload_id = up["UploadId"]

        async def part(number: int, offset: int) -> dict[str, Any]:
            async with gate:
                body = await asyncio.to_thread(_read_range, path, offset, self.part_bytes)
                r = await client.upload_part(
                    Bucket=bucket, Key=key, PartNumber=number, UploadId=upload_id, Body=body
                )
                return {"ETag": r["ETag"], "PartNumber": number}

        try:
            offsets = range(0, size, self.part_bytes)
            parts = await _all(part(i + 1, off) for i, off in enumerate(offsets))
            await client.complete_multipart_upload(
                Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
            )
        except BaseException:
            # parts of an unfinished upload are stored (and billed) until aborted
            with contextlib.suppress(Exception):
                await client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
            raise

    async def download(self, key: AllocationKey, checkpoint_id: str, local_dir: str | Path) -> int:
        base = self._prefix + checkpoint_relpath(key, checkpoint_id) + "/"
        dest = Path(local_dir)
        objects = [o async for o in self._objects(base)]
        if not objects:
            raise CheckpointStorageError(
                f"no checkpoint {checkpoint_id} at s3://{self.root.bucket}/{base}"
            )
        client = await self._client()
        total = 0
        try:
            for o in objects:
                rel = o["Key"][len(base) :]
                target = dest / rel
                if ".." in Path(rel).parts:
                    continue  # never write outside local_dir
                await asyncio.to_thread(target.parent.mkdir, parents=True, exist_ok=True)
                resp = await client.get_object(Bucket=self.root.bucket, Key=o["Key"])
                with open(target, "wb") as f:
                    async with resp["Body"] as body:
                        while chunk := await body.read(_READ_CHUNK):
                            await asyncio.to_thread(f.write, chunk)
                            total += len(chunk)
        except OSError as e:
            raise CheckpointStorageError(f"cannot write the checkpoint into {dest}: {e}") from None
        except Exception as e:
            raise self._error("read", base, e) from None
        return total

    async def list_checkpoints(self, key: AllocationKey) -> list[str]:
        base = self._prefix + checkpoints_relpath(key) + "/"
        return sorted(p for p in await self._children(base) if not p.startswith("."))

    async def list_allocations(self) -> list[AllocationKey]:
        out: list[AllocationKey] = []
        for tenant in await self._children(self._prefix):
            if tenant == PROBE_DIR or tenant.startswith("."):
                continue
            for project in await self._children(f"{self._prefix}{tenant}/"):
                for alloc in await self._children(f"{self._prefix}{tenant}/{project}/"):
                    under = await self._children(f"{self._prefix}{tenant}/{project}/{alloc}/")
                    if CHECKPOINTS_DIR in under:
                        out.append(AllocationKey(tenant, project, alloc))
        return sorted(out)

    async def checkpoint_size(self, key: AllocationKey, checkpoint_id: str) -> int:
        base = self._prefix + checkpoint_relpath(key, checkpoint_id) + "/"
        return sum([int(o.get("Size", 0)) async for o in self._objects(base)])

    async def delete_checkpoint(self, key: AllocationKey, checkpoint_id: str) -> int:
        return await self._delete(checkpoint_relpath(key, checkpoint_id) + "/")

    async def delete_allocation(self, key: AllocationKey) -> int:
        # only checkpoints/: the allocation's output beside it is the user's
        return await self._delete(checkpoints_relpath(key) + "/")

    async def create_bucket(self) -> None:
        """Create the bucket if it does not exist (dev clusters and tests)."""
        try:
            await self._store.create_bucket()
        except LogStoreError as e:
            raise self._error("create bucket", self.root.bucket, e) from None

    async def close(self) -> None:
        await self._store.close()

    # --- helpers ------------------------------------------------------------------------

    async def _client(self) -> Any:
        # S3LogStore opens its client lazily in the running loop; the same one serves here
        return await self._store._s3()

    async def _delete(self, rel_prefix: str) -> int:
        try:
            return await self._store.delete(rel_prefix)
        except LogStoreError as e:
            raise self._error("delete", self._prefix + rel_prefix, e) from None

    async def _objects(self, prefix: str) -> AsyncIterator[dict[str, Any]]:
        client = await self._client()
        try:
            pages = client.get_paginator("list_objects_v2").paginate(
                Bucket=self.root.bucket, Prefix=prefix
            )
            async for page in pages:
                for o in page.get("Contents", []):
                    yield o
        except Exception as e:
            raise self._error("list", prefix, e) from None

    async def _children(self, prefix: str) -> list[str]:
        """The names one level below ``prefix`` that have objects under them."""
        client = await self._client()
        out: list[str] = []
        try:
            pages = client.get_paginator("list_objects_v2").paginate(
                Bucket=self.root.bucket, Prefix=prefix, Delimiter="/"
            )
            async for page in pages:
                for p in page.get("CommonPrefixes", []):
                    out.append(p["Prefix"][len(prefix) :].rstrip("/"))
        except Exception as e:
            raise self._error("list", prefix, e) from None
        return sorted(out)

    def _error(self, what: str, key: str, e: Exception) -> CheckpointStorageError:
        if isinstance(e, CheckpointStorageError):
            return e
        return CheckpointStorageError(
            f"checkpoint storage {self.name}: cannot {what} {key}: {_text(e)}", hint=_HINT
        )


def _text(e: Exception) -> str:
    if isinstance(e, LogStoreError):
        # "log store s3://b at URL: cannot write KEY: why" -> "why" after the last ": "
        text = str(e)
        return text.split(": ", 2)[-1] if text.startswith("log store ") else text
    resp = getattr(e, "response", None)
    if isinstance(resp, dict):
        err = resp.get("Error", {})
        return f"{err.get('Code', '')}: {err.get('Message', '')}".strip(": ")
    return str(e) or type(e).__name__


def _files_of(src: Path) -> list[tuple[str, int]] | None:
    """(path relative to ``src`` with "/" separators, size) of every file; None when
    ``src`` is not a directory."""
    if not src.is_dir():
        return None
    out: list[tuple[str, int]] = []
    for dirpath, _dirs, files in os.walk(src):
        for f in files:
            full = Path(dirpath) / f
            out.append((full.relative_to(src).as_posix(), full.stat().st_size))
    return sorted(out)


async def _all(coros: Iterable[Coroutine[Any, Any, _T]]) -> list[_T]:
    """Run them together; the first failure cancels the rest (no PUT keeps going for an
    upload that already failed) and is raised as itself."""
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(c) for c in coros]
    except BaseExceptionGroup as group:
        first: BaseException = group
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    return [t.result() for t in tasks]


class _LocalReadError(Exception):
    """The local checkpoint could not be read (told apart from S3's errors, some of
    which are OSErrors too)."""


def _read_range(path: Path, offset: int, length: int) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(length)
    except OSError as e:
        raise _LocalReadError(f"{path}: {e.strerror or e}") from None
