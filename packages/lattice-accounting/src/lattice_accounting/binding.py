"""The ledger operations of the service around the reservation gate.

The gate reserves under the submission's key (``rq-<request_id>``) before the quorum
has given the allocation an id; :meth:`ServiceLedger.bind` moves that money onto the
allocation id(s) once they exist, in one SQL transaction: one reservation row per
allocation (a task group's or DAG's share by estimate), the key's row closed as
``bound``. No account balance changes (the money stays in the project's reservation
account), so no journal row is needed; a single allocation's ``reserve`` journal row is
re-labelled with its allocation id so that its history reads as one.
"""

from __future__ import annotations

from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from lattice_common.errors import InvalidTransition, LatticeError, NotFound
from sqlalchemy import insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from lattice_accounting import accounts as acc
from lattice_accounting.ledger import OPEN, Ledger, _Post
from lattice_accounting.money import ZERO, from_micros, parse_amount, to_micros
from lattice_accounting.schema import journal, reservations
from lattice_accounting.settle import Settlement

BOUND = "bound"


def shares(total: Decimal, weights: Sequence[Decimal]) -> list[Decimal]:
    """``total`` split in proportion to ``weights`` (evenly when they are all zero), in
    micro-units, the rounding rest to the last: the shares always sum to ``total``."""
    n = len(weights)
    if n == 0:
        return []
    t = to_micros(total)
    w = [max(to_micros(x), 0) for x in weights]
    s = sum(w)
    if s == 0:
        w, s = [1] * n, n
    parts = [t * wi // s for wi in w]
    parts[-1] += t - sum(parts)
    return [from_micros(p) for p in parts]


class ServiceLedger(Ledger):
    """The ledger plus what the service does with reservations."""

    async def bind(
        self,
        key: str | None,
        members: Sequence[tuple[str, Decimal]],
        *,
        tenant: str | None = None,
        project: str | None = None,
        user: str | None = None,
        vcluster: str | None = None,
    ) -> list[str]:
        """Give each ``(allocation_id, weight)`` its reservation. ``key``: the gate's
        reservation, split by weight; None: empty reservations in ``tenant/project``
        (allocations that were not gated, charged from the project). Allocations that
        have one already are skipped (idempotent). Returns the ids bound now."""
        async with self.engine.begin() as conn:
            return await self._bind(
                conn, key, members, tenant=tenant, project=project, user=user, vcluster=vcluster
            )

    async def bind_many(
        self, groups: Sequence[tuple[str, Sequence[tuple[str, Decimal]]]]
    ) -> dict[str, LatticeError | list[str]]:
        """:meth:`bind` for many keys in ONE SQL transaction (the consumer's batch of
        deltas), each key in its own savepoint: a key that cannot be bound (released
        meanwhile) is reported as its error and does not undo the others."""
        out: dict[str, LatticeError | list[str]] = {}
        async with self.engine.begin() as conn:
            for key, members in groups:
                try:
                    async with conn.begin_nested():
                        out[key] = await self._bind(conn, key, members)
                except LatticeError as e:
                    out[key] = e
        return out

    async def _bind(
        self,
        conn: AsyncConnection,
        key: str | None,
        members: Sequence[tuple[str, Decimal]],
        *,
        tenant: str | None = None,
        project: str | None = None,
        user: str | None = None,
        vcluster: str | None = None,
    ) -> list[str]:
        ids = [m[0] for m in members]
        have = set(
            (
                await conn.execute(
                    select(reservations.c.allocation_id).where(
                        reservations.c.allocation_id.in_(ids)
                    )
                )
            )
            .scalars()
            .all()
        )
        todo = [(aid, w) for aid, w in members if aid not in have]
        if not todo:
            return []
        now = self.clock()
        if key is None:
            assert tenant and project
            await self._insert(conn, todo, [ZERO] * len(todo), tenant, project, user, vcluster, now)
            return [aid for aid, _ in todo]
        q = select(reservations).where(reservations.c.allocation_id == key)
        if self.postgres:  # the row locked for the move (accounts are untouched)
            q = q.with_for_update()
        row = (await conn.execute(q)).first()
        if row is None:
            raise NotFound(f"no reservation {key}", details={"Reservation": key})
        if row.state == BOUND:
            # a member seen after the others: charged from the project
            amounts = [ZERO] * len(todo)
        elif row.state != OPEN:
            raise InvalidTransition(
                f"reservation {key} is {row.state}",
                details={"Reservation": key, "State": row.state},
                hint="A released reservation cannot be bound; the allocation is charged "
                "from its project.",
            )
        else:
            amounts = shares(row.held, [w for _, w in todo])
        await self._insert(
            conn, todo, amounts, row.tenant, row.project, row.user, row.vcluster, row.created_at
        )
        if row.state == OPEN:
            await conn.execute(
                update(reservations)
                .where(reservations.c.allocation_id == key)
                .values(held=ZERO, state=BOUND)
            )
            if len(todo) == 1:
                await conn.execute(
                    update(journal)
                    .where(journal.c.allocation_id == key)
                    .values(allocation_id=todo[0][0])
                )
        return [aid for aid, _ in todo]

    async def _insert(
        self,
        conn: AsyncConnection,
        todo: Sequence[tuple[str, Decimal]],
        amounts: Sequence[Decimal],
        tenant: str,
        project: str,
        user: str | None,
        vcluster: str | None,
        created_at: Any,
    ) -> None:
        await conn.execute(
            insert(reservations),
            [
                {
                    "allocation_id": aid,
                    "tenant": tenant,
                    "project": project,
                    "user": user,
                    "vcluster": vcluster,
                    "amount": amt,
                    "held": amt,
                    "charged": ZERO,
                    "state": OPEN,
                    "created_at": created_at,
                }
                for (aid, _), amt in zip(todo, amounts, strict=True)
            ],
        )

    async def unhold(self, allocation_id: str, *, who: str | None = None) -> Decimal:
        """Give an open reservation's money back to the project but keep it open: the
        allocation is still queued and is charged from the project when it runs."""
        async with self.engine.begin() as conn:
            row, _ = await self._lock_open(conn, allocation_id)
            if row.held <= 0:
                return ZERO
            await self._apply(conn, row, Settlement("release", release=row.held), who=who)
            await conn.execute(
                update(reservations)
                .where(reservations.c.allocation_id == allocation_id)
                .values(held=ZERO)
            )
        return row.held

    async def hold_more(
        self, allocation_id: str, amount: object, *, who: str | None = None
    ) -> Decimal:
        """Move up to ``amount`` more from the project into the allocation's open
        reservation (an unbounded allocation's next charging period); as much as the
        project has. Returns what was moved."""
        a = parse_amount(amount)
        async with self.engine.begin() as conn:
            row, available = await self._lock_open(conn, allocation_id)
            move = min(a, available)
            if move <= 0:
                return ZERO
            proj = acc.project_account(row.tenant, row.project)
            rsv = acc.reservation_account(row.tenant, row.project)
            await self._post(
                conn,
                _Post(
                    "reserve",
                    {proj: -move, rsv: move},
                    move,
                    allocation_id=allocation_id,
                    tenant=row.tenant,
                    project=row.project,
                    user=row.user,
                    vcluster=row.vcluster,
                    who=who,
                    properties={"reason": "ahead"},
                ),
            )
            await conn.execute(
                update(reservations)
                .where(reservations.c.allocation_id == allocation_id)
                .values(held=row.held + move, amount=row.amount + move)
            )
        return move


__all__ = ["BOUND", "ServiceLedger", "shares"]
