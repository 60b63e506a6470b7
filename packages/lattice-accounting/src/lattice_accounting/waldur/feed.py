"""Wiring: the quorum's watch stream -> events -> the pusher, with a durable cursor.

Why this module exists: the accounting service reads allocation changes from the quorum
"with a durable cursor" (architecture, lattice-accounting). :class:`AccountingFeed`
takes the watch-state stream (``RemoteQuorum.watch()``: a snapshot, then deltas),
derives events (:class:`~lattice_accounting.waldur.events.EventDeriver`), queues them
(:meth:`WaldurPusher.submit`) and keeps the cursor, the last GlobalState revision
whose events are safe (pushed or on disk), in ``<disk_buffer_path>/cursor``. After a
restart the first snapshot regenerates the events of every record changed past the
cursor; their ids are the same, so Waldur counts nothing twice.

:func:`build_pusher` makes the client, buffer and pusher from the ``accounting``
configuration section; :func:`reconcile` queues compensating events for a time range
(``lattice admin accounting reconcile --since --until``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import AsyncIterable, Callable, Iterable, Mapping
from pathlib import Path

from lattice_common.config import AccountingConfig
from lattice_common.errors import FailedPrecondition
from lattice_common.types import Allocation, Node
from lattice_common.watch import StateDelta

from lattice_accounting.waldur.buffer import AppendResult, EventBuffer
from lattice_accounting.waldur.client import WaldurClient
from lattice_accounting.waldur.events import EventDeriver, reconcile_events
from lattice_accounting.waldur.metrics import WaldurMetrics
from lattice_accounting.waldur.pusher import WaldurPusher

__all__ = ["AccountingFeed", "Cursor", "build_pusher", "reconcile"]

CURSOR_FILE = "cursor"


class Cursor:
    """The durable cursor: one integer in a file, replaced atomically."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = Path(directory) / CURSOR_FILE
        self.value = 0
        with contextlib.suppress(FileNotFoundError, ValueError):
            self.value = int(self.path.read_text().strip() or 0)

    def save(self, revision: int) -> None:
        if revision <= self.value:
            return
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            f.write(str(revision))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self.value = revision


class AccountingFeed:
    def __init__(self, pusher: WaldurPusher, *, clock: Callable[[], float] = time.time) -> None:
        self.pusher = pusher
        self.cursor = Cursor(pusher.buffer.disk.path)
        self.deriver = EventDeriver(since_revision=self.cursor.value)
        self.clock = clock
        pusher.after_round.append(self.save_cursor)

    def apply(self, delta: StateDelta) -> AppendResult:
        """Derive and queue the events of one message of the stream."""
        events = self.deriver.apply(delta, now=self.clock())
        return self.pusher.submit(events)

    def save_cursor(self) -> None:
        """Move the cursor as far as what is safe (after every push round, failed ones
        too, so one fsync per round rather than one per committed command)."""
        self.cursor.save(self.pusher.buffer.durable_revision(self.deriver.revision))

    async def run(self, deltas: AsyncIterable[StateDelta]) -> None:
        """Follow the stream until it ends (the caller reconnects and calls again: the
        next snapshot is diffed against what was seen)."""
        async for d in deltas:
            self.apply(d)


def build_pusher(
    cfg: AccountingConfig,
    *,
    metrics: WaldurMetrics | None = None,
    timeout: float = 10.0,
) -> WaldurPusher:
    """Client, buffer and pusher from the ``accounting`` section (its token already
    resolved from ``waldur_token_secret_ref`` by ``load_config``)."""
    if not cfg.enabled or cfg.provider != "waldur":
        raise FailedPrecondition(
            "the Waldur provider is not enabled",
            hint="Set accounting.enabled: true and accounting.provider: waldur.",
        )
    if cfg.waldur_token is None:
        raise FailedPrecondition(
            "no Waldur token configured",
            hint="Set accounting.waldur_token_secret_ref (vault://, file:// or env://).",
        )
    client = WaldurClient(cfg.waldur_url, cfg.waldur_token, timeout=timeout)
    buffer = EventBuffer(
        cfg.disk_buffer_path,
        memory_max=cfg.buffer_size,
        disk_max_bytes=cfg.disk_buffer_max_bytes,
        disk_alert_events=cfg.disk_buffer_max_events,
        metrics=metrics,
    )
    return WaldurPusher(
        client,
        buffer,
        push_interval_seconds=cfg.push_interval_seconds,
        retry_max_seconds=max(cfg.push_interval_seconds, 300.0),
        metrics=metrics,
    )


def reconcile(
    pusher: WaldurPusher,
    allocations: Iterable[Allocation],
    *,
    since: float,
    until: float,
    nodes: Mapping[str, Node] | None = None,
) -> int:
    """Queue the compensating events of ``[since, until)`` and start pushing them now;
    return how many were queued. Waldur ignores those it already has (same ids)."""
    events = reconcile_events(allocations, since=since, until=until, nodes=nodes)
    result = pusher.submit(events)
    pusher.flush_soon()
    return result.memory + result.disk
