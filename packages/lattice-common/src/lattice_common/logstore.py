"""The log store: allocation output kept outside the node, so it outlives the agent and
the node (spec: Log Streaming, "S3 persistence").

Why this module exists: the node agent keeps only a ring buffer and the files of the
allocations it runs; a node that is lost takes them along. Agents therefore flush each
allocation's output as compressed, immutable chunks into a store that the API reads
from when the agent cannot answer. Both sides use this module, so the layout, the chunk
format and the metadata are defined once.

Layout (the specification's, one prefix per allocation)::

    {tenant}/{project}/{alloc}/logs/{stdout|stderr}/{node}/chunk_{N}.log.zst
    {tenant}/{project}/{alloc}/logs/metadata.json

``{project}`` is the allocation's project, ``default`` when it has none; ``{N}`` counts
from 0 per stream and node, written with six digits (``chunk_000000.log.zst``, the
specification's ``chunk_000``) so that listings sort. A chunk is never rewritten once
its metadata is published; a chunk is written whole (file system: temporary file and
rename; S3: one PUT), so a reader sees all of it or nothing.

A chunk is zstd-compressed UTF-8 JSON lines, one per line of output, with the time the
agent read the line (the same timestamp the live stream carries, see the agent's
``logtail.py``)::

    {"ts":1767225600.123456,"line":"Epoch 1/100"}

(``zstd -dc chunk_000000.log.zst | jq -r .line`` gives the plain text.)

``metadata.json`` summarises every stream and node: chunk count, bytes and lines stored,
first and last timestamp, whether the node's output is complete (its final flush after
the allocation ended), the offset reached in the node's log file, and a small index
``[N, lines, bytes, first_ts, last_ts]`` per chunk, so that readers skip chunks outside a
``since``/``until`` window and count lines without reading them. Each node rewrites only
its own entries (read, merge, write: under an exclusive lock on the file system, with a
conditional PUT on S3 where the server supports it); the chunk listing stays the
authority on which chunks exist.

Backends (:class:`LogStore` is the protocol): :class:`FsLogStore` (a directory, the
default; shared storage when the API and the agents are on different machines) and
:class:`S3LogStore` (any S3-compatible service through aiobotocore; credentials are
secret references in the configuration, resolved like every other secret).
:func:`open_log_store` builds the configured one from ``storage``.

Debug traces (spec: Telemetry, "Debug traces: Stored to
s3://{tenant}/{project}/{job_id}/telemetry/"): while an allocation is in debug telemetry
mode its agents write the raw 1 s samples beside its logs::

    {tenant}/{project}/{alloc}/telemetry/{node}/trace_{N}.ndjson.zst
    {tenant}/{project}/{alloc}/telemetry/metadata.json

a trace chunk being zstd-compressed JSON lines, one sample each
(``{"name":"cpu_utilization","labels":{...},"value":0.93,"ts_ms":1767225600000}``), and
``metadata.json`` per node the chunk count, sample count and first/last timestamp.

Sensitive allocations (spec: Sensitive Workloads, "Logs from sensitive allocations are
encrypted at rest in the dedicated sensitive S3 pool") have their logs and traces in a
second store of the same layout, ``storage.sensitive_log_store``
(lattice_common.logcrypt.open_sensitive_log_store), every object of which is encrypted
(lattice_common.logcrypt.EncryptedLogStore). Retention (``storage.log_retention_days``,
``debug_trace_retention_days``, ``sensitive_log_retention_days``) deletes an ended
allocation's prefix whole (:meth:`LogStore.delete`; lattice_api.log_retention).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import heapq
import logging
import os
import re
import secrets
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import zstandard

_log = logging.getLogger("lattice.logstore")

if TYPE_CHECKING:
    from lattice_common.config import StorageConfig
    from lattice_common.types import Allocation

__all__ = [
    "CHUNK_MAX_BYTES",
    "DEFAULT_PROJECT",
    "STREAMS",
    "AllocationLogs",
    "ChunkInfo",
    "FsLogStore",
    "LogMetadata",
    "LogRead",
    "LogStore",
    "LogStoreError",
    "S3LogStore",
    "SeqEnd",
    "StoredLine",
    "StreamMeta",
    "TraceMetadata",
    "TraceNodeMeta",
    "after",
    "allocation_logs",
    "allocation_root",
    "decode_chunk",
    "decode_metadata",
    "decode_trace_chunk",
    "encode_chunk",
    "encode_trace_chunk",
    "open_log_store",
    "project_of",
    "trace_chunk_key",
    "trace_chunk_number",
    "trace_metadata_key",
]

STREAMS = ("stdout", "stderr")
DEFAULT_PROJECT = "default"
#: uncompressed bytes of output per chunk at most (a flush with more writes several)
CHUNK_MAX_BYTES = 4 << 20
METADATA_VERSION = 1
_ZSTD_LEVEL = 3
_CHUNK_RE = re.compile(r"chunk_(\d+)\.log\.zst")
_STREAM_ORDER = {s: i for i, s in enumerate(STREAMS)}


class LogStoreError(Exception):
    """The store could not be read or written; the message names the store and the key,
    never a credential."""


# --------------------------------------------------------------------------- chunks


class _ChunkLine(msgspec.Struct):
    ts: float
    line: str


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(_ChunkLine)


def encode_chunk(lines: Iterable[tuple[float, str]]) -> bytes:
    """``(timestamp, text)`` pairs as one compressed chunk."""
    raw = _ENCODER.encode_lines([_ChunkLine(float(ts), text) for ts, text in lines])
    return zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(raw)


def decode_chunk(data: bytes) -> list[tuple[float, str]]:
    """The ``(timestamp, text)`` pairs of a chunk; ValueError when it is not one."""
    try:
        raw = zstandard.ZstdDecompressor().decompressobj().decompress(data)
        return [(r.ts, r.line) for r in _DECODER.decode_lines(raw)]
    except (zstandard.ZstdError, msgspec.DecodeError) as e:
        raise ValueError(f"not a log chunk: {e}") from None


def _text_bytes(lines: Sequence[tuple[float, str]]) -> int:
    return sum(len(text.encode("utf-8", "surrogatepass")) + 1 for _, text in lines)


# --------------------------------------------------------------------------- metadata


class ChunkInfo(msgspec.Struct, array_like=True, frozen=True):
    """One chunk in the metadata index: ``[N, lines, bytes, first_ts, last_ts]``."""

    n: int
    lines: int
    bytes: int
    first_ts: float | None = None
    last_ts: float | None = None


class StreamMeta(msgspec.Struct, kw_only=True):
    """One stream of one node: what its chunks hold."""

    chunks: int = 0  # chunks written; the next one is chunk_{chunks}
    bytes: int = 0  # UTF-8 bytes of the stored lines, one newline each
    lines: int = 0
    first_ts: float | None = None
    last_ts: float | None = None
    complete: bool = False  # the node's final flush after the allocation ended is in
    offset: int = 0  # bytes of the node's log file shipped so far (agents resume here)
    index: list[ChunkInfo] = msgspec.field(default_factory=list)

    def add(self, info: ChunkInfo, consumed: int) -> None:
        self.chunks = max(self.chunks, info.n + 1)
        self.lines += info.lines
        self.bytes += info.bytes
        if info.first_ts is not None and self.first_ts is None:
            self.first_ts = info.first_ts
        if info.last_ts is not None:
            self.last_ts = info.last_ts
        self.offset += consumed
        self.index.append(info)


class LogMetadata(msgspec.Struct, kw_only=True):
    """``metadata.json``: ``streams[stream][node]``."""

    version: int = METADATA_VERSION
    allocation_id: str = ""
    tenant: str = ""
    project: str = ""
    updated_at: float = 0.0
    streams: dict[str, dict[str, StreamMeta]] = msgspec.field(default_factory=dict)

    def get(self, stream: str, node: str) -> StreamMeta | None:
        return self.streams.get(stream, {}).get(node)


def decode_metadata(data: bytes | None) -> LogMetadata | None:
    """``metadata.json`` (None: absent or unreadable)."""
    if not data:
        return None
    try:
        return msgspec.json.decode(data, type=LogMetadata)
    except msgspec.DecodeError:
        return None  # unreadable: rebuilt from the writers' state at their next flush


# --------------------------------------------------------------------------- keys


def _component(name: str, what: str) -> str:
    """One path component of a key: quoted so that no name can leave its folder."""
    if not name or name in (".", ".."):
        raise ValueError(f"log store: {what} {name!r} cannot name a folder")
    return urllib.parse.quote(name, safe="-_.@+=,:~")


def allocation_root(tenant: str, project: str, allocation_id: str) -> str:
    """``{tenant}/{project}/{alloc}``: the prefix of everything kept for an allocation."""
    return "/".join(
        (
            _component(tenant or "default", "tenant"),
            _component(project or DEFAULT_PROJECT, "project"),
            _component(allocation_id, "allocation id"),
        )
    )


def project_of(alloc: Allocation) -> str:
    """The ``{project}`` of an allocation's logs: its project, else ``default``."""
    return alloc.spec.project or DEFAULT_PROJECT


