"""Ledger databases for the accounting tests: a fresh SQLite file, or a fresh database
on the session's throwaway PostgreSQL (lattice_test_harness ``postgres_server``)."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from lattice_accounting.ledger import Ledger

_n = itertools.count()

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


class Clock:
    """A settable clock, so journal times and charge periods are deterministic."""

    def __init__(self, now: datetime = T0) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **kw: float) -> datetime:
        self.now += timedelta(**kw)
        return self.now


def fresh_url(backend: str, tmp_path: Any, request: pytest.FixtureRequest) -> str:
    if backend == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path}/ledger-{next(_n)}.db"
    pg = request.getfixturevalue("postgres_server")
    return pg.create_database(f"ledger_{next(_n)}")


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    """An empty database (not migrated) on each backend."""
    return fresh_url(request.param, tmp_path, request)


@pytest.fixture
async def ledger(db_url: str) -> AsyncIterator[Ledger]:
    """A migrated ledger with a settable clock (``ledger.clock``), tenant ``acme``
    opened (with its ``default`` project)."""
    led = await Ledger.open(db_url)
    led.clock = Clock()
    await led.open_tenant("acme")
    try:
        yield led
    finally:
        await led.close()


async def row_counts(led: Ledger) -> dict[str, int]:
    from lattice_accounting.schema import accounts, journal, ledger, prices, reservations
    from sqlalchemy import func, select

    out = {}
    async with led.engine.connect() as conn:
        for t in (accounts, journal, ledger, reservations, prices):
            out[t.name] = (await conn.execute(select(func.count()).select_from(t))).scalar_one()
        bal = (await conn.execute(select(accounts.c.name, accounts.c.balance))).all()
        out["balances"] = hash(tuple(sorted(bal)))  # type: ignore[assignment]
        await conn.rollback()
    return out
