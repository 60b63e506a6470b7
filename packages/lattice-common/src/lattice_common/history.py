"""The allocation history store: the final records of terminal allocations after they
leave the quorum's state (ARCHITECTURE.md, "Outside the quorum": one history store,
shared by ``lattice history``, usage and accounting).

SQLite is the embedded default (``sqlite+aiosqlite:///path``), PostgreSQL when
configured (``postgresql+asyncpg://...``); SQLAlchemy 2 Core, async, as the accounting
ledger. A quorum of several members shares one store (PostgreSQL, or one SQLite path
all members reach): whichever member leads writes it.

Writes (:meth:`HistoryStore.append`) come from ONE writer, the leader's retention
sweeper (``lattice_api.history_sweeper``), in this order: append the records, then
propose their removal from the quorum. A crash between the two leaves them in the
quorum, and the next sweep appends them again: the primary key is the allocation id
plus its terminal moment (``ended_us``: ``finished_at`` in whole microseconds; a
terminal state is final, so it never changes), and an existing row is left alone
(``INSERT ... ON CONFLICT DO NOTHING``), so a replay adds nothing. The durable cursor
(``history_cursor``: the quorum revision the last batch was read at, and how many
records the store holds by then, counted from what each batch added) is written in the same SQL transaction as the rows.

Reads: :meth:`get` (one allocation by id), :meth:`get_many`, :meth:`matching` (the filters of
``ListAllocations``) and :meth:`ended_since` (usage windows). Readers merge them with
the quorum's live state, the live record winning (:func:`merge`): the quorum is read
FIRST and the store second, so an allocation removed in between is already in the
store (it was written before its removal was proposed) and is never missed.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import msgspec
from sqlalchemy import (
    BigInteger,
    Column,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    event,
    func,
    select,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DatabaseError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from lattice_common.types import Allocation, AllocationState

__all__ = ["CURSOR_NAME", "HistoryStore", "ended_us", "merge", "sqlite_url"]

CURSOR_NAME = "retention"

metadata = MetaData()

allocation_history = Table(
    "allocation_history",
    metadata,
    Column("allocation_id", String(64), primary_key=True),
    Column("ended_us", BigInteger, primary_key=True),  # finished_at, whole microseconds
    Column("state", String(16), nullable=False),
    Column("tenant", String(255), nullable=False, default=""),
    Column("project", String(255), nullable=False, default=""),
    Column("user_name", String(255), nullable=False, default=""),
    Column("vcluster", String(255), nullable=False, default=""),
    Column("task_group_id", String(64), nullable=False, default=""),
    Column("dag_id", String(64), nullable=False, default=""),
    Column("submitted_at", Float, nullable=False, default=0.0),
    Column("started_at", Float, nullable=True),
    Column("finished_at", Float, nullable=False),
    Column("exit_code", Integer, nullable=True),
    Column("removed_at_revision", BigInteger, nullable=False, default=0),
    Column("record", LargeBinary, nullable=False),  # the Allocation, msgpack
)
Index("ix_history_finished", allocation_history.c.finished_at)
Index("ix_history_tenant_user", allocation_history.c.tenant, allocation_history.c.user_name)
Index("ix_history_submitted", allocation_history.c.submitted_at)

history_cursor = Table(
    "history_cursor",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("revision", BigInteger, nullable=False),
    Column("records", BigInteger, nullable=False),
    Column("updated_at", Float, nullable=False),
)

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Allocation)


def ended_us(a: Allocation) -> int:
    """The allocation's terminal moment as the key's integer (exact on every backend)."""
    return round((a.finished_at or 0.0) * 1_000_000)


def sqlite_url(path: str) -> str:
    return f"sqlite+aiosqlite:///{path}"


def _row(a: Allocation, revision: int) -> dict[str, Any]:
    return {
        "allocation_id": a.id,
        "ended_us": ended_us(a),
        "state": a.state.value,
        "tenant": a.spec.tenant,
        "project": a.spec.project,
        "user_name": a.spec.user,
        "vcluster": a.spec.vcluster,
        "task_group_id": a.task_group_id,
        "dag_id": a.dag_id,
        "submitted_at": a.submitted_at,
        "started_at": a.started_at,
        "finished_at": a.finished_at or 0.0,
        "exit_code": a.exit_code,
        "removed_at_revision": revision,
        "record": _enc.encode(a),
    }


def merge(live: Iterable[Allocation], stored: Iterable[Allocation]) -> list[Allocation]:
    """Live records plus stored ones the live state no longer holds, oldest submission
    first; an id in both is the live one (no duplicates)."""
    out = {a.id: a for a in stored}
    out.update((a.id, a) for a in live)
    return sorted(out.values(), key=lambda a: (a.submitted_at, a.id))


class HistoryStore:
    """The store over one engine (module docstring). ``await HistoryStore.open(url)``
    creates the tables when they are missing."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name

    @classmethod
    async def open(cls, url: str) -> HistoryStore:
        sqlite = make_url(url).get_backend_name() == "sqlite"
        if sqlite:
            engine = create_async_engine(url, connect_args={"timeout": 60})
            _sqlite_pragmas(engine)
        else:
            engine = create_async_engine(url, pool_size=4, max_overflow=4)
        # members that share one store start together: "check, then create" races, and
        # the loser's CREATE fails with "already exists"; its next check finds the tables
        for attempt in range(3):
            try:
                async with engine.begin() as conn:
                    await conn.run_sync(metadata.create_all, checkfirst=True)
                break
            except DatabaseError as e:
                if "already exists" not in str(e) or attempt == 2:
                    await engine.dispose()
                    raise
        return cls(engine)

    async def close(self) -> None:
        await self.engine.dispose()

    # --- the writer -----------------------------------------------------------------

    async def append(self, records: Sequence[Allocation], *, revision: int) -> int:
        """Store the final records of terminal allocations read at quorum ``revision``,
        and move the cursor there, in one transaction. Returns how many rows were new
        (a replayed record adds none). Refuses a record that has not ended."""
        for a in records:
            if not a.terminal or a.finished_at is None:
                raise ValueError(f"allocation {a.id} has not ended: {a.state.value}")
        rows = [_row(a, revision) for a in records]
        async with self.engine.begin() as conn:
            # what the batch adds, counted over the batch (never the whole table)
            added = 0
            if rows:
                present = await _present(conn, [(r["allocation_id"], r["ended_us"]) for r in rows])
                fresh = {(r["allocation_id"], r["ended_us"]) for r in rows} - present
                added = len(fresh)
                await conn.execute(self._insert_ignore(allocation_history), rows)
            stored = (
                await conn.execute(
                    select(history_cursor.c.records).where(history_cursor.c.name == CURSOR_NAME)
                )
            ).scalar()
            total = int(stored or 0) + added
            await conn.execute(
                self._upsert_cursor(),
                {
                    "name": CURSOR_NAME,
                    "revision": revision,
                    "records": total,
                    "updated_at": time.time(),
                },
            )
        return added

    async def cursor(self) -> tuple[int, int]:
        """(quorum revision of the last batch, records stored); (0, 0) before any."""
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(
                    select(history_cursor.c.revision, history_cursor.c.records).where(
                        history_cursor.c.name == CURSOR_NAME
                    )
                )
            ).first()
        return (0, 0) if row is None else (int(row[0]), int(row[1]))

    def _insert_ignore(self, table: Table) -> Any:
        if self.dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert as pg_insert

            return pg_insert(table).on_conflict_do_nothing()
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        return sqlite_insert(table).on_conflict_do_nothing()

    def _upsert_cursor(self) -> Any:
        if self.dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert as dialect_insert
        else:  # the same ON CONFLICT API
            from sqlalchemy.dialects.sqlite import insert as dialect_insert
        stmt = dialect_insert(history_cursor)
        return stmt.on_conflict_do_update(
            index_elements=[history_cursor.c.name],
            set_={
                "revision": stmt.excluded.revision,
                "records": stmt.excluded.records,
                "updated_at": stmt.excluded.updated_at,
            },
        )

    # --- readers --------------------------------------------------------------------

    async def get(self, allocation_id: str) -> Allocation | None:
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(
                    select(allocation_history.c.record)
                    .where(allocation_history.c.allocation_id == allocation_id)
                    .order_by(allocation_history.c.ended_us.desc())
                    .limit(1)
                )
            ).first()
        return None if row is None else _dec.decode(row[0])

    async def get_many(self, ids: Collection[str]) -> dict[str, Allocation]:
        """The stored records of those of ``ids`` the store holds, by id."""
        if not ids:
            return {}
        h = allocation_history.c
        async with self.engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(h.record)
                    .where(h.allocation_id.in_(sorted(set(ids))))
                    .order_by(h.ended_us)
                )
            ).all()
        out = {}
        for r in rows:
            a = _dec.decode(r[0])
            out[a.id] = a
        return out

    async def matching(
        self,
        *,
        states: Collection[AllocationState] | None = None,
        tenant: str | None = None,
        vcluster: str | None = None,
        user: str | None = None,
        task_group: str | None = None,
        limit: int | None = None,
        ended_since: float | None = None,
        ended_until: float | None = None,
    ) -> list[Allocation]:
        """Stored allocations passing every given filter, oldest submission first;
        ``limit`` keeps the newest ``limit`` (the filters of ``ListAllocations``).
        With ``ended_since`` / ``ended_until`` only those that ended in
        ``[ended_since, ended_until)``, and ``limit`` keeps the latest to end
        (``lattice history --since/--until/--limit``): the database filters and cuts,
        so a request reads what it returns, not the whole history."""
        h = allocation_history.c
        q = select(h.record)
        if ended_since is not None:
            q = q.where(h.finished_at >= ended_since)
        if ended_until is not None:
            q = q.where(h.finished_at < ended_until)
        if states is not None:
            q = q.where(h.state.in_([s.value for s in states]))
        if tenant:
            q = q.where(h.tenant == tenant)
        if vcluster:
            q = q.where(h.vcluster == vcluster)
        if user:
            q = q.where(h.user_name == user)
        if task_group:
            q = q.where(h.task_group_id == task_group)
        if ended_since is not None or ended_until is not None:
            q = q.order_by(h.finished_at.desc(), h.allocation_id.desc())
        else:
            q = q.order_by(h.submitted_at.desc(), h.allocation_id.desc())
        if limit:
            q = q.limit(limit)
        async with self.engine.connect() as conn:
            rows = (await conn.execute(q)).all()
        out = [_dec.decode(r[0]) for r in rows]
        out.sort(key=lambda a: (a.submitted_at, a.id))
        return out

    async def ended_since(
        self, since: float, *, tenant: str | None = None, user: str | None = None
    ) -> list[Allocation]:
        """Stored allocations that ended at or after ``since`` and started (the ones a
        usage window from ``since`` can count). Usage reads the quorum after this; a
        caller that must not miss a batch moved in between compares :meth:`cursor`
        before and after (``lattice_api.ops.usage``)."""
        h = allocation_history.c
        q = select(h.record).where(h.finished_at >= since, h.started_at.is_not(None))
        if tenant:
            q = q.where(h.tenant == tenant)
        if user:
            q = q.where(h.user_name == user)
        async with self.engine.connect() as conn:
            rows = (await conn.execute(q)).all()
        return [_dec.decode(r[0]) for r in rows]

    async def count(self) -> int:
        async with self.engine.connect() as conn:
            return await _count(conn)


async def _present(conn: Any, keys: list[tuple[str, int]]) -> set[tuple[str, int]]:
    h = allocation_history.c
    ids = sorted({k[0] for k in keys})
    rows = (
        await conn.execute(select(h.allocation_id, h.ended_us).where(h.allocation_id.in_(ids)))
    ).all()
    return {(r[0], int(r[1])) for r in rows}


async def _count(conn: Any) -> int:
    return int((await conn.execute(select(func.count()).select_from(allocation_history))).scalar())


def _sqlite_pragmas(engine: AsyncEngine) -> None:
    @event.listens_for(engine.sync_engine, "connect")
    def _connect(dbapi_conn: Any, _rec: Any) -> None:
        cur = dbapi_conn.cursor()
        # WAL: readers (lattice history on any member sharing the file) never block the
        # writer; synchronous=FULL: an appended record survives a power loss before the
        # removal it precedes is proposed
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=FULL")
        cur.execute("PRAGMA busy_timeout=60000")
        cur.close()
