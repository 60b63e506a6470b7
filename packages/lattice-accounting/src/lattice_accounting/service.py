"""The accounting service: the quorum consumer, the job charger, the watchdog and the
operations behind the internal API, around one :class:`~lattice_accounting.ledger.Ledger`.

* **Consumer** (:meth:`AccountingService.follow`): the quorum's watch stream (a snapshot,
  then one delta per committed command) kept in a :class:`StateMirror`. Each allocation
  carries its submission's reservation key in the ``accounting.reservation`` tag; when
  the allocation(s) of a key appear, the reservation is bound to their ids (split by
  estimate when a submission made several). It also notes when an allocation stopped
  holding nodes (Suspended, requeued) and when all its nodes stopped reporting.
* **Charger** (:meth:`charge_pass`, every ``charge_interval_seconds``): level-triggered
  from the mirror and the open reservations (:mod:`lattice_accounting.charging`); one
  set-based ``charge_many`` storing the durable cursor (the mirror's revision) in the
  same transaction, then ``finalize`` for each ended allocation. Funds that ran out are
  noted; past ``funds_exhausted_grace_seconds`` the allocation is cancelled through the
  quorum with reason ``funds_exhausted``.
* **Watchdog** (in the same pass): orphan reservations (no allocation appeared) are
  released after ``reservation_orphan_grace_seconds``; a bound reservation whose
  allocation has not started after ``reservation_start_timeout_seconds`` gives its money
  back; a reservation whose allocation left the quorum unseen is settled from its final
  record in the history store (lattice_common.history, when configured), else as charged.

Work never waits on any of this: the quorum and the schedulers do not know about the
service, and when it is down charging simply catches up from ``charged_up_to``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, Protocol

from lattice_common import commands as c
from lattice_common.errors import InvalidTransition, LatticeError, NotFound
from lattice_common.history import HistoryStore
from lattice_common.types import HOLDING_STATES, Allocation, LifecycleType, NodeState
from lattice_common.watch import StateDelta, StateMirror
from prometheus_client import CollectorRegistry
from sqlalchemy import select

from lattice_accounting import accounts as acc
from lattice_accounting.binding import ServiceLedger
from lattice_accounting.charging import OpenReservation, cost, due, facts
from lattice_accounting.errors import InsufficientFunds
from lattice_accounting.gate import (
    RESERVATION_TAG,
    GateRequest,
    estimate_for,
    is_request_key,
    rejection,
    reservation_key,
)
from lattice_accounting.ledger import ChargeItem, Reservation
from lattice_accounting.metrics import ServiceMetrics
from lattice_accounting.money import ZERO, quantize
from lattice_accounting.prices import Price, estimate
from lattice_accounting.schema import reservations

log = logging.getLogger("lattice.accounting")

CURSOR = "quorum"
WHO = "lattice-accounting"
FUNDS_EXHAUSTED = "funds_exhausted"
# nodes in these states are not reporting: charge their allocation up to then only
SILENT = frozenset({NodeState.DOWN, NodeState.DEGRADED, NodeState.FAILED, NodeState.UNKNOWN})


class QuorumLink(Protocol):
    """What the service needs of the quorum (lattice_common.rpc.RemoteQuorum)."""

    def watch(self) -> Any: ...

    async def propose(self, cmd: c.Command) -> c.CommandResult: ...


def utcnow() -> datetime:
    return datetime.now(UTC)


class AccountingService:
    def __init__(
        self,
        ledger: ServiceLedger,
        quorum: QuorumLink | None,
        *,
        charge_interval: float = 60.0,
        reserve_ahead: float = 3600.0,
        exhausted_grace: float = 60.0,
        start_timeout: float = 86400.0,
        orphan_grace: float = 120.0,
        metrics: ServiceMetrics | None = None,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.ledger = ledger
        self.quorum = quorum
        self.charge_interval = charge_interval
        self.reserve_ahead = reserve_ahead
        self.exhausted_grace = exhausted_grace
        self.start_timeout = start_timeout
        self.orphan_grace = orphan_grace
        # the process passes the default registry's (served on the metrics port); others
        # (tests) get a private one
        self.metrics = metrics or ServiceMetrics(CollectorRegistry())
        self.clock = clock
        self.mirror = StateMirror()
        # the history store (lattice_common.history, storage.history_database_url): the
        # final record of an allocation that left the quorum before it was settled
        self.history: HistoryStore | None = None
        self.synced = False  # a snapshot has arrived since the start
        self.connected = False
        self.bound: set[str] = set()  # allocation ids with a reservation row
        # tagged allocations whose key could not be bound (released meanwhile): charged
        # from the project like untagged ones, not retried at every delta
        self.unbindable: set[str] = set()
        self.paused_at: dict[str, datetime] = {}  # stopped holding nodes (not charged on)
        self.paused_ever: set[str] = set()  # seen to stop holding nodes before its end
        self.alive_until: dict[str, datetime] = {}  # all its nodes stopped reporting then
        self.exhausted_since: dict[str, datetime] = {}
        self.cancelled: set[str] = set()
        self.last_pass: dict[str, Any] = {}
        self._prices: list[Price] | None = None
        self._tenants: set[str] = set()  # tenants known to have an account
        self._projects: set[tuple[str, str]] = set()  # projects whose accounts exist
        self._wake = asyncio.Event()
        # SQLite takes one writer at a time: queue the writers here rather than in
        # SQLite's busy handler, which backs off by sleeping (seconds under load)
        self._writing: Any = contextlib.nullcontext() if ledger.postgres else asyncio.Lock()
        self._lock = asyncio.Lock()  # one pass at a time

    # --- prices -------------------------------------------------------------------------

    async def prices(self) -> list[Price]:
        if self._prices is None:
            self._prices = await self.ledger.prices()
        return self._prices

    def prices_changed(self) -> None:
        self._prices = None

    # --- the gate -----------------------------------------------------------------------

    async def reserve(self, req: GateRequest) -> dict[str, Any]:
        """Reserve the submission's estimate under its request key (idempotent). A tenant
        without an account is not gated (``gated: false``)."""
        key = reservation_key(req.request_id)
        now = self.clock()
        est = estimate_for(req, await self.prices(), now, ahead_s=self.reserve_ahead)
        out = {
            "key": key,
            "gated": True,
            "amount": str(est.amount),
            "explanation": est.explanation,
        }
        # accounts are never removed: what exists is remembered, so that the hot path is
        # ONE SQL transaction (the reservation itself)
        if req.tenant not in self._tenants:
            try:
                await self.ledger.balance(req.tenant)
            except NotFound:
                return {**out, "gated": False, "reason": f"tenant {req.tenant} has no account"}
            self._tenants.add(req.tenant)
        if (req.tenant, req.project) not in self._projects:
            await self.ledger.open_project(req.tenant, req.project)
            self._projects.add((req.tenant, req.project))
        if est.amount <= 0:
            return {**out, "gated": False, "reason": "no price: the estimate is 0.00"}
        ref = f"{req.tenant}/{req.project}"
        try:
            # PostgreSQL: one atomic statement, concurrent ones in parallel; SQLite: one
            # writer at a time (measured: grouping them in one transaction is no faster,
            # the statements cost more than the fsync)
            async with self._writing:
                r = await self.ledger.reserve(
                    key, ref, est.amount, user=req.user or None, vcluster=req.vcluster,
                    who=req.user or None,
                )  # fmt: skip
        except InsufficientFunds as e:
            self.metrics.rejected.inc()
            raise rejection(f"{req.tenant}/{req.project}", e.available, est) from None
        self.metrics.reserved.inc()
        return {**out, "existing": r.existing}

    async def unreserve(self, key: str) -> dict[str, Any]:
        """The proposal failed: give the reservation back (already bound or gone: 404)."""
        try:
            async with self._writing:
                released = await self.ledger.release(key, cancelled=True, who=WHO)
        except InvalidTransition:
            return {"key": key, "released": "0"}
        return {"key": key, "released": str(released)}

    # --- the consumer -------------------------------------------------------------------

    async def follow(self, retry: float = 1.0) -> None:
        """Follow the quorum's stream forever (reconnecting; each reconnection starts
        with a fresh snapshot). Deltas that arrive while a batch is being written are
        applied together: one SQL transaction binds all their reservations."""
        assert self.quorum is not None
        while True:
            queue: asyncio.Queue[StateDelta | None] = asyncio.Queue()
            reader = asyncio.create_task(self._read(queue))
            try:
                while True:
                    d = await queue.get()
                    if d is None:
                        break
                    batch = [d]
                    while not queue.empty() and len(batch) < 1000:
                        nxt = queue.get_nowait()
                        if nxt is None:
                            queue.put_nowait(None)
                            break
                        batch.append(nxt)
                    self.connected = True
                    await self.apply_many(batch)
            except asyncio.CancelledError:
                reader.cancel()
                raise
            except LatticeError as e:
                log.warning("quorum stream: %s", e.message)
            except Exception:  # keep following whatever one delta did
                log.exception("quorum stream failed")
            reader.cancel()
            self.connected = False
            await asyncio.sleep(retry)

    async def _read(self, queue: asyncio.Queue[StateDelta | None]) -> None:
        assert self.quorum is not None
        try:
            async for d in self.quorum.watch():
                queue.put_nowait(d)
        except asyncio.CancelledError:
            raise
        except LatticeError as e:
            log.warning("quorum stream: %s", e.message)
        except Exception:
            log.exception("quorum stream failed")
        queue.put_nowait(None)

    async def apply(self, d: StateDelta) -> None:
        await self.apply_many([d])

    async def apply_many(self, deltas: list[StateDelta]) -> None:
        now = self.clock()
        seen: dict[str, Allocation] = {}
        for d in deltas:
            before = {a.id: self.mirror.allocations.get(a.id) for a in d.allocations}
            self.mirror.apply(d)
            if d.snapshot:
                self.synced = True
                self.bound = await self._bound_ids()
                seen.clear()
            for a in d.allocations:
                old = before.get(a.id)
                held = a.state in HOLDING_STATES
                if not held and old is not None and old.state in HOLDING_STATES:
                    self.paused_at[a.id] = now
                    if not a.terminal:
                        self.paused_ever.add(a.id)
                elif held:
                    self.paused_at.pop(a.id, None)
                if a.terminal:
                    self._wake.set()  # settle it soon, not at the next interval
                if a.id not in self.bound and a.id not in self.unbindable:
                    seen[a.id] = a
            self._note_silence(now, d)
        await self.bind_new(seen.values())

    def _note_silence(self, now: datetime, d: StateDelta) -> None:
        if not d.nodes and not d.snapshot:
            return
        nodes = self.mirror.nodes
        for aid in list(self.mirror.holding):
            a = self.mirror.allocations[aid]
            ids = a.assigned_nodes
            # a node the state does not know is not evidence of silence
            silent = bool(ids) and all(n in nodes and nodes[n].state in SILENT for n in ids)
            if silent:
                self.alive_until.setdefault(aid, now)
            else:
                self.alive_until.pop(aid, None)

    async def bind_new(self, allocations: Any, *, locked: bool = False) -> None:
        """Bind the reservation keys of newly seen allocations to their ids (one SQL
        transaction for all, each key in its own savepoint)."""
        groups: dict[str, list[Allocation]] = defaultdict(list)
        for a in allocations:
            key = a.spec.tags.get(RESERVATION_TAG)
            if key:
                groups[key].append(a)
        if not groups:
            return
        prices = await self.prices()
        now = self.clock()
        work = [
            (key, [
                (a.id, estimate(facts(a, self.mirror.nodes), prices, now,
                                charging_period_s=self.reserve_ahead).amount)
                for a in members
            ])
            for key, members in groups.items()
        ]  # fmt: skip
        async with contextlib.nullcontext() if locked else self._writing:
            results = await self.ledger.bind_many(work)
        for key, members in groups.items():
            got = results.get(key)
            if isinstance(got, LatticeError):
                if not isinstance(got, NotFound):  # NotFound: not gated, or released
                    log.warning("binding reservation %s: %s", key, got.message)
                self.unbindable.update(a.id for a in members)
            else:
                self.bound.update(a.id for a in members)

    async def _bound_ids(self) -> set[str]:
        async with self.ledger.engine.connect() as conn:
            ids = (await conn.execute(select(reservations.c.allocation_id))).scalars().all()
            await conn.rollback()
        return {i for i in ids if not is_request_key(i)}

    async def open_reservations(self) -> list[OpenReservation]:
        cols = reservations.c
        q = select(
            cols.allocation_id, cols.tenant, cols.project, cols.held, cols.charged,
            cols.created_at, cols.last_charged_at, cols.started_at,
        ).where(cols.state == "reserved")  # fmt: skip
        async with self.ledger.engine.connect() as conn:
            rows = (await conn.execute(q)).all()
            await conn.rollback()
        return [OpenReservation(*r) for r in rows]

    # --- the charger and the watchdog -----------------------------------------------------

    async def run_charger(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.charge_interval)
            self._wake.clear()
            if not self.synced or not self.connected:
                # nothing is decided before the first snapshot, nor on a stale mirror:
                # charging catches up from charged_up_to once the stream is back
                continue
            try:
                await self.charge_pass()
            except asyncio.CancelledError:
                raise
            except LatticeError as e:
                log.warning("charge pass: %s", e.message)
            except Exception:
                log.exception("charge pass failed")

    async def charge_pass(self) -> dict[str, Any]:
        async with self._lock, self._writing:
            t0 = time.perf_counter()
            out = await self._charge_pass()
            out["seconds"] = time.perf_counter() - t0
            self.metrics.charge_cycle.observe(out["seconds"])
            self.last_pass = {**out, "at": self.clock().isoformat()}
            return out

    async def _charge_pass(self) -> dict[str, Any]:
        now = self.clock()
        revision = self.mirror.revision
        prices = await self.prices()
        await self._ensure_unfunded(now)
        opens = await self.open_reservations()
        items: list[ChargeItem] = []
        finals = []
        orphans, gone = [], []
        for r in opens:
            if is_request_key(r.allocation_id):
                orphans.append(r)
                continue
            a = self.mirror.allocations.get(r.allocation_id)
            if a is None and self.history is not None:
                a = await self.history.get(r.allocation_id)  # moved there after its end
            if a is None:
                gone.append(r)
                continue
            d = due(
                a, r, self.mirror.nodes, prices, now,
                alive_until=self.alive_until.get(a.id), paused_at=self.paused_at.get(a.id),
                paused_ever=a.id in self.paused_ever,
            )  # fmt: skip
            if d is None:
                continue
            if d.final:
                finals.append(d)
            else:
                items.append(ChargeItem(d.allocation_id, d.amount, d.up_to))
        results = await self.ledger.charge_many(items, cursor_at=(CURSOR, revision), who=WHO)
        self.metrics.cursor.set(revision)
        charged = sum(1 for x in results if not x.replay and x.charged > 0)
        self.metrics.charged_allocations.set(charged)
        exhausted = [x.allocation_id for x in results if x.exhausted]
        for aid in list(self.exhausted_since):
            if aid not in exhausted:
                self.exhausted_since.pop(aid, None)
        for aid in exhausted:
            self.exhausted_since.setdefault(aid, now)
        finalized = 0
        for d in finals:
            try:
                await self.ledger.finalize(d.allocation_id, d.total, at=d.up_to, who=WHO)
                finalized += 1
            except (InvalidTransition, NotFound):
                pass  # settled meanwhile
            for kept in (self.exhausted_since, self.paused_at, self.alive_until):
                kept.pop(d.allocation_id, None)
            self.paused_ever.discard(d.allocation_id)
        cancelled = await self._cancel_exhausted(now)
        released = await self._watchdog(now, orphans, gone, opens)
        await self._top_up_ahead(now, prices, opens)
        await self._balances()
        return {
            "charged": charged,
            "items": len(items),
            "finalized": finalized,
            "exhausted": len(exhausted),
            "cancelled": cancelled,
            "released": released,
            "revision": revision,
        }

    async def _ensure_unfunded(self, now: datetime) -> None:
        """Allocations holding nodes without a reservation (not gated: submitted before
        the tenant had funds, or while accounting was off) get an empty one, so that
        they are charged from their project like the others."""
        missing = [
            self.mirror.allocations[aid] for aid in self.mirror.holding if aid not in self.bound
        ]
        if not missing:
            return
        have_accounts = await self._tenants_with_accounts({a.spec.tenant for a in missing})
        todo = [a for a in missing if a.spec.tenant in have_accounts]
        for a in todo:
            project = a.spec.project or acc.DEFAULT_PROJECT
            try:
                await self.ledger.open_project(a.spec.tenant, project)
                await self.ledger.bind(
                    None, [(a.id, ZERO)], tenant=a.spec.tenant, project=project,
                    user=a.spec.user or None, vcluster=a.spec.vcluster,
                )  # fmt: skip
            except LatticeError as e:
                log.warning("opening a reservation for %s: %s", a.id, e.message)
                continue
            self.bound.add(a.id)

    async def _tenants_with_accounts(self, tenants: set[str]) -> set[str]:
        out = set()
        for t in tenants:
            try:
                await self.ledger.balance(t)
            except (NotFound, LatticeError):
                continue
            out.add(t)
        return out

    async def _cancel_exhausted(self, now: datetime) -> int:
        n = 0
        for aid, since in list(self.exhausted_since.items()):
            if (now - since).total_seconds() < self.exhausted_grace or aid in self.cancelled:
                continue
            a = self.mirror.allocations.get(aid)
            if a is None or a.terminal or self.quorum is None:
                continue
            try:
                await self.quorum.propose(
                    c.CancelAllocation(
                        allocation_id=aid, reason=FUNDS_EXHAUSTED, requested_by=WHO,
                        now=time.time(),
                    )
                )  # fmt: skip
            except LatticeError as e:
                log.warning("cancelling %s (funds exhausted): %s", aid, e.message)
                continue
            log.info("allocation %s cancelled: funds exhausted", aid)
            self.cancelled.add(aid)
            self.metrics.cancelled.inc()
            n += 1
        return n

    async def _watchdog(
        self,
        now: datetime,
        orphans: list[OpenReservation],
        gone: list[OpenReservation],
        opens: list[OpenReservation],
    ) -> int:
        released = 0
        keys = {
            a.spec.tags.get(RESERVATION_TAG)
            for a in self.mirror.allocations.values()
            if RESERVATION_TAG in a.spec.tags
        }
        for r in orphans:
            if r.allocation_id in keys:
                # its allocations exist but were not bound (a failed bind): bind now
                await self.bind_new(
                    (a for a in self.mirror.allocations.values()
                     if a.spec.tags.get(RESERVATION_TAG) == r.allocation_id),
                    locked=True,
                )  # fmt: skip
                continue
            if (now - r.created_at).total_seconds() < self.orphan_grace:
                continue
            with contextlib.suppress(InvalidTransition, NotFound):
                await self.ledger.release(r.allocation_id, cancelled=True, who=WHO)
                self.metrics.watchdog_releases.labels("orphan").inc()
                released += 1
        for r in gone:
            # left the quorum without this service seeing it end: settle what was charged
            with contextlib.suppress(InvalidTransition, NotFound):
                await self.ledger.finalize(r.allocation_id, r.charged, who=WHO)
                self.metrics.watchdog_releases.labels("gone").inc()
                released += 1
        for r in opens:
            a = self.mirror.allocations.get(r.allocation_id)
            if (
                a is None
                or a.started_at is not None
                or r.last_charged_at is not None
                or r.held <= 0
                or a.terminal
                or (now - r.created_at).total_seconds() < self.start_timeout
            ):
                continue
            with contextlib.suppress(InvalidTransition, NotFound):
                await self.ledger.unhold(r.allocation_id, who=WHO)
                self.metrics.watchdog_releases.labels("not_started").inc()
                released += 1
        return released

    async def _top_up_ahead(
        self, now: datetime, prices: list[Price], opens: list[OpenReservation]
    ) -> None:
        """Ranged/unbounded allocations keep one charging period reserved ahead."""
        for r in opens:
            a = self.mirror.allocations.get(r.allocation_id)
            if a is None or a.state not in HOLDING_STATES:
                continue
            if a.spec.lifecycle == LifecycleType.BOUNDED and a.spec.walltime_seconds > 0:
                continue
            ahead = cost(a, self.mirror.nodes, prices, now,
                         now + timedelta(seconds=self.reserve_ahead), first=False)  # fmt: skip
            # r.held is from before this pass's charge: re-read it
            res = await self.ledger.reservation(r.allocation_id)
            if res is None or res.state != "reserved":
                continue
            need = quantize(ahead - res.held)
            if need > 0:
                with contextlib.suppress(LatticeError):
                    await self.ledger.hold_more(r.allocation_id, need, who=WHO)

    async def _balances(self) -> None:
        from lattice_accounting.schema import accounts

        async with self.ledger.engine.connect() as conn:
            rows = (
                await conn.execute(select(accounts.c.tenant, accounts.c.kind, accounts.c.balance))
            ).all()
            await conn.rollback()
        sums: dict[tuple[str, str], Decimal] = defaultdict(Decimal)
        for tenant, kind, bal in rows:
            if tenant is None:
                continue
            sums[(tenant, "reserved" if kind == "reservation" else "available")] += bal
        for (tenant, kind), v in sums.items():
            self.metrics.balance.labels(tenant, kind).set(float(v))

    # --- reads for the API ---------------------------------------------------------------

    async def allocation_costs(self, ids: list[str]) -> dict[str, dict[str, Any]]:
        """What each allocation cost (charged so far, state of its reservation)."""
        cols = reservations.c
        q = select(cols.allocation_id, cols.charged, cols.held, cols.state).where(
            cols.allocation_id.in_(ids[:1000])
        )
        async with self.ledger.engine.connect() as conn:
            rows = (await conn.execute(q)).all()
            await conn.rollback()
        return {
            aid: {"cost": str(charged), "held": str(held), "state": state}
            for aid, charged, held, state in rows
        }

    async def status(self) -> dict[str, Any]:
        cursor = await self.ledger.get_cursor(CURSOR)
        return {
            "connected": self.connected,
            "synced": self.synced,
            "revision": self.mirror.revision,
            "cursor": cursor,
            "lag": (self.mirror.revision - cursor) if cursor is not None else None,
            "charge_interval_seconds": self.charge_interval,
            "last_pass": self.last_pass,
            "exhausted": sorted(self.exhausted_since),
            "backend": self.ledger.engine.dialect.name,
        }


__all__ = ["CURSOR", "FUNDS_EXHAUSTED", "AccountingService", "Reservation"]
