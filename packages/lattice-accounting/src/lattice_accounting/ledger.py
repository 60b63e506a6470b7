"""The double-entry ledger over an ``AsyncEngine`` (SQLite or PostgreSQL).

Every operation is ONE SQL transaction that writes one journal row per transaction
(kind: topup, transfer, reserve, release, charge, refund, adjustment) and ledger rows
that sum to zero, and updates the denormalised balance of each account it touches.
Balances are updated in account-name order with conditional UPDATEs (``balance + d >=
0``), so a debit that would take an account other than ``system`` below zero matches
no row and the whole transaction is refused; the fixed order keeps PostgreSQL free of
lock-order deadlocks. On SQLite every transaction holds the write lock
(:mod:`lattice_accounting.db`).

Reservations are keyed by allocation id: ``held`` is what is still in the project's
reservation account for it, ``charged`` what it has cost so far.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, NamedTuple

from lattice_common.errors import InvalidTransition, NotFound, Unavailable, ValidationError
from sqlalchemy import (
    and_,
    case,
    func,
    insert,
    literal,
    select,
    text,
    true,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from lattice_accounting import accounts as acc
from lattice_accounting.db import make_engine, migrate
from lattice_accounting.errors import InsufficientFunds
from lattice_accounting.money import ZERO, from_micros, parse_amount, to_micros
from lattice_accounting.prices import Price, check_no_overlap, check_price
from lattice_accounting.schema import accounts, cursor, journal, ledger, prices, reservations
from lattice_accounting.settle import Settlement, settle

KINDS = ("topup", "transfer", "reserve", "release", "charge", "refund", "adjustment")
OPEN = "reserved"
RELEASED = "released"
CANCELLED = "cancelled"
FINALIZED = "finalized"
JOURNAL_COLUMNS = (
    "id", "at", "kind", "allocation_id", "tenant", "project", "user", "vcluster", "amount",
    "who", "batch", "properties",
)  # fmt: skip
LEDGER_COLUMNS = ("journal_id", "account", "amount")
# SQLite's limit on bound parameters is 32,766; stay well below it
CHUNK = 5000


def utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True, slots=True)
class Reservation:
    allocation_id: str
    tenant: str
    project: str
    amount: Decimal
    held: Decimal
    charged: Decimal
    state: str
    created_at: datetime
    user: str | None = None
    vcluster: str | None = None
    started_at: datetime | None = None
    last_alive_at: datetime | None = None
    last_charged_at: datetime | None = None
    finished_at: datetime | None = None
    existing: bool = False  # returned by a repeated reserve of the same allocation id


class ChargeResult(NamedTuple):
    # a NamedTuple: one per allocation in a charge pass of 100,000
    allocation_id: str
    charged: Decimal  # what could be charged now (never more than was due)
    exhausted: bool  # funds ran out: terminate the allocation
    case: str = ""
    from_reservation: Decimal = ZERO
    from_project: Decimal = ZERO
    refund: Decimal = ZERO
    released: Decimal = ZERO
    replay: bool = False  # up_to not after the last charge: nothing done


@dataclass(frozen=True, slots=True)
class ChargeItem:
    allocation_id: str
    amount: Decimal
    up_to: datetime


@dataclass(frozen=True, slots=True)
class Balance:
    account: str
    available: Decimal
    reserved: Decimal
    spent: Decimal
    allocated: Decimal = ZERO  # tenant only: what its projects hold (available there)


@dataclass(frozen=True, slots=True)
class Leg:
    account: str
    amount: Decimal


@dataclass(frozen=True, slots=True)
class Transaction:
    id: int
    at: datetime
    kind: str
    amount: Decimal
    allocation_id: str | None
    tenant: str | None
    project: str | None
    user: str | None
    vcluster: str | None
    who: str | None
    properties: dict[str, Any]
    legs: tuple[Leg, ...] = ()


@dataclass(frozen=True, slots=True)
class Page:
    items: list[Transaction]
    next_before_id: int | None  # pass as ``before_id`` for the next (older) page


@dataclass(frozen=True, slots=True)
class Discrepancy:
    # unbalanced_journal | orphan_ledger_rows | unknown_account | balance_mismatch |
    # negative_balance | reservation_mismatch
    what: str
    subject: str
    expected: Decimal
    actual: Decimal


_RESERVE_PG = """
WITH p AS (
    UPDATE accounts SET balance = balance - $1 WHERE name = $2 AND balance >= $1 RETURNING name
), r AS (
    UPDATE accounts SET balance = balance + $1 WHERE name = $3 AND EXISTS (SELECT 1 FROM p)
    RETURNING name
), res AS (
    INSERT INTO reservations (allocation_id, tenant, project, "user", vcluster, amount, held,
                              charged, state, created_at)
    SELECT $4::text, $5::text, $6::text, $7::text, $8::text, $1, $1, 0, 'reserved',
           $9::timestamptz
    WHERE EXISTS (SELECT 1 FROM r)
    RETURNING allocation_id
), j AS (
    INSERT INTO journal (at, kind, allocation_id, tenant, project, "user", vcluster, amount, who)
    SELECT $9::timestamptz, 'reserve', $4::text, $5::text, $6::text, $7::text, $8::text, $1,
           $10::text
    FROM res
    RETURNING id
), l AS (
    INSERT INTO ledger (journal_id, account, amount)
    SELECT j.id, v.account, v.amount FROM j, (VALUES ($2, -$1::bigint), ($3, $1::bigint))
        AS v(account, amount)
    RETURNING 1
)
SELECT (SELECT count(*) FROM l) = 2
"""


_UPDATE_RESERVATIONS_PG = """
WITH u AS (
    UPDATE reservations AS r SET held = v.held, charged = v.charged, last_charged_at = v.up_to
    FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::timestamptz[], $5::bigint[],
                $6::bigint[]) AS v(k, held, charged, up_to, old_held, old_charged)
    WHERE r.allocation_id = v.k AND r.state = 'reserved'
      AND r.held = v.old_held AND r.charged = v.old_charged
    RETURNING 1
)
SELECT count(*) FROM u
"""


class _PassConflict(Exception):
    """A reservation changed between the charge pass's read and its update."""


