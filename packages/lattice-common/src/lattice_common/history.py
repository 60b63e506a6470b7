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
from collections.abc import Collection, Iterable, Mapping, Sequence
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
    case,
    event,
    func,
    inspect,
    select,
    text,
    update,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DatabaseError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from lattice_common.ledger import node_and_gpu_count
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
    # what the ledger multiplies a run's seconds by (lattice_common.ledger
    # node_and_gpu_count; GPUs from the inventory when the record was stored), so usage
    # is summed in SQL; NULL only in rows stored before these columns existed, filled
    # in when the store opens
    Column("node_count", Integer, nullable=True),
    Column("gpu_count", Integer, nullable=True),
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


def _row(
    a: Allocation, revision: int, node_gpus: Mapping[str, int] | None = None
) -> dict[str, Any]:
    nodes, gpus = node_and_gpu_count(a, node_gpus)
    return {
        "node_count": nodes,
        "gpu_count": gpus,
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
        store = cls(engine)
        await store._add_ledger_columns()
        return store

    async def _add_ledger_columns(self) -> None:
        """A store made before ``node_count``/``gpu_count`` existed gets them, and its
        rows get their values from the stored records (GPUs: the record's own request,
        the inventory of then being unknown)."""

        def missing(sync_conn: Any) -> list[str]:
            have = {c["name"] for c in inspect(sync_conn).get_columns("allocation_history")}
            return [n for n in ("node_count", "gpu_count") if n not in have]

        async with self.engine.begin() as conn:
            for name in await conn.run_sync(missing):
                if self.dialect == "postgresql":
                    await conn.execute(
                        text(
                            f"ALTER TABLE allocation_history ADD COLUMN IF NOT EXISTS {name} INTEGER"
                        )
                    )
                else:
                    await conn.execute(
                        text(f"ALTER TABLE allocation_history ADD COLUMN {name} INTEGER")
                    )
        h = allocation_history.c
        while True:
            async with self.engine.begin() as conn:
                rows = (
                    await conn.execute(
                        select(h.allocation_id, h.ended_us, h.record)
                        .where(h.node_count.is_(None))
                        .limit(1000)
                    )
                ).all()
                for aid, eus, rec in rows:
                    nodes, gpus = node_and_gpu_count(_dec.decode(rec))
                    await conn.execute(
                        update(allocation_history)
                        .where(h.allocation_id == aid, h.ended_us == eus)
                        .values(node_count=nodes, gpu_count=gpus)
                    )
            if len(rows) < 1000:
                return

    async def close(self) -> None:
        await self.engine.dispose()

    # --- the writer -----------------------------------------------------------------

    async def append(
        self,
        records: Sequence[Allocation],
        *,
        revision: int,
        node_gpus: Mapping[str, int] | None = None,
    ) -> int:
        """Store the final records of terminal allocations read at quorum ``revision``,
        and move the cursor there, in one transaction. Returns how many rows were new
        (a replayed record adds none). Refuses a record that has not ended.
        ``node_gpus``: the GPU inventory of their nodes (the ledger's GPU count)."""
        for a in records:
            if not a.terminal or a.finished_at is None:
                raise ValueError(f"allocation {a.id} has not ended: {a.state.value}")
        rows = [_row(a, revision, node_gpus) for a in records]
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

    async def usage_sums(
        self, since: float, until: float, *, tenant: str | None = None, user: str | None = None
    ) -> dict[tuple[str, str], tuple[float, float, int]]:
        """The internal budget ledger over the stored rows, summed by the database:
        (tenant, user) -> (node_hours, gpu_hours, allocations) of the runs inside
        ``[since, until]`` (each run's ``min(end, until) - max(start, since)`` times
        its nodes or GPUs; one that touched the window counts as an allocation), the
        same numbers :func:`lattice_common.ledger.usage` gives from the records. One
        row per tenant and user, however many allocations."""
        h = allocation_history.c
        end = case((h.finished_at > until, until), else_=h.finished_at)
        start = case((h.started_at > since, h.started_at), else_=since)
        secs = end - start
        q = (
            select(
                h.tenant,
                h.user_name,
                func.sum(secs * h.node_count),
                func.sum(secs * h.gpu_count),
                func.count(),
            )
            .where(h.started_at.is_not(None), h.started_at <= until, h.finished_at >= since)
            .group_by(h.tenant, h.user_name)
        )
        if tenant:
            q = q.where(h.tenant == tenant)
        if user:
            q = q.where(h.user_name == user)
        async with self.engine.connect() as conn:
            rows = (await conn.execute(q)).all()
        return {
            (r[0], r[1]): (float(r[2] or 0.0) / 3600.0, float(r[3] or 0.0) / 3600.0, int(r[4]))
            for r in rows
        }

    async def stored_ids(self, ids: Collection[str]) -> set[str]:
        """Those of ``ids`` the store holds (asked in slices, so any number fits)."""
        out: set[str] = set()
        h = allocation_history.c
        wanted = sorted(set(ids))
        async with self.engine.connect() as conn:
            for i in range(0, len(wanted), 5000):
                rows = (
                    await conn.execute(
                        select(h.allocation_id).where(h.allocation_id.in_(wanted[i : i + 5000]))
                    )
                ).all()
                out.update(r[0] for r in rows)
        return out

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
