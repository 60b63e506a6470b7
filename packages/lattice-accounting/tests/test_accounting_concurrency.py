"""The reservation gate under concurrency, on a real PostgreSQL (and serialised SQLite):
many submitters racing for one project's funds never reserve more than it holds."""

from __future__ import annotations

import asyncio
from decimal import Decimal as D

import pytest
from lattice_accounting.db import make_engine
from lattice_accounting.errors import InsufficientFunds
from lattice_accounting.ledger import Ledger
from ledger_backends import Clock, fresh_url


@pytest.mark.parametrize("backend", ["postgres", "sqlite"])
async def test_parallel_reservations_never_over_reserve(
    backend: str, tmp_path, request: pytest.FixtureRequest
) -> None:
    url = fresh_url(backend, tmp_path, request)
    setup = await Ledger.open(url)
    await setup.open_tenant("acme")
    await setup.open_project("acme", "ml")
    await setup.topup("acme", "1000")
    await setup.transfer("acme", "default", "100.00")  # room for 40 of 2.50
    await setup.transfer("acme", "ml", "10.00")  # room for 4
    await setup.close()
    # several engines (connection pools), 64 tasks, 4 attempts each on the hot project
    ledgers = [Ledger(make_engine(url, pool_size=8), clock=Clock()) for _ in range(4)]
    accepted: list[str] = []
    refused = 0

    async def submitter(k: int) -> None:
        nonlocal refused
        led = ledgers[k % len(ledgers)]
        for i in range(4):
            project = "acme/ml" if (k + i) % 8 == 0 else "acme/default"
            try:
                r = await led.reserve(f"alloc-{k}-{i}", project, "2.50")
                accepted.append(r.allocation_id)
            except InsufficientFunds:
                refused += 1

    try:
        await asyncio.gather(*(submitter(k) for k in range(64)))
        # the same allocation ids again, concurrently: every one returns the existing row
        again = await asyncio.gather(
            *(ledgers[i % 4].reserve(a, "acme/default", "2.50") for i, a in enumerate(accepted))
        )
        assert all(r.existing for r in again)
        led = ledgers[0]
        p = await led.balance("acme/default")
        ml = await led.balance("acme/ml")
        assert p.available >= 0 and ml.available >= 0
        assert p.available + p.reserved == D(100) and ml.available + ml.reserved == D(10)
        assert p.reserved + ml.reserved == D("2.50") * len(accepted)
        assert len(accepted) + refused == 256
        # the funds ran out exactly: nothing left that another 2.50 could have used
        assert p.available < D("2.50") and ml.available < D("2.50")
        assert await led.verify() == []
    finally:
        for led in ledgers:
            await led.close()


async def test_charge_pass_redoes_itself_when_a_reservation_changes_under_it(
    tmp_path, request: pytest.FixtureRequest
) -> None:
    """The pass reads reservations without row locks and updates them only where they
    are unchanged; a release committed in between makes it roll back and start over."""
    from datetime import timedelta

    from lattice_accounting.ledger import ChargeItem
    from ledger_backends import T0

    url = fresh_url("postgres", tmp_path, request)
    other = await Ledger.open(url)
    reads = 0

    class RacedLedger(Ledger):
        async def _read_reservations(self, conn, ids):  # type: ignore[no-untyped-def]
            nonlocal reads
            rows = await super()._read_reservations(conn, ids)
            reads += 1
            if reads == 1:  # another process releases "b" right after the first read
                await other.release("b")
            return rows

    led = RacedLedger(make_engine(url), clock=Clock())
    try:
        await other.open_tenant("acme")
        await other.topup("acme", "100")
        await other.transfer("acme", "default", "100")
        for a in ("a", "b", "c"):
            await other.reserve(a, "acme", "10")
        res = await led.charge_many(
            [ChargeItem(a, D(4), T0 + timedelta(minutes=5)) for a in ("a", "b", "c")]
        )
        assert reads == 2
        assert [(r.allocation_id, r.charged, r.replay) for r in res] == [
            ("a", D(4), False),
            ("b", D(0), True),  # released meanwhile: not charged
            ("c", D(4), False),
        ]
        p = await led.balance("acme/default")
        assert (p.available, p.reserved, p.spent) == (D(80), D(12), D(8))
        assert await led.verify() == []
    finally:
        await led.close()
        await other.close()