@dataclass
class _Post:
    """One journal row and its ledger legs (which must sum to zero)."""

    kind: str
    moves: dict[str, Decimal]
    amount: Decimal
    allocation_id: str | None = None
    tenant: str | None = None
    project: str | None = None
    user: str | None = None
    vcluster: str | None = None
    who: str | None = None
    properties: dict[str, Any] = field(default_factory=dict)


class Ledger:
    """Async ledger operations; the decisions are the pure functions of
    :mod:`lattice_accounting.settle` and :mod:`lattice_accounting.prices`."""

    def __init__(self, engine: AsyncEngine, *, clock: Callable[[], datetime] = utcnow) -> None:
        self.engine = engine
        self.clock = clock
        self.postgres = engine.dialect.name == "postgresql"

    @classmethod
    async def open(cls, url: str, **kw: Any) -> Ledger:
        """Migrate the database at ``url`` to the current schema and open it."""
        await migrate(url)
        return cls(make_engine(url, **kw))

    async def close(self) -> None:
        await self.engine.dispose()

    # --- accounts -----------------------------------------------------------------------

    async def open_tenant(self, tenant: str) -> None:
        """Open the tenant's account and its ``default`` project (idempotent)."""
        await self.open_project(tenant, acc.DEFAULT_PROJECT)

    async def open_project(self, tenant: str, project: str) -> None:
        """Open a project's main and reservation accounts (and its tenant's), idempotent."""
        names = {
            acc.tenant_account(tenant): ("tenant", None),
            acc.project_account(tenant, project): ("project", project),
            acc.reservation_account(tenant, project): ("reservation", project),
        }
        async with self.engine.begin() as conn:
            have = set(
                (await conn.execute(select(accounts.c.name).where(accounts.c.name.in_(names))))
                .scalars()
                .all()
            )
            rows = [
                {
                    "name": n,
                    "kind": k,
                    "tenant": tenant,
                    "project": p,
                    "balance": ZERO,
                    "enabled": True,
                    "created_at": self.clock(),
                }
                for n, (k, p) in sorted(names.items())
                if n not in have
            ]
            if rows:
                try:
                    await conn.execute(insert(accounts), rows)
                except IntegrityError:
                    pass  # opened concurrently: the same rows exist
        return None

    # --- the one write primitive ----------------------------------------------------------

    async def _post(self, conn: AsyncConnection, post: _Post) -> int:
        moves = {a: d for a, d in post.moves.items() if d != 0}
        if sum(moves.values(), ZERO) != 0:
            raise AssertionError(f"unbalanced transaction {post.kind}: {moves}")
        for name in sorted(moves):  # one global order: no lock-order deadlocks
            d = moves[name]
            stmt = update(accounts).where(accounts.c.name == name)
            if d < 0 and not acc.may_go_negative(name):
                stmt = stmt.where(accounts.c.balance >= -d)
            row = (
                await conn.execute(
                    stmt.values(balance=accounts.c.balance + d).returning(accounts.c.name)
                )
            ).first()
            if row is None:
                await self._refuse(conn, name, -d)
        now = self.clock()
        jid = (
            await conn.execute(
                insert(journal)
                .values(
                    at=now,
                    kind=post.kind,
                    allocation_id=post.allocation_id,
                    tenant=post.tenant,
                    project=post.project,
                    user=post.user,
                    vcluster=post.vcluster,
                    amount=post.amount,
                    who=post.who,
                    properties=post.properties or None,
                )
                .returning(journal.c.id)
            )
        ).scalar_one()
        await conn.execute(
            insert(ledger),
            [{"journal_id": jid, "account": a, "amount": d} for a, d in sorted(moves.items())],
        )
        return int(jid)

    async def _refuse(self, conn: AsyncConnection, name: str, requested: Decimal) -> None:
        bal = (
            await conn.execute(select(accounts.c.balance).where(accounts.c.name == name))
        ).scalar_one_or_none()
        if bal is None:
            raise _unknown_account(name)
        raise InsufficientFunds(name, bal, requested)

    # --- money in and between accounts -------------------------------------------------------

    async def topup(self, tenant: str, amount: object, *, who: str | None = None) -> int:
        """Funds paid in: system -> tenant. Returns the journal id."""
        a = parse_amount(amount)
        t = acc.tenant_account(tenant)
        async with self.engine.begin() as conn:
            return await self._post(
                conn,
                _Post("topup", {acc.SYSTEM: -a, t: a}, a, tenant=tenant, who=who),
            )

    async def transfer(
        self, tenant: str, project: str, amount: object, *, who: str | None = None
    ) -> int:
        """Tenant -> one of its projects."""
        a = parse_amount(amount)
        t, p = acc.tenant_account(tenant), acc.project_account(tenant, project)
        async with self.engine.begin() as conn:
            return await self._post(
                conn,
                _Post("transfer", {t: -a, p: a}, a, tenant=tenant, project=project, who=who),
            )

    async def adjust(
        self, account: str, amount: Decimal, reason: str, *, who: str | None = None
    ) -> int:
        """An administrator's correction between ``system`` and an account
        (positive: credit the account)."""
        if not isinstance(amount, Decimal) or amount == 0:
            raise ValidationError(
                "adjustment must be a non-zero Decimal",
                details={"Amount": str(amount)},
                hint="Positive credits the account, negative debits it.",
            )
        if acc.kind_of(account) not in ("tenant", "project"):
            raise ValidationError(
                "only tenant and project accounts can be adjusted",
                details={"Account": account},
                hint="Reservations move only with their allocation (release or finalize it); "
                "adjust the project instead.",
            )
        a = parse_amount(abs(amount))
        d = a if amount > 0 else -a
        owner = account.split(":", 1)[1]
        tenant, _, project = owner.partition("/")
        async with self.engine.begin() as conn:
            return await self._post(
                conn,
                _Post(
                    "adjustment",
                    {acc.SYSTEM: -d, account: d},
                    a,
                    tenant=tenant or None,
                    project=project or None,
                    who=who,
                    properties={"reason": reason, "account": account},
                ),
            )

    # --- reservations ----------------------------------------------------------------------

    async def reserve(
        self,
        allocation_id: str,
        project: str,
        amount: object,
        *,
        user: str | None = None,
        vcluster: str | None = None,
        who: str | None = None,
    ) -> Reservation:
        """Move ``amount`` from the project (``"<tenant>/<project>"``, or ``"<tenant>"``
        for its default project) to its reservation account. Idempotent per allocation
        id: a repeated reserve returns the existing reservation, whatever its state."""
        _check_allocation_id(allocation_id)
        a = parse_amount(amount)
        tenant, proj = acc.split_project(project)
        now = self.clock()
        if self.postgres:
            done = await self._reserve_pg(allocation_id, tenant, proj, a, user, vcluster, who, now)
            if done:
                return Reservation(
                    allocation_id, tenant, proj, a, a, ZERO, OPEN, now, user=user, vcluster=vcluster
                )
            existing = await self.reservation(allocation_id)
            if existing is not None:
                return _replace(existing, existing=True)
            async with self.engine.connect() as conn:
                await self._refuse(conn, acc.project_account(tenant, proj), a)
                await self._refuse(conn, acc.reservation_account(tenant, proj), a)
            raise AssertionError("reserve refused without a reason")  # pragma: no cover
        try:
            async with self.engine.begin() as conn:
                # the row first: a concurrent reserve of the same id waits on its key
                await conn.execute(
                    insert(reservations).values(
                        allocation_id=allocation_id,
                        tenant=tenant,
                        project=proj,
                        user=user,
                        vcluster=vcluster,
                        amount=a,
                        held=a,
                        charged=ZERO,
                        state=OPEN,
                        created_at=now,
                    )
                )
                await self._post(
                    conn,
                    _Post(
                        "reserve",
                        {
                            acc.project_account(tenant, proj): -a,
                            acc.reservation_account(tenant, proj): a,
                        },
                        a,
                        allocation_id=allocation_id,
                        tenant=tenant,
                        project=proj,
                        user=user,
                        vcluster=vcluster,
                        who=who,
                    ),
                )
        except IntegrityError:
            existing = await self.reservation(allocation_id)
            if existing is None:
                raise
            return _replace(existing, existing=True)
        return Reservation(
            allocation_id, tenant, proj, a, a, ZERO, OPEN, now, user=user, vcluster=vcluster
        )

    async def _reserve_pg(
        self,
        allocation_id: str,
        tenant: str,
        project: str,
        amount: Decimal,
        user: str | None,
        vcluster: str | None,
        who: str | None,
        now: datetime,
    ) -> bool:
        """The reservation gate on PostgreSQL: ONE atomic statement (one round trip).
        The conditional UPDATE debits the project only if it has the funds (under its
        row lock, re-checked against the latest balance by concurrent writers); the
        reservation row, journal and ledger rows are written only when it matched. A
        second reserve of the same allocation id fails the whole statement on the
        primary key, and nothing of it is written. False: refused or already there."""
        from asyncpg.exceptions import UniqueViolationError

        try:
            async with self._raw() as raw:
                ok = await raw.fetchval(
                    _RESERVE_PG,
                    to_micros(amount),
                    acc.project_account(tenant, project),
                    acc.reservation_account(tenant, project),
                    allocation_id,
                    tenant,
                    project,
                    user,
                    vcluster,
                    now,
                    who,
                )
        except UniqueViolationError:
            return False
        return bool(ok)

    @contextlib.asynccontextmanager
    async def _raw(self) -> AsyncIterator[Any]:
        """The asyncpg connection under a pooled SQLAlchemy one, outside any
        transaction (a single statement is atomic on its own), for the hot path."""
        async with self.engine.connect() as conn:
            raw = await conn.get_raw_connection()
            yield raw.driver_connection

    async def reservation(self, allocation_id: str) -> Reservation | None:
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(
                    select(reservations).where(reservations.c.allocation_id == allocation_id)
                )
            ).first()
            await conn.rollback()
        return _reservation(row) if row is not None else None

    async def mark(
        self,
        allocation_id: str,
        *,
        started_at: datetime | None = None,
        alive_at: datetime | None = None,
    ) -> None:
        """Record the allocation's start / last sign of life (for the watchdog)."""
        values: dict[str, Any] = {}
        if started_at is not None:
            values["started_at"] = started_at
            values["last_alive_at"] = started_at
        if alive_at is not None:
            values["last_alive_at"] = alive_at
        if not values:
            return
        async with self.engine.begin() as conn:
            res = await conn.execute(
                update(reservations)
                .where(reservations.c.allocation_id == allocation_id)
                .values(**values)
            )
            if res.rowcount == 0:
                raise _unknown_reservation(allocation_id)

    async def _lock_open(self, conn: AsyncConnection, allocation_id: str) -> tuple[Any, Decimal]:
        """The open reservation, locked, and its project's available balance. Locks are
        taken accounts first (in name order), then the reservation row: the same order
        as the charge pass, so the two never deadlock."""
        q = select(reservations).where(reservations.c.allocation_id == allocation_id)
        row = (await conn.execute(q)).first()
        if row is None:
            raise _unknown_reservation(allocation_id)
        proj = acc.project_account(row.tenant, row.project)
        balances = await self._lock_accounts(
            conn, [proj, acc.reservation_account(row.tenant, row.project)]
        )
        if self.postgres:
            row = (await conn.execute(q.with_for_update())).first()
        if row.state != OPEN:
            raise InvalidTransition(
                f"reservation of allocation {allocation_id} is {row.state}",
                details={"Allocation": allocation_id, "State": row.state},
                hint="Only an open reservation can be charged, released or finalized.",
            )
        return row, balances[proj]

    async def release(
        self, allocation_id: str, *, cancelled: bool = False, who: str | None = None
    ) -> Decimal:
        """Return the unspent reservation to the project and close it (``cancelled``:
        the allocation never started). Returns the amount released."""
        async with self.engine.begin() as conn:
            row, _ = await self._lock_open(conn, allocation_id)
            s = Settlement("release", release=row.held)
            await self._apply(conn, row, s, who=who)
            await conn.execute(
                update(reservations)
                .where(reservations.c.allocation_id == allocation_id)
                .values(held=ZERO, state=CANCELLED if cancelled else RELEASED)
            )
        return row.held

    async def charge(
        self, allocation_id: str, amount: object, up_to: datetime, *, who: str | None = None
    ) -> ChargeResult:
        """Charge a running allocation for its cost up to ``up_to``: from its
        reservation first, then from its project, to ``system``. Returns what could be
        charged and whether funds ran out. A charge whose ``up_to`` is not after the last
        one is a replay and does nothing."""
        a = parse_amount(amount, allow_zero=True)
        async with self.engine.begin() as conn:
            row, available = await self._lock_open(conn, allocation_id)
            if row.last_charged_at is not None and up_to <= row.last_charged_at:
                return ChargeResult(allocation_id, ZERO, False, replay=True)
            s = settle(
                held=row.held,
                available=available,
                charged=row.charged,
                total=row.charged + a,
                finished=False,
            )
            await self._apply(conn, row, s, who=who, up_to=up_to)
            await conn.execute(
                update(reservations)
                .where(reservations.c.allocation_id == allocation_id)
                .values(
                    held=row.held - s.from_reservation,
                    charged=row.charged + s.charged,
                    last_charged_at=up_to,
                )
            )
        return _result(allocation_id, s)

    async def finalize(
        self,
        allocation_id: str,
        total: object,
        *,
        finished: bool = True,
        at: datetime | None = None,
        who: str | None = None,
    ) -> ChargeResult:
        """Settle an allocation whose cost so far is ``total`` (the job charger's cases,
        :mod:`lattice_accounting.settle`): charge what is due, refund what was
        overcharged, and when ``finished`` release the rest of the reservation."""
        t = parse_amount(total, "total", allow_zero=True)
        at = at or self.clock()
        async with self.engine.begin() as conn:
            row, available = await self._lock_open(conn, allocation_id)
            s = settle(
                held=row.held, available=available, charged=row.charged, total=t, finished=finished
            )
            await self._apply(conn, row, s, who=who, up_to=at)
            values: dict[str, Any] = {
                "held": row.held - s.from_reservation - s.release,
                "charged": row.charged + s.charged - s.refund,
                "last_charged_at": at,
            }
            if finished:
                values.update(state=FINALIZED, finished_at=at)
            await conn.execute(
                update(reservations)
                .where(reservations.c.allocation_id == allocation_id)
                .values(**values)
            )
        return _result(allocation_id, s)

    async def _apply(
        self,
        conn: AsyncConnection,
        row: Any,
        s: Settlement,
        *,
        who: str | None,
        up_to: datetime | None = None,
    ) -> None:
        """Write a settlement's journal rows: charge, refund, release (each its own)."""
        proj = acc.project_account(row.tenant, row.project)
        rsv = acc.reservation_account(row.tenant, row.project)
        common = {
            "allocation_id": row.allocation_id,
            "tenant": row.tenant,
            "project": row.project,
            "user": row.user,
            "vcluster": row.vcluster,
            "who": who,
        }
        props: dict[str, Any] = {"case": s.case}
        if up_to is not None:
            if row.last_charged_at is not None:
                props["charge_period_start"] = row.last_charged_at.isoformat()
            props["charge_period_end"] = up_to.isoformat()
        if s.charged > 0:
            moves = {rsv: -s.from_reservation, proj: -s.from_project, acc.SYSTEM: s.charged}
            await self._post(
                conn, _Post("charge", moves, s.charged, properties=props | _exh(s), **common)
            )
        if s.refund > 0:
            await self._post(
                conn,
                _Post(
                    "refund",
                    {acc.SYSTEM: -s.refund, proj: s.refund},
                    s.refund,
                    properties={**props, "reason": "overcharged"},
                    **common,
                ),
            )
        if s.release > 0:
            await self._post(
                conn, _Post("release", {rsv: -s.release, proj: s.release}, s.release, **common)
            )

    # --- the periodic charge pass (set-based) ---------------------------------------------------

    async def charge_many(
        self,
        items: Sequence[ChargeItem],
        *,
        cursor_at: tuple[str, int] | None = None,
        who: str | None = None,
        attempts: int = 3,
    ) -> list[ChargeResult]:
        """One charging pass over many running allocations in ONE transaction, set-based
        (a few bulk statements, no round trip per allocation): lock the accounts involved
        (in name order), read the reservations, decide every charge with :func:`settle`
        in integer micro-units (a project's funds shared in allocation-id order), then
        update the reservations conditionally on what was read, and write all journal
        rows, ledger rows and balances (COPY and ``unnest`` on PostgreSQL, executemany on
        SQLite). When a reservation changed in between (a concurrent release or charge),
        the pass is rolled back and redone, up to ``attempts`` times.
        ``cursor_at=(name, revision)`` stores the durable cursor in the same transaction.
        Replays (``up_to`` not after the last charge) and closed reservations are
        skipped (``replay=True``)."""
        seen: set[str] = set()
        for it in items:
            if it.allocation_id in seen:
                raise ValidationError(
                    "an allocation appears twice in one charge pass",
                    details={"Allocation": it.allocation_id},
                    hint="Sum an allocation's costs into one item per pass.",
                )
            seen.add(it.allocation_id)
            parse_amount(it.amount, allow_zero=True)
        ordered = sorted(items, key=lambda i: i.allocation_id)
        for attempt in range(1, attempts + 1):
            try:
                return await self._charge_pass(ordered, cursor_at, who)
            except _PassConflict:
                if attempt == attempts:
                    raise Unavailable(
                        "the charge pass kept conflicting with concurrent changes",
                        details={"Attempts": attempts},
                        hint="Retry the pass; reservations were released or charged meanwhile.",
                    ) from None
        raise AssertionError("unreachable")

    async def _charge_pass(
        self, ordered: list[ChargeItem], cursor_at: tuple[str, int] | None, who: str | None
    ) -> list[ChargeResult]:
        batch = str(uuid.uuid4())
        now = self.clock()
        results: list[ChargeResult] = []
        async with self.engine.begin() as conn:
            rows = await self._read_reservations(conn, [i.allocation_id for i in ordered])
            names: dict[tuple[str, str], tuple[str, str]] = {}
            for r in rows.values():
                key = (r[0], r[1])
                if key not in names:
                    names[key] = (acc.project_account(*key), acc.reservation_account(*key))
            balances = await self._lock_accounts(
                conn, sorted({n for pair in names.values() for n in pair} | {acc.SYSTEM})
            )
            available = {p: to_micros(balances[p]) for p, _ in names.values()}
            deltas: dict[str, int] = defaultdict(int)
            # (allocation, row, up_to, settlement) in micro-units
            plans: list[tuple[str, tuple[Any, ...], datetime, Settlement]] = []
            for it in ordered:
                r = rows.get(it.allocation_id)
                if r is None or r[6] != OPEN or (r[7] is not None and it.up_to <= r[7]):
                    results.append(ChargeResult(it.allocation_id, ZERO, False, replay=True))
                    continue
                proj, rsv = names[(r[0], r[1])]
                held, charged = r[4], r[5]
                s = settle(
                    held=held,
                    available=available[proj],
                    charged=charged,
                    total=charged + to_micros(it.amount),
                    finished=False,
                )
                available[proj] -= s.from_project
                deltas[proj] -= s.from_project
                deltas[rsv] -= s.from_reservation
                deltas[acc.SYSTEM] += s.charged
                results.append(
                    ChargeResult(
                        it.allocation_id,
                        from_micros(s.charged),
                        s.exhausted,
                        s.case,
                        from_micros(s.from_reservation),
                        from_micros(s.from_project),
                    )
                )
                plans.append((it.allocation_id, r, it.up_to, s))
            charged_plans = [p for p in plans if p[3].charged > 0]
            jids = await self._journal_ids(conn, len(charged_plans)) if charged_plans else []
            # PostgreSQL updates the reservations while this process builds the rows below
            updating = await self._update_reservations(conn, plans) if plans else None
            try:
                if charged_plans:
                    jrows: list[tuple[Any, ...]] = []
                    legs: list[tuple[int, str, int]] = []
                    props_cache: dict[tuple[Any, ...], str] = {}
                    for jid, (aid, r, up_to, s) in zip(jids, charged_plans, strict=True):
                        pkey = (s.case, r[7], up_to, s.exhausted)
                        props = props_cache.get(pkey)
                        if props is None:
                            d: dict[str, Any] = {
                                "case": s.case,
                                "charge_period_end": up_to.isoformat(),
                            }
                            if r[7] is not None:
                                d["charge_period_start"] = r[7].isoformat()
                            if s.exhausted:
                                d["exhausted"] = True
                            props = props_cache[pkey] = json.dumps(d)
                        jrows.append(
                            (jid, now, "charge", aid, r[0], r[1], r[2], r[3], s.charged, who, batch,
                             props)
                        )  # fmt: skip
                        proj, rsv = names[(r[0], r[1])]
                        if s.from_reservation:
                            legs.append((jid, rsv, -s.from_reservation))
                        if s.from_project:
                            legs.append((jid, proj, -s.from_project))
                        legs.append((jid, acc.SYSTEM, s.charged))
            finally:
                if updating is not None and not updating.done():
                    # never leave the statement in flight on the connection
                    await asyncio.wait([updating])
            if updating is not None:
                await updating  # raises _PassConflict when a reservation changed meanwhile
            if charged_plans:
                await self._bulk_insert(conn, "journal", JOURNAL_COLUMNS, jrows)
                await self._bulk_insert(conn, "ledger", LEDGER_COLUMNS, legs)
                await self._bulk_add_balances(conn, sorted((n, d) for n, d in deltas.items() if d))
            if cursor_at is not None:
                await self._store_cursor(conn, *cursor_at)
        return results

    async def _read_reservations(
        self, conn: AsyncConnection, ids: list[str]
    ) -> dict[str, tuple[Any, ...]]:
        """allocation id -> (tenant, project, user, vcluster, held, charged, state,
        last_charged_at), money in micro-units; read without locks (the update that
        follows is conditional on these values)."""
        cols = 'allocation_id, tenant, project, "user", vcluster, held, charged, state, last_charged_at'
        out: dict[str, tuple[Any, ...]] = {}
        if self.postgres:
            raw = await conn.get_raw_connection()
            for rec in await raw.driver_connection.fetch(
                f"SELECT {cols} FROM reservations WHERE allocation_id = ANY($1::text[])", ids
            ):
                out[rec[0]] = tuple(rec[1:])
            return out
        for k in range(0, len(ids), CHUNK):
            part = ids[k : k + CHUNK]
            marks = ", ".join("?" for _ in part)
            res = await conn.exec_driver_sql(
                f"SELECT {cols} FROM reservations WHERE allocation_id IN ({marks})", tuple(part)
            )
            for rec in res:
                t = rec[8]
                when = datetime.fromisoformat(t).replace(tzinfo=UTC) if t else None
                out[rec[0]] = (*tuple(rec[1:8]), when)
        return out

    async def _update_reservations(
        self, conn: AsyncConnection, plans: list[tuple[str, tuple[Any, ...], datetime, Settlement]]
    ) -> Any:
        """Apply the pass to the reservations, only where they still are as read. On
        PostgreSQL this returns a task already sent to the server (the caller builds its
        rows meanwhile and awaits it); on SQLite it is done on return."""
        if self.postgres:
            raw = await conn.get_raw_connection()
            stmt = await raw.driver_connection.prepare(_UPDATE_RESERVATIONS_PG)
            args = (
                [p[0] for p in plans],
                [p[1][4] - p[3].from_reservation for p in plans],
                [p[1][5] + p[3].charged for p in plans],
                [p[2] for p in plans],
                [p[1][4] for p in plans],
                [p[1][5] for p in plans],
            )
            task = asyncio.ensure_future(_expect(stmt.fetchval(*args), len(plans)))
            await asyncio.sleep(0)  # Bind/Execute are on the wire after this step
            return task
        # SQLite: the write lock is held since BEGIN IMMEDIATE; nothing changed since
        await conn.exec_driver_sql(
            "UPDATE reservations SET held = ?, charged = ?, last_charged_at = ? "
            "WHERE allocation_id = ?",
            [
                (p[1][4] - p[3].from_reservation, p[1][5] + p[3].charged, _sqlite_value(p[2]), p[0])
                for p in plans
            ],
        )
        return None

    async def _lock_accounts(self, conn: AsyncConnection, names: list[str]) -> dict[str, Decimal]:
        """Balances of ``names``, locked in name order on PostgreSQL (the global order)."""
        out: dict[str, Decimal] = {}
        for k in range(0, len(names), CHUNK):
            q = select(accounts.c.name, accounts.c.balance).where(
                accounts.c.name.in_(names[k : k + CHUNK])
            )
            if self.postgres:
                q = q.order_by(accounts.c.name).with_for_update()
            for name, bal in await conn.execute(q):
                out[name] = bal
        missing = [n for n in names if n not in out]
        if missing:
            raise _unknown_account(missing[0])
        return out

    async def _journal_ids(self, conn: AsyncConnection, n: int) -> list[int]:
        """``n`` fresh journal ids (from the sequence on PostgreSQL; on SQLite this
        transaction holds the write lock, so max + 1 onwards is free)."""
        if self.postgres:
            ids = await conn.execute(
                text(
                    "SELECT nextval(pg_get_serial_sequence('journal', 'id')) "
                    "FROM generate_series(1, :n)"
                ),
                {"n": n},
            )
            return [int(i) for i in ids.scalars()]
        last = (await conn.execute(select(func.coalesce(func.max(journal.c.id), 0)))).scalar_one()
        return list(range(int(last) + 1, int(last) + 1 + n))

    async def _bulk_insert(
        self,
        conn: AsyncConnection,
        table: str,
        columns: tuple[str, ...],
        records: list[tuple[Any, ...]],
    ) -> None:
        """Rows already in storage form (micro-units, JSON text, aware UTC times)."""
        if not records:
            return
        if self.postgres:
            raw = await conn.get_raw_connection()
            await raw.driver_connection.copy_records_to_table(
                table, records=records, columns=list(columns)
            )
            return
        cols = ", ".join(f'"{c}"' for c in columns)
        marks = ", ".join("?" for _ in columns)
        rows = [tuple(_sqlite_value(v) for v in rec) for rec in records]
        await conn.exec_driver_sql(f"INSERT INTO {table} ({cols}) VALUES ({marks})", rows)

    async def _bulk_add_balances(
        self, conn: AsyncConnection, deltas: list[tuple[str, int]]
    ) -> None:
        """Add micro-unit deltas to balances (rows already locked in name order)."""
        if self.postgres:
            raw = await conn.get_raw_connection()
            await raw.driver_connection.execute(
                "UPDATE accounts AS a SET balance = a.balance + u.d "
                "FROM unnest($1::text[], $2::bigint[]) AS u(n, d) WHERE a.name = u.n",
                [n for n, _ in deltas],
                [d for _, d in deltas],
            )
            return
        await conn.exec_driver_sql(
            "UPDATE accounts SET balance = balance + ? WHERE name = ?",
            [(d, n) for n, d in deltas],
        )

    # --- the durable cursor -----------------------------------------------------------------

    async def _store_cursor(self, conn: AsyncConnection, name: str, revision: int) -> None:
        res = await conn.execute(
            update(cursor)
            .where(cursor.c.name == name)
            .values(revision=revision, updated_at=self.clock())
        )
        if res.rowcount == 0:
            await conn.execute(
                insert(cursor).values(name=name, revision=revision, updated_at=self.clock())
            )

    async def set_cursor(self, name: str, revision: int) -> None:
        async with self.engine.begin() as conn:
            await self._store_cursor(conn, name, revision)

    async def get_cursor(self, name: str) -> int | None:
        async with self.engine.connect() as conn:
            v = (
                await conn.execute(select(cursor.c.revision).where(cursor.c.name == name))
            ).scalar_one_or_none()
            await conn.rollback()
        return None if v is None else int(v)

    # --- reading --------------------------------------------------------------------------

    async def balance(self, ref: str) -> Balance:
        """``"<tenant>"`` or ``"<tenant>/<project>"``: available, reserved, spent (charges
        less refunds). A tenant's ``allocated`` is what its projects hold."""
        tenant, _, project = ref.partition("/")
        async with self.engine.connect() as conn:
            spent_q = select(
                func.coalesce(
                    func.sum(
                        case(
                            (journal.c.kind == "charge", journal.c.amount),
                            (journal.c.kind == "refund", -journal.c.amount),
                            else_=literal(0, type_=journal.c.amount.type),
                        )
                    ),
                    0,
                )
            ).where(journal.c.tenant == tenant, journal.c.kind.in_(("charge", "refund")))
            if project:
                names = [
                    acc.project_account(tenant, project),
                    acc.reservation_account(tenant, project),
                ]
                bal = dict(
                    (
                        await conn.execute(
                            select(accounts.c.name, accounts.c.balance).where(
                                accounts.c.name.in_(names)
                            )
                        )
                    ).all()
                )
                if names[0] not in bal:
                    raise _unknown_account(names[0])
                spent = (await conn.execute(spent_q.where(journal.c.project == project))).scalar()
                out = Balance(names[0], bal[names[0]], bal.get(names[1], ZERO), _dec(spent))
            else:
                rows = (
                    await conn.execute(
                        select(accounts.c.kind, func.sum(accounts.c.balance))
                        .where(accounts.c.tenant == tenant)
                        .group_by(accounts.c.kind)
                    )
                ).all()
                by_kind = {k: _dec(v) for k, v in rows}
                if "tenant" not in by_kind:
                    raise _unknown_account(acc.tenant_account(tenant))
                spent = (await conn.execute(spent_q)).scalar()
                out = Balance(
                    acc.tenant_account(tenant),
                    by_kind["tenant"],
                    by_kind.get("reservation", ZERO),
                    _dec(spent),
                    by_kind.get("project", ZERO),
                )
            await conn.rollback()
        return out

    async def topped_up(self, tenant: str) -> Decimal:
        """What came in for the tenant: top-ups plus adjustments credited to its accounts."""
        async with self.engine.connect() as conn:
            v = (
                await conn.execute(
                    select(func.coalesce(func.sum(journal.c.amount), 0)).where(
                        journal.c.tenant == tenant, journal.c.kind == "topup"
                    )
                )
            ).scalar()
            await conn.rollback()
        return _dec(v)

    async def transactions(
        self,
        *,
        tenant: str | None = None,
        project: str | None = None,
        allocation_id: str | None = None,
        kind: str | None = None,
        user: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: int = 100,
        before_id: int | None = None,
    ) -> Page:
        """Journal rows with their legs, newest first; keyset pagination on the id."""
        if kind is not None and kind not in KINDS:
            raise ValidationError(
                "unknown transaction kind",
                details={"Kind": kind, "Known": ", ".join(KINDS)},
                hint="Filter by one of the listed kinds.",
            )
        if not 1 <= limit <= 1000:
            raise ValidationError(
                "limit out of range",
                details={"Limit": limit},
                hint="Ask for 1 to 1000 transactions per page.",
            )
        conds = []
        for col, v in (
            (journal.c.tenant, tenant),
            (journal.c.project, project),
            (journal.c.allocation_id, allocation_id),
            (journal.c.kind, kind),
            (journal.c.user, user),
        ):
            if v is not None:
                conds.append(col == v)
        if since is not None:
            conds.append(journal.c.at >= since)
        if until is not None:
            conds.append(journal.c.at < until)
        if before_id is not None:
            conds.append(journal.c.id < before_id)
        q = (
            select(journal)
            .where(and_(true(), *conds))
            .order_by(journal.c.id.desc())
            .limit(limit + 1)
        )
        async with self.engine.connect() as conn:
            rows = (await conn.execute(q)).all()
            more = len(rows) > limit
            rows = rows[:limit]
            legs: dict[int, list[Leg]] = defaultdict(list)
            if rows:
                lq = (
                    select(ledger.c.journal_id, ledger.c.account, ledger.c.amount)
                    .where(ledger.c.journal_id.in_([r.id for r in rows]))
                    .order_by(ledger.c.id)
                )
                for jid, a, amt in await conn.execute(lq):
                    legs[jid].append(Leg(a, amt))
            await conn.rollback()
        items = [
            Transaction(
                r.id,
                r.at,
                r.kind,
                r.amount,
                r.allocation_id,
                r.tenant,
                r.project,
                r.user,
                r.vcluster,
                r.who,
                r.properties or {},
                tuple(legs[r.id]),
            )
            for r in rows
        ]
        return Page(items, items[-1].id if more and items else None)

    async def costs(
        self,
        by: str,
        *,
        tenant: str | None = None,
        project: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> list[tuple[str, Decimal]]:
        """Cost breakdown (charges less refunds) grouped by ``tenant``, ``project``,
        ``user``, ``vcluster`` or ``day`` (UTC date), largest first (days: in order)."""
        cols = {
            "tenant": journal.c.tenant,
            "project": journal.c.project,
            "user": journal.c.user,
            "vcluster": journal.c.vcluster,
        }
        if by == "day":
            key = (
                func.to_char(func.timezone("UTC", journal.c.at), "YYYY-MM-DD")
                if self.postgres
                else func.substr(journal.c.at, 1, 10)
            )
        elif by in cols:
            key = cols[by]
        else:
            raise ValidationError(
                "unknown cost breakdown",
                details={"By": by, "Known": "tenant, project, user, vcluster, day"},
                hint="Group costs by tenant, project, user, vcluster or day.",
            )
        amount = func.sum(
            case(
                (journal.c.kind == "charge", journal.c.amount),
                else_=-journal.c.amount,
            )
        )
        conds = [journal.c.kind.in_(("charge", "refund"))]
        if tenant is not None:
            conds.append(journal.c.tenant == tenant)
        if project is not None:
            conds.append(journal.c.project == project)
        if since is not None:
            conds.append(journal.c.at >= since)
        if until is not None:
            conds.append(journal.c.at < until)
        q = select(key.label("k"), amount.label("amount")).where(*conds).group_by(key)
        async with self.engine.connect() as conn:
            rows = [(str(k) if k is not None else "", _dec(v)) for k, v in await conn.execute(q)]
            await conn.rollback()
        if by == "day":
            return sorted(rows)
        return sorted(rows, key=lambda kv: (-kv[1], kv[0]))

    # --- prices ---------------------------------------------------------------------------

    async def add_price(self, price: Price, *, who: str | None = None) -> Price:
        """Store a price; refused when its validity window overlaps another price for the
        same (vCluster, resource, GPU type, tenant)."""
        check_price(price)
        async with self.engine.begin() as conn:
            if self.postgres:
                await conn.execute(text("LOCK TABLE prices IN SHARE ROW EXCLUSIVE MODE"))
            same = await self._prices(
                conn,
                (prices.c.vcluster == price.vcluster)
                & (prices.c.resource == price.resource)
                & (prices.c.gpu_type == price.gpu_type)
                & (prices.c.tenant == price.tenant),
            )
            check_no_overlap(price, same)
            pid = (
                await conn.execute(
                    insert(prices)
                    .values(
                        vcluster=price.vcluster,
                        resource=price.resource,
                        gpu_type=price.gpu_type,
                        tenant=price.tenant,
                        rate=price.rate,
                        multiplier=price.multiplier,
                        fixed_cost=price.fixed_cost,
                        valid_from=price.valid_from,
                        valid_until=price.valid_until,
                        created_at=self.clock(),
                        who=who,
                    )
                    .returning(prices.c.id)
                )
            ).scalar_one()
        return _price_replace(price, int(pid))

    async def prices(self, vcluster: str | None = None) -> list[Price]:
        async with self.engine.connect() as conn:
            out = await self._prices(
                conn, prices.c.vcluster == vcluster if vcluster is not None else None
            )
            await conn.rollback()
        return out

    async def _prices(self, conn: AsyncConnection, where: Any) -> list[Price]:
        q = select(prices).order_by(prices.c.id)
        if where is not None:
            q = q.where(where)
        return [
            Price(
                r.vcluster,
                r.resource,
                r.rate,
                r.valid_from,
                r.valid_until,
                gpu_type=r.gpu_type,
                tenant=r.tenant,
                multiplier=r.multiplier,
                fixed_cost=r.fixed_cost,
                id=r.id,
            )
            for r in await conn.execute(q)
        ]

    # --- verification ----------------------------------------------------------------------

    async def verify(self) -> list[Discrepancy]:
        """Check the books: every journal's legs sum to zero, every balance equals the sum
        of its ledger rows, no account but ``system`` below zero, every reservation account
        holds what its open reservations hold. Empty when all is well."""
        out: list[Discrepancy] = []
        async with self.engine.connect() as conn:
            q = (
                select(ledger.c.journal_id, func.sum(ledger.c.amount))
                .group_by(ledger.c.journal_id)
                .having(func.sum(ledger.c.amount) != 0)
            )
            for jid, s in await conn.execute(q):
                out.append(Discrepancy("unbalanced_journal", str(jid), ZERO, _dec(s)))
            # the ledger has no foreign keys (bulk speed): orphans are reported here
            q = (
                select(ledger.c.journal_id, func.sum(ledger.c.amount))
                .where(~ledger.c.journal_id.in_(select(journal.c.id)))
                .group_by(ledger.c.journal_id)
            )
            for jid, s in await conn.execute(q):
                out.append(Discrepancy("orphan_ledger_rows", str(jid), ZERO, _dec(s)))
            q = (
                select(ledger.c.account, func.sum(ledger.c.amount))
                .where(~ledger.c.account.in_(select(accounts.c.name)))
                .group_by(ledger.c.account)
            )
            for name, s in await conn.execute(q):
                out.append(Discrepancy("unknown_account", name, ZERO, _dec(s)))
            sums = (
                select(ledger.c.account, func.sum(ledger.c.amount).label("s"))
                .group_by(ledger.c.account)
                .subquery()
            )
            q = select(accounts.c.name, accounts.c.balance, sums.c.s).join_from(
                accounts, sums, sums.c.account == accounts.c.name, isouter=True
            )
            for name, bal, s in await conn.execute(q):
                if bal != _dec(s):
                    out.append(Discrepancy("balance_mismatch", name, _dec(s), bal))
                if bal < 0 and not acc.may_go_negative(name):
                    out.append(Discrepancy("negative_balance", name, ZERO, bal))
            held = (
                select(
                    reservations.c.tenant,
                    reservations.c.project,
                    func.sum(reservations.c.held).label("h"),
                )
                .where(reservations.c.state == OPEN)
                .group_by(reservations.c.tenant, reservations.c.project)
                .subquery()
            )
            q = (
                select(accounts.c.name, accounts.c.balance, held.c.h)
                .join_from(
                    accounts,
                    held,
                    (held.c.tenant == accounts.c.tenant) & (held.c.project == accounts.c.project),
                    isouter=True,
                )
                .where(accounts.c.kind == "reservation")
            )
            for name, bal, h in await conn.execute(q):
                if bal != _dec(h):
                    out.append(Discrepancy("reservation_mismatch", name, _dec(h), bal))
            await conn.rollback()
        return out


# --- helpers -------------------------------------------------------------------------------


async def _expect(count: Any, n: int) -> None:
    if await count != n:
        raise _PassConflict()


def _sqlite_value(v: Any) -> Any:
    """Storage form on SQLite: naive UTC text times, like SQLAlchemy's DateTime."""
    if isinstance(v, datetime):
        return v.astimezone(UTC).replace(tzinfo=None).strftime("%Y-%m-%d %H:%M:%S.%f")
    return v


def _exh(s: Settlement) -> dict[str, Any]:
    return {"exhausted": True} if s.exhausted else {}


def _result(allocation_id: str, s: Settlement) -> ChargeResult:
    return ChargeResult(
        allocation_id,
        s.charged,
        s.exhausted,
        s.case,
        s.from_reservation,
        s.from_project,
        s.refund,
        s.release,
    )


def _dec(v: Any) -> Decimal:
    if v is None:
        return ZERO
    if isinstance(v, Decimal):
        return v
    return from_micros(int(v))


def _reservation(r: Any) -> Reservation:
    return Reservation(
        r.allocation_id,
        r.tenant,
        r.project,
        r.amount,
        r.held,
        r.charged,
        r.state,
        r.created_at,
        user=r.user,
        vcluster=r.vcluster,
        started_at=r.started_at,
        last_alive_at=r.last_alive_at,
        last_charged_at=r.last_charged_at,
        finished_at=r.finished_at,
    )


def _replace(r: Reservation, **kw: Any) -> Reservation:
    from dataclasses import replace

    return replace(r, **kw)


def _price_replace(p: Price, pid: int) -> Price:
    from dataclasses import replace

    return replace(p, id=pid)


def _check_allocation_id(allocation_id: str) -> None:
    if not isinstance(allocation_id, str) or not 1 <= len(allocation_id) <= 64:
        raise ValidationError(
            "invalid allocation id",
            details={"Allocation": repr(allocation_id)},
            hint="Reservations are keyed by the allocation id (1-64 characters).",
        )


def _unknown_account(name: str) -> NotFound:
    kind = acc.kind_of(name)
    hint = (
        "The tenant has no account yet: a top-up opens it "
        "(lattice account topup --tenant TENANT AMOUNT)."
        if kind == "tenant"
        else "The project has no account yet: a transfer opens it "
        "(lattice account transfer --tenant TENANT --project PROJECT AMOUNT)."
    )
    return NotFound(f"no account {name}", details={"Account": name}, hint=hint)


def _unknown_reservation(allocation_id: str) -> NotFound:
    return NotFound(
        f"no reservation for allocation {allocation_id}",
        details={"Allocation": allocation_id},
        hint="Reserve funds for the allocation before charging or releasing it.",
    )