def allocation_logs(store: LogStore, alloc: Allocation) -> AllocationLogs:
    return AllocationLogs(store, alloc.spec.tenant, project_of(alloc), alloc.id)


# --------------------------------------------------------------------------- the protocol


class LogStore(Protocol):
    """Where log chunks and metadata are kept: whole objects under ``/``-separated keys."""

    name: str  # for messages: the directory or s3://bucket

    async def put(self, key: str, data: bytes) -> None:
        """Write an object whole (readers see the old or the new one, never a part)."""
        ...

    async def get(self, key: str) -> bytes | None:
        """An object, None when it does not exist."""
        ...

    async def list(self, prefix: str) -> list[str]:
        """Every key that starts with ``prefix``, sorted."""
        ...

    async def update(self, key: str, change: Callable[[bytes | None], bytes]) -> None:
        """Read, change and write an object so that concurrent updaters do not lose
        each other's changes (as far as the backend allows)."""
        ...

    async def delete(self, prefix: str) -> int:
        """Delete every object whose key starts with ``prefix``; returns how many."""
        ...

    async def close(self) -> None: ...


# --------------------------------------------------------------------------- file system


class FsLogStore:
    """Objects as files under ``root`` (created on the first write)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).absolute()
        self.name = str(self.root)

    def _path(self, key: str) -> Path:
        parts = key.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"log store: bad key {key!r}")
        return self.root.joinpath(*parts)

    def _put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise

    def _get(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _list(self, prefix: str) -> list[str]:
        # the deepest folder the prefix names completely, then filter by the prefix
        head, _, _ = prefix.rpartition("/")
        base = self._path(head) if head else self.root
        out: list[str] = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for fn in filenames:
                if fn.startswith("."):
                    continue  # a write in progress
                key = fn if rel == "." else f"{rel}/{fn}"
                if key.startswith(prefix):
                    out.append(key)
        return sorted(out)

    def _update(self, key: str, change: Callable[[bytes | None], bytes]) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        # the lock is on the folder: the file itself is replaced by every write
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._put(key, change(self._get(key)))
        finally:
            os.close(fd)  # releases the lock

    def _delete(self, prefix: str) -> int:
        n = 0
        for key in self._list(prefix):
            with contextlib.suppress(FileNotFoundError):
                self._path(key).unlink()
                n += 1
        # the folders that held only what was deleted go too (never the root)
        head, _, _ = prefix.rpartition("/")
        base = self._path(head) if head else self.root
        for dirpath, _dirs, _files in sorted(os.walk(base), key=lambda w: -len(w[0])):
            p = Path(dirpath)
            while p != self.root and p.is_relative_to(self.root):
                try:
                    p.rmdir()
                except OSError:
                    break
                p = p.parent
        return n

    async def _run(self, what: str, key: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return await asyncio.to_thread(fn, *args)
        except OSError as e:
            raise LogStoreError(
                f"log store {self.name}: cannot {what} {key}: {e.strerror or e}"
            ) from None

    async def put(self, key: str, data: bytes) -> None:
        await self._run("write", key, self._put, key, data)

    async def get(self, key: str) -> bytes | None:
        return await self._run("read", key, self._get, key)

    async def list(self, prefix: str) -> list[str]:
        return await self._run("list", prefix, self._list, prefix)

    async def update(self, key: str, change: Callable[[bytes | None], bytes]) -> None:
        await self._run("update", key, self._update, key, change)

    async def delete(self, prefix: str) -> int:
        return await self._run("delete", prefix, self._delete, prefix)

    async def close(self) -> None:
        return None


# --------------------------------------------------------------------------- S3


class S3LogStore:
    """Objects in an S3 bucket (aiobotocore). Empty credentials: botocore's own chain
    (``AWS_ACCESS_KEY_ID``, instance profiles, ...). One client, opened on first use in
    the event loop that uses it; ``close()`` ends it."""

    def __init__(
        self,
        *,
        bucket: str,
        endpoint_url: str = "",
        region: str = "",
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        key_prefix: str = "",
        connect_timeout: float = 5.0,
        read_timeout: float = 30.0,
        server_side_encryption: bool = False,
    ) -> None:
        if not bucket:
            raise ValueError("log store: S3 needs a bucket (storage.log_bucket)")
        self.bucket = bucket
        self.endpoint_url = endpoint_url or None
        self.region = region or None
        self._access_key_id = access_key_id or None
        self._secret_access_key = secret_access_key or None
        self.key_prefix = key_prefix.strip("/") + "/" if key_prefix.strip("/") else ""
        self.name = f"s3://{bucket}" + (f" at {endpoint_url}" if endpoint_url else "")
        self._timeouts = (connect_timeout, read_timeout)
        self._client: Any = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._lock: asyncio.Lock | None = None
        # ask the server to encrypt too (SSE-S3, AES256) while it accepts the request;
        # a server that refuses it is told once and then written to without it
        self._sse = server_side_encryption

    def _put_args(self) -> dict[str, Any]:
        return {"ServerSideEncryption": "AES256"} if self._sse else {}

    def _sse_refused(self, e: Exception) -> bool:
        if not self._sse or _error_code(e) not in ("NotImplemented", "501", "InvalidArgument"):
            return False
        self._sse = False
        _log.warning(
            "log store %s: the server refuses server-side encryption (%s); objects are "
            "still encrypted by Lattice",
            self.name,
            _error_code(e),
        )
        return True

    async def _s3(self) -> Any:
        if self._client is not None:
            return self._client
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._client is None:
                from aiobotocore.config import AioConfig
                from aiobotocore.session import get_session

                stack = contextlib.AsyncExitStack()
                cfg = AioConfig(
                    connect_timeout=self._timeouts[0],
                    read_timeout=self._timeouts[1],
                    retries={"max_attempts": 3, "mode": "standard"},
                    # S3-compatible servers (and moto) want path-style addressing
                    s3={"addressing_style": "path"},
                )
                self._client = await stack.enter_async_context(
                    get_session().create_client(
                        "s3",
                        endpoint_url=self.endpoint_url,
                        region_name=self.region or "us-east-1",
                        aws_access_key_id=self._access_key_id,
                        aws_secret_access_key=self._secret_access_key,
                        config=cfg,
                    )
                )
                self._stack = stack
        return self._client

    def _error(self, what: str, key: str, e: Exception) -> LogStoreError:
        code = _error_code(e)
        why = f"{code}: {_error_message(e)}" if code else (str(e) or type(e).__name__)
        return LogStoreError(f"log store {self.name}: cannot {what} {key}: {why}")

    async def put(self, key: str, data: bytes) -> None:
        s3 = await self._s3()
        try:
            await s3.put_object(
                Bucket=self.bucket, Key=self.key_prefix + key, Body=data, **self._put_args()
            )
        except Exception as e:
            if self._sse_refused(e):
                return await self.put(key, data)
            raise self._error("write", key, e) from None

    async def _get(self, key: str) -> tuple[bytes, str] | None:
        s3 = await self._s3()
        try:
            resp = await s3.get_object(Bucket=self.bucket, Key=self.key_prefix + key)
            async with resp["Body"] as body:
                return await body.read(), resp.get("ETag", "")
        except Exception as e:
            if _error_code(e) in ("NoSuchKey", "404", "NotFound"):
                return None
            raise self._error("read", key, e) from None

    async def get(self, key: str) -> bytes | None:
        got = await self._get(key)
        return None if got is None else got[0]

    async def list(self, prefix: str) -> list[str]:
        s3 = await self._s3()
        out: list[str] = []
        try:
            pages = s3.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.key_prefix + prefix
            )
            async for page in pages:
                out += [o["Key"][len(self.key_prefix) :] for o in page.get("Contents", [])]
        except Exception as e:
            raise self._error("list", prefix, e) from None
        return sorted(out)

    async def update(self, key: str, change: Callable[[bytes | None], bytes]) -> None:
        """Conditional PUT (If-Match the ETag read, If-None-Match for a new object),
        retried on a conflict; servers without conditional writes get a plain PUT."""
        s3 = await self._s3()
        for _ in range(5):
            got = await self._get(key)
            data = change(None if got is None else got[0])
            cond = {"IfNoneMatch": "*"} if got is None else {"IfMatch": got[1]}
            try:
                await s3.put_object(
                    Bucket=self.bucket,
                    Key=self.key_prefix + key,
                    Body=data,
                    **cond,
                    **self._put_args(),
                )
                return
            except Exception as e:
                if self._sse_refused(e):
                    continue
                code = _error_code(e)
                if code in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409"):
                    continue  # someone else wrote it first: read again
                if code in ("NotImplemented", "501", "InvalidArgument") or isinstance(e, TypeError):
                    await self.put(key, data)  # no conditional writes here
                    return
                raise self._error("update", key, e) from None
        raise LogStoreError(f"log store {self.name}: {key} keeps changing under us")

    async def delete(self, prefix: str) -> int:
        """DeleteObjects in batches of 1000 (the S3 limit) over the listing."""
        keys = await self.list(prefix)
        s3 = await self._s3()
        n = 0
        for i in range(0, len(keys), 1000):
            batch = keys[i : i + 1000]
            try:
                resp = await s3.delete_objects(
                    Bucket=self.bucket,
                    Delete={
                        "Objects": [{"Key": self.key_prefix + k} for k in batch],
                        "Quiet": True,
                    },
                )
            except Exception as e:
                raise self._error("delete", prefix, e) from None
            errors = resp.get("Errors") or []
            if errors:
                first = errors[0]
                raise LogStoreError(
                    f"log store {self.name}: cannot delete {first.get('Key', prefix)}: "
                    f"{first.get('Code', '')}: {first.get('Message', '')}"
                )
            n += len(batch)
        return n

    async def create_bucket(self) -> None:
        """Create the bucket if it does not exist (tests and dev clusters)."""
        s3 = await self._s3()
        try:
            await s3.create_bucket(Bucket=self.bucket)
        except Exception as e:
            if _error_code(e) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise self._error("create bucket", self.bucket, e) from None

    async def close(self) -> None:
        stack, self._stack, self._client = self._stack, None, None
        if stack is not None:
            await stack.aclose()


def _error_code(e: Exception) -> str:
    resp = getattr(e, "response", None)
    if isinstance(resp, dict):
        return str(resp.get("Error", {}).get("Code", "") or "")
    return ""


def _error_message(e: Exception) -> str:
    resp = getattr(e, "response", None)
    if isinstance(resp, dict):
        return str(resp.get("Error", {}).get("Message", "") or "")
    return str(e)


# --------------------------------------------------------------------------- reading


class StoredLine(msgspec.Struct, frozen=True):
    """One stored line: ``offset`` is its line number (from 0) in its stream and node."""

    stream: str
    node_id: str
    offset: int
    timestamp: float
    line: str

    def to_dict(self, allocation_id: str) -> dict[str, Any]:
        """The wire form (proto ``LogLine``)."""
        return {
            "allocation_id": allocation_id,
            "node_id": self.node_id,
            "stream": self.stream,
            "line": self.line,
            "timestamp": self.timestamp,
        }


@dataclass(frozen=True)
class SeqEnd:
    """Where one stream of one node ends in the store: its line count, the timestamp of
    its last line and how many of its last lines carry that timestamp (what a reader
    that continues from live output skips)."""

    lines: int
    last_ts: float | None
    at_last_ts: int


@dataclass
class LogRead:
    """What :meth:`AllocationLogs.read` found."""

    lines: list[StoredLine] = field(default_factory=list)
    #: (stream, node) -> where it ends in the store (every selected stream and node)
    ends: dict[tuple[str, str], SeqEnd] = field(default_factory=dict)
    #: every selected stream and node has had its final flush (and there is one)
    complete: bool = False
    #: the store holds something for this allocation
    found: bool = False


class AllocationLogs:
    """One allocation's logs in a store: its keys, the writer's operations (chunks and
    this node's metadata) and the reader's."""

    def __init__(self, store: LogStore, tenant: str, project: str, allocation_id: str) -> None:
        self.store = store
        self.tenant = tenant or "default"
        self.project = project or DEFAULT_PROJECT
        self.allocation_id = allocation_id
        self.prefix = allocation_root(self.tenant, self.project, allocation_id) + "/logs"

    # --- keys ------------------------------------------------------------------------

    @property
    def metadata_key(self) -> str:
        return f"{self.prefix}/metadata.json"

    def chunk_key(self, stream: str, node: str, n: int) -> str:
        if stream not in STREAMS:
            raise ValueError(f"stream must be stdout or stderr, not {stream!r}")
        return f"{self.prefix}/{stream}/{_component(node, 'node')}/chunk_{n:06d}.log.zst"

    def _parse_key(self, key: str) -> tuple[str, str, int] | None:
        rest = key[len(self.prefix) + 1 :].split("/")
        if len(rest) != 3 or rest[0] not in STREAMS:
            return None
        m = _CHUNK_RE.fullmatch(rest[2])
        if m is None:
            return None
        return rest[0], urllib.parse.unquote(rest[1]), int(m.group(1))

    # --- writing ---------------------------------------------------------------------

    async def write_chunk(
        self, stream: str, node: str, n: int, lines: Sequence[tuple[float, str]]
    ) -> ChunkInfo:
        """Write chunk ``n`` of a stream and node; returns its index entry."""
        await self.store.put(self.chunk_key(stream, node, n), encode_chunk(lines))
        return ChunkInfo(
            n=n,
            lines=len(lines),
            bytes=_text_bytes(lines),
            first_ts=lines[0][0] if lines else None,
            last_ts=lines[-1][0] if lines else None,
        )

    async def publish(self, node: str, streams: Mapping[str, StreamMeta]) -> None:
        """Put this node's entries into ``metadata.json`` (other nodes' are kept)."""

        def change(old: bytes | None) -> bytes:
            meta = decode_metadata(old) or LogMetadata()
            meta.allocation_id = self.allocation_id
            meta.tenant = self.tenant
            meta.project = self.project
            meta.updated_at = time.time()
            for stream, sm in streams.items():
                meta.streams.setdefault(stream, {})[node] = sm
            return msgspec.json.format(msgspec.json.encode(meta), indent=1)

        await self.store.update(self.metadata_key, change)

    # --- reading ---------------------------------------------------------------------

    async def metadata(self) -> LogMetadata | None:
        return decode_metadata(await self.store.get(self.metadata_key))

    async def chunks(self) -> dict[tuple[str, str], list[int]]:
        """(stream, node) -> its chunk numbers, ascending, from the listing."""
        out: dict[tuple[str, str], list[int]] = {}
        for key in await self.store.list(self.prefix + "/"):
            parsed = self._parse_key(key)
            if parsed is not None:
                out.setdefault(parsed[:2], []).append(parsed[2])
        for ns in out.values():
            ns.sort()
        return out

    async def read(
        self,
        *,
        stream: str = "both",
        node: str | None = None,
        since: float | None = None,
        until: float | None = None,
        tail: int | None = None,
        from_ts: Mapping[tuple[str, str], float] | None = None,
    ) -> LogRead:
        """The stored lines of ``stream`` (stdout, stderr, both) and ``node`` (None: all)
        whose timestamp is within [since, until], merged in time order; with ``tail``
        only the last ``tail`` of them; ``from_ts`` raises ``since`` per (stream, node)
        (a reader that continues where it got to). Chunks outside the window or before
        the tail are not read when the metadata index says what they hold."""
        if stream not in ("both", *STREAMS):
            raise ValueError(f"stream must be stdout, stderr or both, not {stream!r}")
        meta = await self.metadata()
        listing = await self.chunks()
        seqs = set(listing)
        if meta is not None:
            seqs |= {(s, n) for s, nodes in meta.streams.items() for n in nodes}
        seqs = {
            (s, n)
            for s, n in seqs
            if s in STREAMS and stream in ("both", s) and node in (None, "", n)
        }
        out = LogRead(found=bool(seqs))
        out.complete = bool(seqs) and all(
            (sm := meta.get(s, n) if meta else None) is not None and sm.complete for s, n in seqs
        )
        per_seq: list[list[StoredLine]] = []
        for s, n in sorted(seqs, key=lambda sn: (_STREAM_ORDER[sn[0]], sn[1])):
            sm = meta.get(s, n) if meta else None
            seq = _Sequence(self, s, n, listing.get((s, n), []), sm)
            lower = (from_ts or {}).get((s, n))
            if lower is not None and (since is None or lower > since):
                lines, end = await seq.read(since=lower, until=until, tail=tail)
            else:
                lines, end = await seq.read(since=since, until=until, tail=tail)
            out.ends[(s, n)] = end
            per_seq.append(lines)
        merged = list(
            heapq.merge(
                *per_seq,
                key=lambda ln: (ln.timestamp, _STREAM_ORDER[ln.stream], ln.node_id, ln.offset),
            )
        )
        if tail is not None:
            merged = merged[-tail:] if tail > 0 else []
        out.lines = merged
        return out


class _Sequence:
    """One stream of one node while it is read: its chunks, decoded at most once."""

    def __init__(
        self,
        logs: AllocationLogs,
        stream: str,
        node: str,
        numbers: list[int],
        meta: StreamMeta | None,
    ) -> None:
        self.logs = logs
        self.stream = stream
        self.node = node
        self.numbers = numbers
        self.index = {c.n: c for c in meta.index} if meta is not None else {}
        self._decoded: dict[int, list[tuple[float, str]]] = {}

    async def lines_of(self, n: int) -> list[tuple[float, str]]:
        got = self._decoded.get(n)
        if got is None:
            data = await self.logs.store.get(self.logs.chunk_key(self.stream, self.node, n))
            if data is None:
                got = []  # listed, then removed (retention): nothing to show
            else:
                try:
                    got = decode_chunk(data)
                except ValueError as e:
                    key = self.logs.chunk_key(self.stream, self.node, n)
                    raise LogStoreError(f"log store {self.logs.store.name}: {key}: {e}") from None
            self._decoded[n] = got
        return got

    async def count(self, n: int) -> int:
        info = self.index.get(n)
        return info.lines if info is not None else len(await self.lines_of(n))

    def _outside(self, n: int, since: float | None, until: float | None) -> bool:
        info = self.index.get(n)
        if info is None or info.first_ts is None or info.last_ts is None:
            return False
        return (since is not None and info.last_ts < since) or (
            until is not None and info.first_ts > until
        )

    async def end(self) -> SeqEnd:
        total = 0
        for n in self.numbers:
            total += await self.count(n)
        last_ts: float | None = None
        at_last = 0
        for n in reversed(self.numbers):
            lines = await self.lines_of(n)
            for ts, _ in reversed(lines):
                if last_ts is None:
                    last_ts = ts
                if ts != last_ts:
                    return SeqEnd(total, last_ts, at_last)
                at_last += 1
        return SeqEnd(total, last_ts, at_last)

    async def read(
        self, *, since: float | None, until: float | None, tail: int | None
    ) -> tuple[list[StoredLine], SeqEnd]:
        numbers = self.numbers
        first = 0
        if tail is not None:
            # from the end back until enough lines are in the window
            got = 0
            first = len(numbers)
            while first > 0 and got < tail:
                first -= 1
                n = numbers[first]
                if self._outside(n, since, until):
                    continue
                got += sum(1 for ts, _ in await self.lines_of(n) if _within(ts, since, until))
        offset = 0
        for n in numbers[:first]:
            offset += await self.count(n)
        out: list[StoredLine] = []
        for n in numbers[first:]:
            if self._outside(n, since, until):
                offset += await self.count(n)
                continue
            for ts, text in await self.lines_of(n):
                if _within(ts, since, until):
                    out.append(StoredLine(self.stream, self.node, offset, ts, text))
                offset += 1
        if tail is not None:
            out = out[-tail:] if tail > 0 else []
        return out, await self.end()


def _within(ts: float, since: float | None, until: float | None) -> bool:
    return (since is None or ts >= since) and (until is None or ts <= until)


def after(end: SeqEnd | None, ts: float, seen_at_ts: int) -> bool:
    """Whether a line with timestamp ``ts`` (the ``seen_at_ts``-th, from 1, of the lines
    with that timestamp in its stream) comes after ``end``: the join of stored history and
    live output, which carry the same timestamps."""
    if end is None or end.last_ts is None:
        return True
    if ts != end.last_ts:
        return ts > end.last_ts
    return seen_at_ts > end.at_last_ts


# --------------------------------------------------------------------------- debug traces


class _TraceSample(msgspec.Struct):
    name: str
    labels: dict[str, str]
    value: float
    ts_ms: int


_TRACE_DECODER = msgspec.json.Decoder(_TraceSample)
_TRACE_RE = re.compile(r"trace_(\d+)\.ndjson\.zst")


def encode_trace_chunk(samples: Iterable[tuple[str, Mapping[str, str], float, int]]) -> bytes:
    """``(name, labels, value, ts_ms)`` samples as one compressed trace chunk."""
    raw = _ENCODER.encode_lines(
        [_TraceSample(n, dict(lb), float(v), int(ts)) for n, lb, v, ts in samples]
    )
    return zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(raw)


def decode_trace_chunk(data: bytes) -> list[tuple[str, dict[str, str], float, int]]:
    """The samples of a trace chunk; ValueError when it is not one."""
    try:
        raw = zstandard.ZstdDecompressor().decompressobj().decompress(data)
        return [(r.name, r.labels, r.value, r.ts_ms) for r in _TRACE_DECODER.decode_lines(raw)]
    except (zstandard.ZstdError, msgspec.DecodeError) as e:
        raise ValueError(f"not a trace chunk: {e}") from None


def trace_chunk_key(root: str, node: str, n: int) -> str:
    return f"{root}/telemetry/{_component(node, 'node')}/trace_{n:06d}.ndjson.zst"


def trace_metadata_key(root: str) -> str:
    return f"{root}/telemetry/metadata.json"


def trace_chunk_number(key: str) -> int | None:
    m = _TRACE_RE.fullmatch(key.rpartition("/")[2])
    return int(m.group(1)) if m else None


class TraceNodeMeta(msgspec.Struct, kw_only=True):
    chunks: int = 0
    samples: int = 0
    first_ts: float | None = None
    last_ts: float | None = None


class TraceMetadata(msgspec.Struct, kw_only=True):
    """``telemetry/metadata.json``: what each node's trace chunks hold."""

    version: int = METADATA_VERSION
    allocation_id: str = ""
    updated_at: float = 0.0
    nodes: dict[str, TraceNodeMeta] = msgspec.field(default_factory=dict)


def decode_trace_metadata(data: bytes | None) -> TraceMetadata | None:
    if not data:
        return None
    try:
        return msgspec.json.decode(data, type=TraceMetadata)
    except msgspec.DecodeError:
        return None


def encode_trace_metadata(meta: TraceMetadata) -> bytes:
    return msgspec.json.format(msgspec.json.encode(meta), indent=1)


# --------------------------------------------------------------------------- config


def open_log_store(storage: StorageConfig) -> LogStore | None:
    """The store ``storage`` configures (None: ``log_store: none``)."""
    kind = storage.log_store
    if kind == "none":
        return None
    if kind == "s3":
        key_id = storage.s3_access_key_id
        secret = storage.s3_secret_access_key
        return S3LogStore(
            bucket=storage.log_bucket,
            endpoint_url=storage.s3_endpoint,
            region=storage.s3_region,
            access_key_id=key_id.get_secret_value() if key_id else None,
            secret_access_key=secret.get_secret_value() if secret else None,
        )
    return FsLogStore(storage.log_store_dir)
