"""The leader's history sweeper: terminal allocations past their retention move from the
quorum's state to the history store (lattice_common.history), so the state, and every
per-request cost that grows with it, holds only recent history.

Every ``storage.history_sweep_interval_seconds`` (60), while its member is the leader,
:meth:`HistorySweeper.sweep` repeats until nothing is due:

1. read a batch (``storage.history_batch_size``) of removable allocations with the
   state's revision (``lattice_quorum.retention.expired_records``: ended at least
   ``storage.allocation_retention_hours`` ago, whole task groups and DAGs only; a tenant
   with an internal budget too: the removal adds each run to its tenant's ledger totals,
   ``Tenant.retired_usage``, kept ``scheduling.budget_period_days``, which the budget
   penalty reads);
2. append their final records to the history store, moving its cursor to that revision,
   in one SQL transaction;
3. propose ``RemoveAllocations`` with those ids.

Step 2 always comes before step 3: a crash (or a lost leadership) between the two leaves
the allocations in the state, and the next sweep, on whichever member leads then,
appends them again, which adds nothing (the store ignores a record it holds). A record
is therefore never removed before it is stored. ``allocation_retention_hours: 0``
switches the sweeper off (allocations stay in the state).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from lattice_common import commands as c
from lattice_common.history import HistoryStore
from lattice_common.types import Allocation
from lattice_quorum import retention
from lattice_quorum.quorum import Quorum
from prometheus_client import Counter, Gauge

log = logging.getLogger("lattice.api.history")

__all__ = ["MOVED", "HistorySweeper"]

MOVED = Counter(
    "lattice_history_moved_allocations_total",
    "Terminal allocations moved from the quorum's state to the history store",
)
CURSOR = Gauge(
    "lattice_history_cursor_revision",
    "Quorum revision of the last batch appended to the history store",
)


class HistorySweeper:
    """The sweeper (module docstring)."""

    def __init__(
        self,
        quorum: Quorum,
        store: HistoryStore,
        *,
        retention_seconds: float = 86400.0,
        interval: float = 60.0,
        batch_size: int = 500,
        budgeted_retention_seconds: float = 0.0,
        budget_period_seconds: float = 0.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.quorum = quorum
        self.store = store
        self.retention_seconds = retention_seconds
        self.interval = interval
        self.batch_size = batch_size
        self.budgeted_retention_seconds = budgeted_retention_seconds
        self.budget_period_seconds = budget_period_seconds
        self.clock = clock
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.retention_seconds > 0 and self._task is None:
            self._task = asyncio.create_task(self._run(), name="history-sweeper")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                if self.quorum.is_leader:
                    await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("history sweep failed; retrying at the next interval")

    async def sweep(self) -> int:
        """Move every allocation that is due; returns how many left the state."""
        moved = 0
        while self.quorum.is_leader:
            now = self.clock()
            revision, records = self.quorum.read(
                retention.expired_records,
                now,
                self.retention_seconds,
                self.batch_size,
                self.budgeted_retention_seconds,
            )
            if not records:
                break
            gpus = self.quorum.read(_node_gpus, records)  # the ledger's GPU counts
            await self.store.append(records, revision=revision, node_gpus=gpus)  # never lost
            CURSOR.set(revision)
            res = await self.quorum.propose(
                c.RemoveAllocations(
                    now=now,
                    ids=[a.id for a in records],
                    retention_seconds=self.retention_seconds,
                    budgeted_retention_seconds=self.budgeted_retention_seconds,
                    budget_period_seconds=self.budget_period_seconds,
                )
            )
            if res.error:
                log.warning("history: removal refused: %s", res.error.get("message"))
                break
            n = len(res.removed_ids or [])
            moved += n
            MOVED.inc(n)
            log.info("history: %d allocations moved to the history store", n)
            if n == 0:  # nothing removable after all (changed meanwhile): next interval
                break
        return moved


def _node_gpus(s: Any, records: list[Allocation]) -> dict[str, int]:
    """A query: the GPU count of every node the records ran on that the state knows."""
    return {
        n: max(0, int(s.nodes[n].capabilities.gpu_count))
        for a in records
        for n in a.assigned_nodes
        if n in s.nodes
    }
