"""Log retention: the quorum leader deletes from the log stores what ended longer ago
than its retention (spec: Data Retention, "Logs | S3 | Configurable (default: 30
days)", "Debug traces | S3 | Short (default: 7 days)"; Observability, "Historical Log
Access ... subject to retention policy"; Sensitive Workloads, "Log retention matches the
allocation's sensitive data retention policy, not the default log retention").

What is kept how long (``storage.*``, days; 0 = forever):

* the ordinary store: logs ``log_retention_days`` (30), debug traces
  ``debug_trace_retention_days`` (7);
* the sensitive pool: logs and traces ``sensitive_log_retention_days`` (the sensitive
  data retention policy; default 7 years, the regulatory audit retention, since the
  specification leaves the data period to the user and names no default).

When an allocation ended: its ``finished_at`` in the quorum while the quorum still holds
it; once it is gone from there (moved to the history), the last time its output was
written (the ``metadata.json`` beside the chunks: its last timestamps and its last
update). An allocation the quorum holds that has not ended, or whose end is unknown
(held but no end time, no readable metadata), is never touched. A prefix is deleted
whole (``{tenant}/{project}/{alloc}/logs/`` or ``.../telemetry/``), metadata last
written by nobody any more; each deletion is logged and counted
(``lattice_log_retention_deleted_total{pool,kind}``, objects).

:class:`LogRetention` runs in every lattice-server and sweeps only while its member is the
leader, every ``storage.log_retention_interval_seconds`` (1 h). :func:`removed_message`
is what ``lattice logs`` says for an allocation whose logs the policy removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from lattice_common.logstore import (
    LogStore,
    LogStoreError,
    decode_metadata,
    decode_trace_metadata,
    trace_metadata_key,
)
from lattice_common.types import Allocation
from lattice_quorum import queries
from lattice_quorum.quorum import Quorum
from prometheus_client import Counter

if TYPE_CHECKING:
    from lattice_common.config import StorageConfig

log = logging.getLogger("lattice.api.log_retention")

__all__ = [
    "DELETED",
    "KINDS",
    "POOLS",
    "LogRetention",
    "RetentionPolicy",
    "Stored",
    "due",
    "removed_message",
]

DELETED = Counter(
    "lattice_log_retention_deleted_total",
    "Objects deleted from the log stores by the retention policy",
    ["pool", "kind"],
)

POOLS = ("ordinary", "sensitive")
KINDS = ("logs", "telemetry")
DAY = 86400.0


@dataclass(frozen=True)
class RetentionPolicy:
    """Days each kind of output is kept after its allocation ended (0: forever)."""

    log_days: float = 30.0
    trace_days: float = 7.0
    sensitive_days: float = 2557.0

    @classmethod
    def from_storage(cls, storage: StorageConfig) -> RetentionPolicy:
        return cls(
            log_days=storage.log_retention_days,
            trace_days=storage.debug_trace_retention_days,
            sensitive_days=storage.sensitive_log_retention_days,
        )

    def days(self, pool: str, kind: str) -> float:
        if pool == "sensitive":
            return self.sensitive_days
        return self.trace_days if kind == "telemetry" else self.log_days

    def setting(self, pool: str, kind: str) -> str:
        """The configuration key behind :meth:`days` (for messages)."""
        if pool == "sensitive":
            return "storage.sensitive_log_retention_days"
        if kind == "telemetry":
            return "storage.debug_trace_retention_days"
        return "storage.log_retention_days"


@dataclass(frozen=True)
class Stored:
    """One allocation's logs or traces in one store."""

    pool: str
    kind: str
    root: str  # {tenant}/{project}/{alloc}
    allocation_id: str

    @property
    def prefix(self) -> str:
        return f"{self.root}/{self.kind}/"


def due(
    alloc: Allocation | None,
    stored_end: float | None,
    days: float,
    now: float,
) -> tuple[bool, float | None]:
    """Whether output is past its retention, and the end it was measured from. ``alloc``:
    the quorum's allocation (None: not held there any more); ``stored_end``: the last
    write the store's metadata records (None: none readable)."""
    if days <= 0:
        return False, None
    if alloc is not None:
        if not alloc.terminal or alloc.finished_at is None:
            return False, None  # running, or its end unknown: never
        ended = alloc.finished_at
    else:
        if stored_end is None:
            return False, None
        ended = stored_end
    return now - ended >= days * DAY, ended


