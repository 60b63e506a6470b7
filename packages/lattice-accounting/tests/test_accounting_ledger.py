"""The ledger on SQLite and on a real PostgreSQL: migrations, money movements, the
charger's cases to the cent, refusals that write nothing, queries."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal as D

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from lattice_accounting.db import HEAD, current_revision, migrate
from lattice_accounting.errors import InsufficientFunds
from lattice_accounting.ledger import ChargeItem, Ledger
from lattice_accounting.schema import metadata
from lattice_common.errors import InvalidTransition, LatticeError, NotFound, ValidationError
from ledger_backends import T0, db_url, ledger, row_counts  # noqa: F401 (fixtures)
from sqlalchemy.ext.asyncio import create_async_engine


async def test_migrations_create_the_schema_from_empty(db_url: str) -> None:  # noqa: F811
    assert await current_revision(db_url) is None
    await migrate(db_url)
    await migrate(db_url)  # idempotent: already at head
    assert await current_revision(db_url) == HEAD
    engine = create_async_engine(db_url)
    try:
        async with engine.connect() as conn:

            def diff(sync_conn: object) -> list[object]:
                ctx = MigrationContext.configure(sync_conn, opts={"compare_type": False})
                return compare_metadata(ctx, metadata)

            # the runtime tables are exactly what the migration created
            assert await conn.run_sync(diff) == []
    finally:
        await engine.dispose()
    led = await Ledger.open(db_url)
    try:
        assert [t.kind for t in (await led.transactions()).items] == []
        assert await led.verify() == []
    finally:
        await led.close()


async def test_topup_transfer_reserve_and_balances(ledger: Ledger) -> None:  # noqa: F811
    await ledger.topup("acme", "100.00")
    await ledger.transfer("acme", "default", D("60"))
    r = await ledger.reserve("alloc-1", "acme/default", "25.50", user="alice", vcluster="gpu")
    assert (r.held, r.state, r.existing) == (D("25.50"), "reserved", False)
    again = await ledger.reserve("alloc-1", "acme/default", "25.50")
    assert again.existing and again.held == D("25.50")
    p = await ledger.balance("acme/default")
    assert (p.available, p.reserved, p.spent) == (D("34.50"), D("25.50"), D(0))
    t = await ledger.balance("acme")
    assert (t.available, t.allocated, t.reserved, t.spent) == (D(40), D("34.50"), D("25.50"), D(0))
    assert await ledger.verify() == []


async def test_each_charger_case_to_the_cent(ledger: Ledger) -> None:  # noqa: F811
    await ledger.topup("acme", "100")
    await ledger.transfer("acme", "default", "50")
    # running, charged twice (the second overflows the reservation), then finished
    await ledger.reserve("run", "acme", "10.00", user="alice", vcluster="gpu")
    c1 = await ledger.charge("run", "6.40", T0 + timedelta(minutes=5))
    assert (c1.case, c1.from_reservation, c1.from_project) == (
        "unfinished_uncharged", D("6.40"), D(0),
    )  # fmt: skip
    c2 = await ledger.charge("run", "4.60", T0 + timedelta(minutes=10))
    assert (c2.case, c2.from_reservation, c2.from_project, c2.exhausted) == (
        "unfinished_partially_charged", D("3.60"), D("1.00"), False,
    )  # fmt: skip
    replay = await ledger.charge("run", "4.60", T0 + timedelta(minutes=10))
    assert replay.replay and replay.charged == 0
    fin = await ledger.finalize("run", "12.01", at=T0 + timedelta(minutes=11))
    assert (fin.case, fin.charged, fin.released) == ("finished_partially_charged", D("1.01"), D(0))
    # finished without any charge: full cost, rest released
    await ledger.reserve("short", "acme", "5.00")
    f2 = await ledger.finalize("short", "1.99")
    assert (f2.case, f2.charged, f2.released) == ("finished_uncharged", D("1.99"), D("3.01"))
    # overcharged: refund to the project
    await ledger.reserve("over", "acme", "3.00")
    await ledger.charge("over", "2.50", T0 + timedelta(minutes=1))
    f3 = await ledger.finalize("over", "2.25")
    assert (f3.case, f3.refund, f3.released) == ("finished_overcharged", D("0.25"), D("0.50"))
    p = await ledger.balance("acme/default")
    # 50 - 12.01 - 1.99 - 2.25 spent, nothing left reserved
    assert (p.available, p.reserved, p.spent) == (D("33.75"), D(0), D("16.25"))
    with pytest.raises(InvalidTransition):
        await ledger.charge("over", "1", T0 + timedelta(hours=1))
    assert await ledger.verify() == []


async def test_running_out_of_funds_drains_and_reports_exhausted(ledger: Ledger) -> None:  # noqa: F811
    await ledger.topup("acme", "10")
    await ledger.transfer("acme", "default", "10")
    await ledger.reserve("a", "acme", "4")
    res = await ledger.charge("a", "15", T0 + timedelta(hours=1))
    assert (res.charged, res.exhausted) == (D("10"), True)
    p = await ledger.balance("acme/default")
    assert (p.available, p.reserved, p.spent) == (D(0), D(0), D(10))
    assert await ledger.verify() == []


@pytest.mark.parametrize(
    "call",
    [
        lambda led: led.topup("acme", "-5"),
        lambda led: led.topup("acme", "0"),
        lambda led: led.topup("acme", "ten"),
        lambda led: led.topup("acme", 1.5),
        lambda led: led.topup("acme", "1.0000001"),
        lambda led: led.topup("nobody", "5"),
        lambda led: led.transfer("acme", "default", "1000"),
        lambda led: led.transfer("acme", "nope", "1"),
        lambda led: led.reserve("x", "acme/default", "1000"),
        lambda led: led.reserve("x", "acme/nope", "1"),
        lambda led: led.reserve("", "acme/default", "1"),
        lambda led: led.charge("missing", "1", T0),
        lambda led: led.release("missing"),
    ],
)
async def test_bad_input_is_refused_with_a_hint_and_writes_nothing(ledger: Ledger, call) -> None:  # noqa: F811
    await ledger.topup("acme", "20")
    await ledger.transfer("acme", "default", "10")
    before = await row_counts(ledger)
    with pytest.raises(LatticeError) as e:
        await call(ledger)
    assert isinstance(e.value, ValidationError | NotFound | InsufficientFunds)
    assert e.value.hint
    assert await row_counts(ledger) == before
    assert await ledger.verify() == []


async def test_charge_pass_matches_one_by_one_charges(ledger: Ledger) -> None:  # noqa: F811
    await ledger.open_project("acme", "ml")
    await ledger.topup("acme", "1000")
    await ledger.transfer("acme", "default", "30")
    await ledger.transfer("acme", "ml", "100")
    for i in range(6):
        await ledger.reserve(f"a{i}", "acme/default" if i % 2 else "acme/ml", "5", user=f"u{i % 3}")
    await ledger.charge("a0", "1", T0)  # already charged up to T0: a replay in the pass
    up_to = T0 + timedelta(minutes=30)
    items = [ChargeItem(f"a{i}", D(i * 3), up_to) for i in range(6)]
    items[0] = ChargeItem("a0", D("2"), T0)
    items[5] = ChargeItem("a5", D("20"), up_to)
    res = {r.allocation_id: r for r in await ledger.charge_many(items, cursor_at=("charger", 7))}
    assert res["a0"].replay
    # default project (a1, a3, a5): 3, 9, 20 due; 5 each reserved; 30 - 15 left in the
    # project, shared in allocation-id order: a3 takes 4, a5 the remaining 11 of its 15
    assert (res["a3"].from_reservation, res["a3"].from_project) == (D(5), D(4))
    assert (res["a5"].from_project, res["a5"].exhausted) == (D(11), True)
    assert await ledger.get_cursor("charger") == 7
    p = await ledger.balance("acme/default")
    assert (p.available, p.reserved, p.spent) == (D(0), D(2), D(28))
    again = await ledger.charge_many(items[1:])  # the same period again: replays
    assert all(r.replay for r in again)
    assert await ledger.verify() == []


async def test_transactions_and_cost_breakdowns(ledger: Ledger) -> None:  # noqa: F811
    await ledger.topup("acme", "100")
    await ledger.transfer("acme", "default", "100")
    await ledger.reserve("a", "acme", "10", user="alice", vcluster="gpu")
    await ledger.reserve("b", "acme", "10", user="bob", vcluster="cpu")
    await ledger.charge("a", "7", T0 + timedelta(hours=1))
    ledger.clock.advance(days=1)  # type: ignore[attr-defined]
    await ledger.charge("b", "3", T0 + timedelta(hours=25))
    await ledger.finalize("a", "6")  # 1 refunded
    assert await ledger.costs("user", tenant="acme") == [("alice", D(6)), ("bob", D(3))]
    assert await ledger.costs("vcluster") == [("gpu", D(6)), ("cpu", D(3))]
    assert await ledger.costs("day", tenant="acme") == [("2026-03-01", D(7)), ("2026-03-02", D(2))]
    assert await ledger.costs("project", tenant="acme") == [("default", D(9))]
    page = await ledger.transactions(tenant="acme", limit=3)
    assert [t.kind for t in page.items] == ["release", "refund", "charge"]
    assert all(sum(leg.amount for leg in t.legs) == 0 for t in page.items)
    rest = await ledger.transactions(tenant="acme", limit=100, before_id=page.next_before_id)
    assert [t.kind for t in rest.items] == ["charge", "reserve", "reserve", "transfer", "topup"]
    assert rest.next_before_id is None
    only = await ledger.transactions(allocation_id="a", kind="charge")
    assert [t.amount for t in only.items] == [D(7)]
    with pytest.raises(ValidationError):
        await ledger.costs("planet")


async def test_release_and_cancel_return_the_reservation(ledger: Ledger) -> None:  # noqa: F811
    await ledger.topup("acme", "10")
    await ledger.transfer("acme", "default", "10")
    await ledger.reserve("a", "acme", "4")
    await ledger.reserve("b", "acme", "4")
    await ledger.charge("a", "1", T0)
    assert await ledger.release("a") == D(3)
    assert await ledger.release("b", cancelled=True) == D(4)
    assert (await ledger.reservation("b")).state == "cancelled"  # type: ignore[union-attr]
    with pytest.raises(InvalidTransition):
        await ledger.release("a")
    p = await ledger.balance("acme/default")
    assert (p.available, p.reserved, p.spent) == (D(9), D(0), D(1))
    assert await ledger.verify() == []


async def test_verify_reports_a_tampered_balance(ledger: Ledger) -> None:  # noqa: F811
    from lattice_accounting.schema import accounts
    from sqlalchemy import update

    await ledger.topup("acme", "10")
    async with ledger.engine.begin() as conn:
        await conn.execute(
            update(accounts).where(accounts.c.name == "tenant:acme").values(balance=D(11))
        )
    found = await ledger.verify()
    assert [(d.what, d.subject, d.expected, d.actual) for d in found] == [
        ("balance_mismatch", "tenant:acme", D(10), D(11))
    ]


async def test_an_adjustment_is_journaled_with_its_reason(ledger: Ledger) -> None:  # noqa: F811
    await ledger.adjust("project:acme/default", D("12.5"), "goodwill credit", who="admin")
    await ledger.adjust("project:acme/default", D("-2.5"), "typo", who="admin")
    assert (await ledger.balance("acme/default")).available == D(10)
    with pytest.raises(InsufficientFunds):
        await ledger.adjust("project:acme/default", D("-11"), "too much")
    with pytest.raises(NotFound):
        await ledger.adjust("project:acme/nope", D("1"), "unknown")
    for account in ("system", "reservation:acme/default"):
        with pytest.raises(ValidationError):
            await ledger.adjust(account, D("1"), "not adjustable")
    page = await ledger.transactions(project="default", kind="adjustment")
    assert [(t.amount, t.properties["reason"], t.who) for t in page.items] == [
        (D("2.5"), "typo", "admin"),
        (D("12.5"), "goodwill credit", "admin"),
    ]
    assert await ledger.verify() == []
