"""Log shipping: each allocation's output flushed into the log store as chunks, so that
it outlives this agent and this node (spec: Log Streaming, "S3 persistence").

The workload writes its log files itself (``spawn.py``) and ``logtail.py`` reads them
into the ring buffer, stamping every batch of lines with the time it read them. The
shipper reads the same files again, from the offset it has shipped up to the end of the
last line the ring buffer holds, and writes those lines with the ring buffer's
timestamps (``LogTail.on_batch`` tells it which file offset each timestamp covers; the
same bytes always split into the same lines, ``logtail.split_lines``). Live and stored
output therefore carry identical timestamps, which is how the API joins them without
duplicates. The files are the buffer: a store outage costs no memory, only a backlog
that the next successful flush writes.

* every ``storage.log_flush_interval_seconds`` (sooner once 4 MiB are waiting): one
  chunk per stream with new lines (several when more than ``CHUNK_MAX_BYTES``), then
  this node's entries of ``metadata.json``;
* at the end (``finish``, called by the runtime when the process group is reaped and
  before the end is reported): everything left, the unterminated last line included,
  and ``complete`` in the metadata; bounded by ``final_timeout`` so that a store outage
  never holds back the report (the loop keeps trying);
* the state (per allocation and stream: the file offset shipped, chunks written, lines,
  bytes, index) is written to ``<state file>.logs.json`` after every chunk, so a
  restarted agent resumes exactly there: the runtime starts a recovered allocation's
  ring buffer at that offset, and nothing is shipped twice or skipped. A crash between
  a chunk and the state write re-ships that chunk's bytes under the same number (same
  lines, the same object rewritten).

Sensitive allocations (spec: Sensitive Workloads, "Logs from sensitive allocations are
encrypted at rest in the dedicated sensitive S3 pool") go to the sensitive pool
(``storage.sensitive_log_store``, every object encrypted, lattice_common.logcrypt) and
never to the ordinary store: :class:`LogPools` decides per allocation, before its first
chunk, by asking the quorum whether this node is claimed (sensitive work claims its nodes
when it is assigned, and the claim outlives it). Until the answer is in nothing is
written (the files keep the output); without a sensitive pool a sensitive allocation's
output stays on the node only, said once in the log and counted in
``lattice_agent_log_sensitive_local_total``.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from lattice_common.logstore import (
    CHUNK_MAX_BYTES,
    STREAMS,
    AllocationLogs,
    LogStore,
    LogStoreError,
    StreamMeta,
    allocation_logs,
)
from lattice_common.types import Allocation
from prometheus_client import Counter

from lattice_agent.logtail import LogTail, decode_line, split_lines
from lattice_agent.persist import WriteLater, dump_json, replace_file

log = logging.getLogger("lattice.agent.logs")

__all__ = [
    "POOL_LOCAL",
    "POOL_ORDINARY",
    "POOL_SENSITIVE",
    "LogPools",
    "LogShipper",
    "state_path_for",
]

POOL_ORDINARY = "ordinary"
POOL_SENSITIVE = "sensitive"
POOL_LOCAL = "local"  # kept on the node only

STATE_VERSION = 1

CHUNKS = Counter(
    "lattice_agent_log_chunks_total", "Log chunks written to the log store", ["node_id"]
)
SHIPPED_BYTES = Counter(
    "lattice_agent_log_shipped_bytes_total",
    "Bytes of allocation output written to the log store (before compression)",
    ["node_id"],
)
FLUSH_FAILURES = Counter(
    "lattice_agent_log_flush_failures_total",
    "Log flushes that failed (the store unreachable, ...); retried at the next interval",
    ["node_id"],
)


SENSITIVE_LOCAL = Counter(
    "lattice_agent_log_sensitive_local_total",
    "Sensitive allocations whose output stays on the node (no sensitive log pool configured)",
    ["node_id"],
)


class LogPools:
    """Which store an allocation's output (logs, debug traces) goes to: the ordinary log
    store, the encrypted sensitive pool, or none (``local``). ``classify(alloc_id)``
    answers whether the allocation is sensitive (it raises when it cannot tell yet);
    without it every allocation is ordinary. Answers are kept per allocation."""

    def __init__(
        self,
        ordinary: LogStore | None,
        sensitive: LogStore | None = None,
        *,
        node_id: str = "",
        classify: Callable[[str], Awaitable[bool]] | None = None,
    ) -> None:
        self.ordinary = ordinary
        self.sensitive = sensitive
        self.node_id = node_id
        self._classify = classify
        self._pools: dict[str, str] = {}
        # classifications started ahead (``prefetch``), awaited by the first ``pool_of``
        self._classifying: dict[str, asyncio.Task[bool]] = {}

    def known(self, alloc_id: str) -> str | None:
        return self._pools.get(alloc_id)

    def remember(self, alloc_id: str, pool: str) -> None:
        self._pools[alloc_id] = pool

    def forget(self, alloc_id: str) -> None:
        self._pools.pop(alloc_id, None)
        task = self._classifying.pop(alloc_id, None)
        if task is not None:
            task.cancel()

    def prefetch(self, alloc_id: str) -> None:
        """Start classifying an allocation that has just started, so that its first flush
        (for a short job: the final one, on the way to reporting its end) does not wait
        for the round trip. A failure here is forgotten: ``pool_of`` asks again."""
        if self._classify is None or alloc_id in self._pools or alloc_id in self._classifying:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        task = loop.create_task(self._classify(alloc_id), name=f"classify-{alloc_id}")
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        self._classifying[alloc_id] = task

    async def _sensitive(self, alloc_id: str) -> bool:
        if self._classify is None:
            return False
        task = self._classifying.pop(alloc_id, None)
        if task is not None:
            with contextlib.suppress(Exception):
                return await task
        return await self._classify(alloc_id)

    async def pool_of(self, alloc_id: str) -> str:
        """The allocation's pool (classified once; exceptions of ``classify`` pass)."""
        pool = self._pools.get(alloc_id)
        if pool is not None:
            return pool
        try:
            sensitive = await self._sensitive(alloc_id)
        except Exception as e:  # unknown: nothing is written until it is known
            raise LogStoreError(
                f"cannot tell yet whether allocation {alloc_id} is sensitive "
                f"(its log pool): {e or type(e).__name__}"
            ) from None
        if sensitive:
            pool = POOL_SENSITIVE if self.sensitive is not None else POOL_LOCAL
            if pool == POOL_LOCAL:
                SENSITIVE_LOCAL.labels(self.node_id).inc()
                log.warning(
                    "allocation %s is sensitive and no sensitive log pool is configured "
                    "(storage.sensitive_log_store: none): its output stays on this node only",
                    alloc_id,
                )
        else:
            pool = POOL_ORDINARY if self.ordinary is not None else POOL_LOCAL
        self._pools[alloc_id] = pool
        return pool

    def store(self, pool: str) -> LogStore | None:
        if pool == POOL_SENSITIVE:
            return self.sensitive
        if pool == POOL_ORDINARY:
            return self.ordinary
        return None

    async def close(self) -> None:
        for store in (self.ordinary, self.sensitive):
            if store is not None:
                with contextlib.suppress(Exception):
                    await store.close()