def scan(keys: list[str], pool: str) -> list[Stored]:
    """The allocations' prefixes among the store's keys."""
    seen: dict[tuple[str, str], Stored] = {}
    for key in keys:
        parts = key.split("/")
        if len(parts) < 5 or parts[3] not in KINDS:
            continue
        root = "/".join(parts[:3])
        if (root, parts[3]) not in seen:
            alloc_id = urllib.parse.unquote(parts[2])
            seen[(root, parts[3])] = Stored(pool, parts[3], root, alloc_id)
    return list(seen.values())


def _day(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M UTC")


def _days(d: float) -> str:
    return f"{d:g} day" + ("" if d == 1 else "s")


def removed_message(
    alloc: Allocation, policy: RetentionPolicy, *, sensitive: bool, now: float
) -> str | None:
    """What ``lattice logs`` says when the store holds nothing for ``alloc`` because the
    retention removed it (None: not past its retention)."""
    pool = "sensitive" if sensitive else "ordinary"
    days = policy.days(pool, "logs")
    gone, ended = due(alloc, None, days, now)
    if not gone or ended is None:
        return None
    return (
        f"the logs of allocation {alloc.id} were removed by the retention policy: it ended "
        f"{_day(ended)} and logs are kept {_days(days)} ({policy.setting(pool, 'logs')})"
    )


class LogRetention:
    """The leader's sweeper (module docstring); ``stores``: pool -> store (None: none)."""

    def __init__(
        self,
        quorum: Quorum,
        stores: Mapping[str, LogStore | None],
        policy: RetentionPolicy,
        *,
        interval: float = 3600.0,
        first_delay: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.quorum = quorum
        self.stores = {p: s for p, s in stores.items() if s is not None}
        self.policy = policy
        self.interval = interval
        # the first sweep a little after start (a new leader sweeps soon, not in an hour)
        self.first_delay = min(60.0, interval) if first_delay is None else first_delay
        self.clock = clock
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.stores and self._task is None:
            self._task = asyncio.create_task(self._run(), name="log-retention")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        await asyncio.sleep(self.first_delay)
        while True:
            try:
                if self.quorum.is_leader:
                    await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("log retention sweep failed; retrying at the next interval")
            await asyncio.sleep(self.interval)

    async def sweep(self) -> int:
        """One pass over every store; returns the objects deleted."""
        total = 0
        for pool, store in self.stores.items():
            if all(self.policy.days(pool, k) <= 0 for k in KINDS):
                continue
            try:
                found = scan(await store.list(""), pool)
            except LogStoreError as e:
                log.warning("log retention: cannot list %s: %s", store.name, e)
                continue
            for item in found:
                try:
                    total += await self._one(store, item)
                except (LogStoreError, ValueError) as e:
                    log.warning(
                        "log retention: %s of %s in %s: %s",
                        item.kind,
                        item.allocation_id,
                        store.name,
                        e,
                    )
        return total

    async def _one(self, store: LogStore, item: Stored) -> int:
        days = self.policy.days(item.pool, item.kind)
        if days <= 0:
            return 0
        alloc = self.quorum.read(queries.allocation, item.allocation_id)
        stored_end = None if alloc is not None else await self._stored_end(store, item)
        gone, ended = due(alloc, stored_end, days, self.clock())
        if not gone or ended is None:
            return 0
        n = await store.delete(item.prefix)
        DELETED.labels(item.pool, item.kind).inc(n)
        log.info(
            "log retention: deleted %d objects of allocation %s (%s, %s pool): it ended %s, "
            "kept %s (%s)",
            n,
            item.allocation_id,
            item.kind,
            item.pool,
            _day(ended),
            _days(days),
            self.policy.setting(item.pool, item.kind),
        )
        return n

    async def _stored_end(self, store: LogStore, item: Stored) -> float | None:
        """The last write the metadata records (None: no readable metadata)."""
        if item.kind == "logs":
            meta = decode_metadata(await store.get(f"{item.root}/logs/metadata.json"))
            if meta is None:
                return None
            stamps = [meta.updated_at] + [
                sm.last_ts
                for nodes in meta.streams.values()
                for sm in nodes.values()
                if sm.last_ts is not None
            ]
        else:
            tmeta = decode_trace_metadata(await store.get(trace_metadata_key(item.root)))
            if tmeta is None:
                return None
            stamps = [tmeta.updated_at] + [
                n.last_ts for n in tmeta.nodes.values() if n.last_ts is not None
            ]
        stamps = [s for s in stamps if s]
        return max(stamps) if stamps else None
