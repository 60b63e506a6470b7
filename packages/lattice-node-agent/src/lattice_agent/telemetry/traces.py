"""Debug traces in the log store (spec: Telemetry, "Mode: debug ... Stored to job-specific
S3 path for user analysis"; "Debug traces: Stored to s3://{tenant}/{project}/{job_id}/
telemetry/ with short retention (7 days default, configurable)").

While an allocation is in debug mode the telemetry loop hands every collection's raw
samples (``aggregate.raw_samples``) to :meth:`TraceWriter.offer`; every
``storage.log_flush_interval_seconds`` the writer puts what came as one chunk per
allocation::

    {tenant}/{project}/{alloc}/telemetry/{node}/trace_{N}.ndjson.zst

(zstd JSON lines, one sample each, lattice_common.logstore.encode_trace_chunk; ``zstd -dc
trace_000000.ndjson.zst | jq .``) and updates this node's entry of
``telemetry/metadata.json`` (chunks, samples, first and last timestamp; what the
retention measures the end by once the quorum has forgotten the allocation). The pool is
the logs' (lattice_agent.logship.LogPools): a sensitive allocation's traces are encrypted
in the sensitive pool, or not kept when there is none. The chunk numbers go on from the
store's listing after an agent restart. Samples wait in memory, at most ``max_pending``
per allocation (the oldest dropped and counted) while the store cannot be written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from lattice_common.logstore import (
    LogStore,
    LogStoreError,
    TraceMetadata,
    TraceNodeMeta,
    allocation_root,
    decode_trace_metadata,
    encode_trace_chunk,
    encode_trace_metadata,
    project_of,
    trace_chunk_key,
    trace_chunk_number,
    trace_metadata_key,
)
from lattice_common.types import Allocation
from prometheus_client import Counter

from lattice_agent.logship import POOL_LOCAL, LogPools
from lattice_agent.telemetry.samples import Reading, Sample

log = logging.getLogger("lattice.agent.telemetry.traces")

__all__ = ["TRACE_CHUNKS", "TRACE_DROPPED", "TraceWriter"]

TRACE_CHUNKS = Counter(
    "lattice_agent_trace_chunks_total",
    "Debug-mode trace chunks written to the log store",
    ["node_id"],
)
TRACE_DROPPED = Counter(
    "lattice_agent_trace_samples_dropped_total",
    "Debug-mode samples not written (the store unreachable too long, or no pool for them)",
    ["node_id"],
)


@dataclass
class _Trace:
    root: str  # {tenant}/{project}/{alloc}
    pending: deque[Sample] = field(default_factory=deque)
    next_n: int | None = None  # None: not synced with the store's listing yet
    meta: TraceNodeMeta = field(default_factory=TraceNodeMeta)


class TraceWriter:
    """Writes debug-mode samples of the allocations on this node (module docstring).
    ``allocation(alloc_id)``: the allocation as assigned here (None: not any more)."""

    def __init__(
        self,
        pools: LogPools,
        *,
        node_id: str,
        allocation: Callable[[str], Allocation | None],
        interval: float = 10.0,
        max_pending: int = 100_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.pools = pools
        self.node_id = node_id
        self._allocation = allocation
        self.interval = float(interval)
        self.max_pending = max_pending
        self._clock = clock
        self._traces: dict[str, _Trace] = {}
        self._failures = 0

    def offer(self, reading: Reading, samples: Sequence[Sample]) -> None:
        """One debug-mode collection of one allocation (the telemetry loop's hook)."""
        if not samples:
            return
        tr = self._traces.get(reading.alloc_id)
        if tr is None:
            alloc = self._allocation(reading.alloc_id)
            if alloc is None:
                return
            try:
                root = allocation_root(alloc.spec.tenant, project_of(alloc), alloc.id)
            except ValueError as e:
                log.error("not writing the debug traces of %s: %s", alloc.id, e)
                return
            tr = self._traces[reading.alloc_id] = _Trace(root)
        tr.pending.extend(samples)
        over = len(tr.pending) - self.max_pending
        if over > 0:
            for _ in range(over):
                tr.pending.popleft()
            TRACE_DROPPED.labels(self.node_id).inc(over)

    async def run(self) -> None:
        """Flush every ``interval`` until cancelled; a last bounded flush at the end."""
        try:
            while True:
                await asyncio.sleep(self.interval)
                await self.flush()
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self.flush()), 2.0)

    async def flush(self) -> int:
        """Write what is pending; returns the chunks written."""
        written = 0
        for alloc_id, tr in list(self._traces.items()):
            if not tr.pending:
                if self._allocation(alloc_id) is None:
                    del self._traces[alloc_id]  # ended and written out
                continue
            try:
                pool = await self.pools.pool_of(alloc_id)
                store = self.pools.store(pool)
                if store is None:
                    TRACE_DROPPED.labels(self.node_id).inc(len(tr.pending))
                    if pool == POOL_LOCAL:
                        log.debug("debug traces of %s are not kept (no pool)", alloc_id)
                    tr.pending.clear()
                    continue
                await self._write(store, alloc_id, tr)
                written += 1
                self._failures = 0
            except (LogStoreError, OSError, ValueError) as e:
                self._failures += 1
                if self._failures == 1 or self._failures % 30 == 0:
                    log.warning("writing the debug traces of %s failed: %s", alloc_id, e)
        return written

    async def _write(self, store: LogStore, alloc_id: str, tr: _Trace) -> None:
        if tr.next_n is None:
            prefix = trace_chunk_key(tr.root, self.node_id, 0).rpartition("/")[0] + "/"
            numbers = [trace_chunk_number(k) for k in await store.list(prefix)]
            tr.next_n = max((n for n in numbers if n is not None), default=-1) + 1
            old = decode_trace_metadata(await store.get(trace_metadata_key(tr.root)))
            if old is not None and self.node_id in old.nodes:
                tr.meta = old.nodes[self.node_id]
        batch = list(tr.pending)
        data = encode_trace_chunk((s.name, dict(s.labels), s.value, s.timestamp_ms) for s in batch)
        await store.put(trace_chunk_key(tr.root, self.node_id, tr.next_n), data)
        for _ in range(len(batch)):
            tr.pending.popleft()
        tr.next_n += 1
        TRACE_CHUNKS.labels(self.node_id).inc()
        m = tr.meta
        m.chunks = max(m.chunks, tr.next_n)
        m.samples += len(batch)
        first, last = batch[0].timestamp_ms / 1000, batch[-1].timestamp_ms / 1000
        m.first_ts = first if m.first_ts is None else min(m.first_ts, first)
        m.last_ts = last if m.last_ts is None else max(m.last_ts, last)
        now = self._clock()

        def change(old: bytes | None) -> bytes:
            meta = decode_trace_metadata(old) or TraceMetadata()
            meta.allocation_id = alloc_id
            meta.updated_at = now
            meta.nodes[self.node_id] = m
            return encode_trace_metadata(meta)

        await store.update(trace_metadata_key(tr.root), change)