def state_path_for(state_file: Path) -> Path:
    """Where the shipper keeps its state: beside the agent's state file."""
    return state_file.with_name(state_file.stem + ".logs.json")


@dataclass(eq=False)
class _Shipment:
    """One allocation being shipped."""

    alloc_id: str
    logs: AllocationLogs
    paths: dict[str, Path]
    tail: LogTail
    streams: dict[str, StreamMeta]
    #: per stream, in file order: the end offset of each batch the ring buffer read, and
    #: that batch's timestamp
    ends: dict[str, list[int]] = field(default_factory=lambda: {s: [] for s in STREAMS})
    stamps: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in STREAMS})
    pool: str | None = None  # LogPools' answer; None: not asked yet (nothing written)
    resumed: bool = False  # the same run as before an agent restart (not a new run)
    synced: bool = False  # the store's metadata was consulted for the chunk numbers
    final: bool = False  # the allocation has ended: ship everything, then complete
    complete: bool = False
    unpublished: bool = False  # chunks written since the metadata was last published
    failures: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def waiting(self) -> int:
        return sum(self.tail.line_end[s] - self.streams[s].offset for s in STREAMS)


class LogShipper:
    """Flushes the output of every allocation it tracks into ``store`` (or, with
    ``pools``, the store its pool names); see the module docstring. Owns the stores
    (``close`` closes them)."""

    def __init__(
        self,
        store: LogStore | None,
        *,
        node_id: str,
        pools: LogPools | None = None,
        state_path: Path,
        interval: float = 10.0,
        final_timeout: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.pools = pools if pools is not None else LogPools(store, node_id=node_id)
        # the ordinary store; sensitive output goes to self.pools.sensitive
        self.store = self.pools.ordinary
        self.node_id = node_id
        self.state_path = Path(state_path)
        self.interval = float(interval)
        self.final_timeout = float(final_timeout)
        self._clock = clock
        self._ships: dict[str, _Shipment] = {}
        # every allocation's saved state (also the finished ones not yet forgotten)
        self._saved: dict[str, dict[str, Any]] = self._load()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._preparing: set[asyncio.Task[None]] = set()  # _prepare's, while they run
        # a removal (an ended allocation's complete entry) waits for the next save
        self._save_later = WriteLater(self._save)
        self._closed = False

    # ------------------------------------------------------------------ the runtime's hooks

    def track(self, alloc: Allocation, tail: LogTail) -> None:
        """A run of ``alloc`` has started here; its output starts at ``tail.offsets``.
        A requeued run on this node continues the chunk numbers of the earlier one."""
        prev = self._saved.get(alloc.id)
        streams: dict[str, StreamMeta] = {}
        for s in STREAMS:
            sm = _stream_meta((prev or {}).get("streams", {}).get(s))
            sm.offset = tail.offsets.get(s, 0)
            sm.complete = False
            streams[s] = sm
        try:
            # bound to its pool's store at the first flush (LogPools.pool_of)
            logs = allocation_logs(_UNBOUND, alloc)
        except ValueError as e:  # a name that cannot be a key: the files keep the output
            log.error("not shipping the logs of %s: %s", alloc.id, e)
            return
        pool = (prev or {}).get("pool") if prev is not None else None
        if pool is None:
            self.pools.forget(alloc.id)  # a new run is classified afresh
        sh = self._add(alloc.id, logs, tail, streams, resumed=False, pool=pool)
        if sh.pool is None:
            self.pools.prefetch(alloc.id)
        self._prepare(sh)
        self._save()
        log.debug("shipping the logs of %s (%s)", sh.alloc_id, logs.prefix)

    def offsets(self, alloc_id: str) -> dict[str, int] | None:
        """Where a recovered allocation's ring buffer starts: the offsets shipped so far
        (None: nothing saved or already complete; the runtime resumes near the end)."""
        saved = self._saved.get(alloc_id)
        if saved is None or saved.get("complete"):
            return None
        return {s: _stream_meta(saved.get("streams", {}).get(s)).offset for s in STREAMS}

    def resume(self, alloc_id: str, tail: LogTail, *, ended: bool) -> None:
        """A recovered allocation (its tail built from :meth:`offsets`); ``ended``: it
        ended while the agent was away, so its final flush is due at once."""
        saved = self._saved.get(alloc_id)
        if saved is None or saved.get("complete"):
            return
        streams = {s: _stream_meta(saved.get("streams", {}).get(s)) for s in STREAMS}
        try:
            logs = AllocationLogs(_UNBOUND, saved["tenant"], saved["project"], alloc_id)
        except ValueError as e:
            log.error("not shipping the logs of %s: %s", alloc_id, e)
            return
        sh = self._add(alloc_id, logs, tail, streams, resumed=True, pool=saved.get("pool"))
        if ended:
            sh.final = True
            self._wake.set()

    def tracking(self, alloc_id: str) -> bool:
        return alloc_id in self._ships

    async def finish(self, alloc_id: str) -> bool:
        """The final flush of an allocation whose process group is gone and whose tail is
        drained. True when its logs are complete in the store; on a failure or after
        ``final_timeout`` the loop keeps trying."""
        sh = self._ships.get(alloc_id)
        if sh is None:
            return True
        sh.final = True
        try:
            await asyncio.wait_for(self._flush_one(sh), self.final_timeout)
        except TimeoutError:
            log.warning(
                "final log flush of %s to %s took more than %.0fs; retrying in the background",
                alloc_id,
                sh.logs.store.name,
                self.final_timeout,
            )
            return False
        except (LogStoreError, OSError, ValueError) as e:
            self._failed(sh, e)
            return False
        return sh.complete

    def forget(self, alloc_id: str) -> None:
        """The runtime dropped the allocation: its saved state goes once it is complete
        (an incomplete one is still shipped from its files)."""
        saved = self._saved.get(alloc_id)
        if saved is not None and saved.get("complete"):
            del self._saved[alloc_id]
            self._save_later.soon()

    async def flush(self) -> None:
        """One round: every tracked allocation's new output (the loop's body)."""
        for sh in list(self._ships.values()):
            try:
                await self._flush_one(sh)
            except (LogStoreError, OSError, ValueError) as e:
                self._failed(sh, e)

    async def close(self, timeout: float = 2.0) -> None:
        """Stop the loop after a last, bounded flush (the runtime is closing; workloads
        keep running and a restarted agent resumes from the saved offsets)."""
        if self._closed:
            return
        self._closed = True
        task, self._task = self._task, None
        for t in [*self._preparing, *([task] if task is not None else [])]:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._ships:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.flush(), timeout)
        self._save()
        await self.pools.close()

    # ------------------------------------------------------------------ internals

    def _prepare(self, sh: _Shipment) -> None:
        """While the job runs: its pool and the store's chunk numbers, so that its first
        flush (for a short job: the final one, on the way to reporting its end) does
        not wait for those round trips. A failure is left to that flush, which asks
        again and reports it."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        task = loop.create_task(self._ready(sh), name=f"log-prepare-{sh.alloc_id}")
        self._preparing.add(task)
        task.add_done_callback(self._preparing.discard)

    async def _ready(self, sh: _Shipment) -> None:
        async with sh.lock:
            try:
                if sh.pool is None:
                    self._bind(sh, await self.pools.pool_of(sh.alloc_id))
                    self._record(sh)
                if sh.pool != POOL_LOCAL and not sh.synced:
                    await self._sync(sh)
            except (LogStoreError, OSError, ValueError) as e:
                log.debug("logs of %s: preparing the store failed (%s)", sh.alloc_id, e)

    def _add(
        self,
        alloc_id: str,
        logs: AllocationLogs,
        tail: LogTail,
        streams: dict[str, StreamMeta],
        *,
        resumed: bool,
        pool: str | None = None,
    ) -> _Shipment:
        paths = {s: Path(tail.paths[s]) for s in STREAMS}
        sh = _Shipment(alloc_id, logs, paths, tail, streams, resumed=resumed)
        if pool is not None:
            self.pools.remember(alloc_id, pool)
            self._bind(sh, pool)
        self._ships[alloc_id] = sh

        def on_batch(stream: str, end: int, ts: float) -> None:
            sh.ends[stream].append(end)
            sh.stamps[stream].append(ts)
            if sh.waiting() >= CHUNK_MAX_BYTES:
                self._wake.set()  # a full chunk is waiting: do not wait for the interval

        def on_reset(stream: str) -> None:  # the file was truncated: read from its start
            sh.ends[stream].clear()
            sh.stamps[stream].clear()
            sh.streams[stream].offset = 0

        tail.on_batch = on_batch
        tail.on_reset = on_reset
        self._record(sh)
        self._ensure_loop()
        return sh

    def _ensure_loop(self) -> None:
        if self._task is None and not self._closed:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="log-shipper")

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval)
            self._wake.clear()
            try:
                await self.flush()
            except Exception:
                log.exception("log flush round failed")

    async def _sync(self, sh: _Shipment) -> None:
        """Before the first chunk after a start or a restart: the chunk numbers go on
        from what the store has. A resumed run whose published metadata is ahead of the
        saved state (the state file was lost or is older) continues from the metadata,
        file offset included; a resumed run rewrites a chunk that was written but never
        recorded (same bytes, same number); a new run starts after every listed chunk."""
        meta = await sh.logs.metadata()
        listing = {} if sh.resumed else await sh.logs.chunks()
        for s in STREAMS:
            local = sh.streams[s]
            stored = meta.get(s, self.node_id) if meta is not None else None
            if stored is not None and stored.chunks > local.chunks:
                offset = max(local.offset, stored.offset) if sh.resumed else local.offset
                local = msgspec.structs.replace(stored, offset=offset, complete=False)
                sh.streams[s] = local
            numbers = listing.get((s, self.node_id), [])
            if numbers:
                local.chunks = max(local.chunks, numbers[-1] + 1)
        sh.synced = True

    def _bind(self, sh: _Shipment, pool: str) -> None:
        sh.pool = pool
        store = self.pools.store(pool)
        if store is not None:
            sh.logs.store = store

    async def _flush_one(self, sh: _Shipment) -> None:
        async with sh.lock:
            if sh.complete and not sh.unpublished:
                return
            if sh.pool is None:
                # before anything is written: which pool (raises while it cannot tell);
                # saved with the first chunk or the end (a restart before either asks again)
                self._bind(sh, await self.pools.pool_of(sh.alloc_id))
                self._record(sh)
            if sh.pool == POOL_LOCAL:
                # kept on the node: nothing to ship; done once the allocation has ended
                if sh.final:
                    sh.complete = True
                    self._record(sh)
                    self._save()
                    self._ships.pop(sh.alloc_id, None)
                return
            if not sh.synced:
                await self._sync(sh)
            wrote = False
            for s in STREAMS:
                wrote = await self._ship_stream(sh, s) or wrote
            done = sh.final and sh.tail.drained
            if done and all(sh.streams[s].offset >= sh.tail.line_end[s] for s in STREAMS):
                for s in STREAMS:
                    sh.streams[s].complete = True
                sh.complete = True
            if wrote or sh.complete:
                sh.unpublished = True
                self._record(sh)
                self._save()
            if sh.unpublished:
                await sh.logs.publish(self.node_id, sh.streams)
                sh.unpublished = False
            if sh.failures:
                log.info("log flush of %s to %s works again", sh.alloc_id, sh.logs.store.name)
                sh.failures = 0
            if sh.complete:
                self._ships.pop(sh.alloc_id, None)
                log.debug("logs of %s complete in %s", sh.alloc_id, sh.logs.store.name)

    async def _ship_stream(self, sh: _Shipment, s: str) -> bool:
        meta = sh.streams[s]
        target = sh.tail.line_end[s]  # a line end: the ring buffer has every line before it
        wrote = False
        while meta.offset < target:
            want = min(target - meta.offset, CHUNK_MAX_BYTES)
            data = await asyncio.to_thread(_read_range, sh.paths[s], meta.offset, want)
            if not data:
                break  # the file is gone or shorter: nothing more to ship from it
            lines, ends, rest = split_lines(data, final=meta.offset + len(data) >= target)
            consumed = len(data) - len(rest)
            if not lines or consumed <= 0:
                break
            base = meta.offset
            records = [
                (self._stamp(sh, s, base + end), decode_line(raw))
                for raw, end in zip(lines, ends, strict=True)
            ]
            info = await sh.logs.write_chunk(s, self.node_id, meta.chunks, records)
            meta.add(info, consumed)
            CHUNKS.labels(self.node_id).inc()
            SHIPPED_BYTES.labels(self.node_id).inc(consumed)
            self._record(sh)
            self._save()  # the chunk is in: a restart continues after it
            wrote = True
        # timestamps of what is shipped are no longer needed
        keep = bisect.bisect_right(sh.ends[s], meta.offset)
        del sh.ends[s][:keep]
        del sh.stamps[s][:keep]
        return wrote

    def _stamp(self, sh: _Shipment, s: str, end: int) -> float:
        """The ring buffer's timestamp of the line that ends at file offset ``end``."""
        i = bisect.bisect_left(sh.ends[s], end)
        return sh.stamps[s][i] if i < len(sh.stamps[s]) else self._clock()

    def _failed(self, sh: _Shipment, e: BaseException) -> None:
        FLUSH_FAILURES.labels(self.node_id).inc()
        sh.failures += 1
        if sh.failures == 1 or sh.failures % 30 == 0:
            log.warning(
                "log flush of %s failed (%d in a row; retrying every %.0fs): %s",
                sh.alloc_id,
                sh.failures,
                self.interval,
                e,
            )

    # ------------------------------------------------------------------ state file

    def _record(self, sh: _Shipment) -> None:
        self._saved[sh.alloc_id] = {
            "tenant": sh.logs.tenant,
            "project": sh.logs.project,
            "complete": sh.complete,
            "pool": sh.pool,
            "streams": {s: msgspec.to_builtins(sh.streams[s]) for s in STREAMS},
        }

    def _load(self) -> dict[str, dict[str, Any]]:
        try:
            raw = self.state_path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as e:
            log.error("cannot read log shipper state %s: %s", self.state_path, e)
            return {}
        try:
            data = json.loads(raw)
            allocs = data["allocations"]
            if not isinstance(allocs, dict):
                raise TypeError("allocations is not a mapping")
            for v in allocs.values():
                if not isinstance(v, dict) or "tenant" not in v or "project" not in v:
                    raise TypeError("an allocation entry lacks tenant or project")
        except (ValueError, KeyError, TypeError) as e:
            aside = self.state_path.with_name(self.state_path.name + ".corrupt")
            log.error(
                "log shipper state %s unreadable (%s); moved to %s", self.state_path, e, aside
            )
            with contextlib.suppress(OSError):
                os.replace(self.state_path, aside)
            return {}
        return allocs

    def _save(self) -> None:
        self._save_later.done()
        data = {
            "version": STATE_VERSION,
            "node_id": self.node_id,
            "written_at": self._clock(),
            "allocations": self._saved,
        }
        try:
            # Atomic replace, no fsync (as the agent's state file, persist.py): the file
            # exists to survive an agent restart, and the page cache outlives the process.
            # After a machine crash a missing or older file is what _sync already handles:
            # the published metadata is ahead and is continued from.
            replace_file(self.state_path, dump_json(data))
        except OSError as e:
            log.error("cannot write log shipper state %s: %s", self.state_path, e)


class _Unbound:
    """The store of a shipment whose pool is not known yet: never written to."""

    name = "(pool not known yet)"

    async def put(self, key: str, data: bytes) -> None:
        raise LogStoreError(f"{key}: the allocation's log pool is not known yet")

    async def get(self, key: str) -> bytes | None:
        raise LogStoreError(f"{key}: the allocation's log pool is not known yet")

    async def list(self, prefix: str) -> list[str]:
        raise LogStoreError(f"{prefix}: the allocation's log pool is not known yet")

    async def update(self, key: str, change: Callable[[bytes | None], bytes]) -> None:
        raise LogStoreError(f"{key}: the allocation's log pool is not known yet")

    async def delete(self, prefix: str) -> int:
        raise LogStoreError(f"{prefix}: the allocation's log pool is not known yet")

    async def close(self) -> None:
        return None


_UNBOUND: LogStore = _Unbound()


def _stream_meta(d: Any) -> StreamMeta:
    if not d:
        return StreamMeta()
    try:
        return msgspec.convert(d, StreamMeta)
    except msgspec.ValidationError:
        return StreamMeta()


def _read_range(path: Path, start: int, size: int) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(size)
    except OSError:
        return b""
