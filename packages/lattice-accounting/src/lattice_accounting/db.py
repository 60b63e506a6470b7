"""Engines and migrations for the ledger database (SQLAlchemy 2 async + Alembic).

``sqlite+aiosqlite:///path`` is the embedded default; ``postgresql+asyncpg://...`` the
production backend. On SQLite every transaction starts with ``BEGIN IMMEDIATE``, which
takes the database's write lock up front, so read-check-write sequences (a balance
check then a debit) are serialised; on PostgreSQL the ledger relies on row locks
(conditional UPDATEs and ``SELECT ... FOR UPDATE``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import event, text
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
HEAD = "0001_ledger"


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def make_engine(url: str, *, pool_size: int = 10, **kw: Any) -> AsyncEngine:
    """An engine for the ledger: SQLite with WAL, a busy timeout and ``BEGIN
    IMMEDIATE``; PostgreSQL with a connection pool of ``pool_size``."""
    if is_sqlite(url):
        engine = create_async_engine(url, connect_args={"timeout": 60}, **kw)
        _serialise_sqlite(engine)
        return engine
    return create_async_engine(url, pool_size=pool_size, max_overflow=pool_size, **kw)


def _serialise_sqlite(engine: AsyncEngine) -> None:
    @event.listens_for(engine.sync_engine, "connect")
    def _connect(dbapi_conn: Any, _rec: Any) -> None:
        # take transaction control away from the driver so BEGIN IMMEDIATE is ours
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        # WAL with the default synchronous=FULL: a committed reservation survives a
        # power loss (the API proposes the submission only after it)
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=60000")
        cur.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def _alembic_config(conn: Connection) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["connection"] = conn
    return cfg


def _upgrade(conn: Connection, revision: str) -> None:
    if conn.dialect.name == "postgresql":
        # two processes migrating the same database at once take turns
        conn.execute(text("SELECT pg_advisory_xact_lock(7291001)"))
    command.upgrade(_alembic_config(conn), revision)


def _current(conn: Connection) -> str | None:
    from alembic.runtime.migration import MigrationContext

    return MigrationContext.configure(conn).get_current_revision()


async def migrate(url: str, revision: str = "head") -> None:
    """Bring the database at ``url`` up to ``revision`` (creates it from empty)."""
    if is_sqlite(url):
        db = make_url(url).database
        if db and db != ":memory:":
            Path(db).parent.mkdir(parents=True, exist_ok=True)
    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(_upgrade, revision)
    finally:
        await engine.dispose()


async def current_revision(url: str) -> str | None:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(_current)
    finally:
        await engine.dispose()
