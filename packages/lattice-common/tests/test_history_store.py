"""The history store (lattice_common.history) on SQLite and on a throwaway PostgreSQL:
append then replay adds nothing, the cursor moves with each batch in the same
transaction, a record that has not ended is refused, and the readers' filters."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from lattice_common.history import HistoryStore, merge, sqlite_url
from lattice_common.types import Allocation, AllocationSpec, AllocationState

_n = itertools.count()


def ended(aid: str, *, user: str = "alice", at: float = 1000.0, code: int = 0) -> Allocation:
    return Allocation(
        id=aid,
        spec=AllocationSpec(tenant="t", vcluster="v", user=user, entrypoint="true"),
        state=AllocationState.COMPLETED if code == 0 else AllocationState.FAILED,
        submitted_at=at - 10,
        started_at=at - 5,
        finished_at=at,
        exit_code=code,
    )


@pytest.fixture(params=["sqlite", "postgresql"])
async def store(request: pytest.FixtureRequest, tmp_path: Any) -> Any:
    if request.param == "sqlite":
        url = sqlite_url(str(tmp_path / "history.db"))
    else:
        pg = request.getfixturevalue("postgres_server")
        url = pg.create_database(f"history_{next(_n)}_{id(tmp_path) % 100000}")
    s = await HistoryStore.open(url)
    yield s
    await s.close()


async def test_append_is_idempotent_on_replay_and_moves_the_cursor(store: HistoryStore) -> None:
    assert await store.cursor() == (0, 0)
    batch = [ended("a1"), ended("a2", code=3)]
    assert await store.append(batch, revision=7) == 2
    assert await store.cursor() == (7, 2)
    # the sweeper crashed before proposing the removal: the next sweep replays the batch
    assert await store.append([*batch, ended("a3")], revision=9) == 1
    assert await store.cursor() == (9, 3)
    assert await store.count() == 3
    got = await store.get("a2")
    assert got is not None and got.exit_code == 3 and got.state == AllocationState.FAILED


async def test_a_record_that_has_not_ended_is_refused_and_nothing_written(
    store: HistoryStore,
) -> None:
    running = ended("r1")
    running.state = AllocationState.RUNNING
    with pytest.raises(ValueError, match="has not ended"):
        await store.append([ended("ok"), running], revision=3)
    assert await store.count() == 0 and await store.cursor() == (0, 0)


async def test_readers_filter_like_the_listing(store: HistoryStore) -> None:
    await store.append(
        [ended("b1", at=100.0), ended("b2", user="bob", at=200.0), ended("b3", at=300.0, code=1)],
        revision=1,
    )
    assert [a.id for a in await store.matching(user="alice")] == ["b1", "b3"]
    assert [a.id for a in await store.matching(states={AllocationState.FAILED})] == ["b3"]
    assert [a.id for a in await store.matching(limit=2)] == ["b2", "b3"]  # the newest
    assert [a.id for a in await store.ended_since(150.0, user="alice")] == ["b3"]
    assert sorted(a.id for a in await store.ended_since(150.0)) == ["b2", "b3"]
    assert await store.get("nope") is None
    assert set(await store.get_many(["b1", "b3", "nope"])) == {"b1", "b3"}


def test_merge_prefers_the_live_record_and_never_duplicates() -> None:
    live = ended("x", at=50.0)
    live.exit_code = 9
    out = merge([live], [ended("x", at=50.0), ended("y", at=10.0)])
    assert [a.id for a in out] == ["y", "x"] and out[1].exit_code == 9


def test_members_opening_one_store_at_once_all_start(tmp_path) -> None:
    """Quorum members sharing a store start together; the loser of the create race
    used to die with "table allocation_history already exists"."""
    import subprocess
    import sys

    code = (
        "import asyncio, sys\n"
        "from lattice_common.history import HistoryStore, sqlite_url\n"
        "async def main():\n"
        "    s = await HistoryStore.open(sqlite_url(sys.argv[1]))\n"
        "    await s.close()\n"
        "asyncio.run(main())\n"
    )
    path = str(tmp_path / "history.db")
    procs = [subprocess.Popen([sys.executable, "-c", code, path]) for _ in range(4)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0, 0]


async def test_the_end_time_window_and_limit_are_applied_by_the_database(
    store: HistoryStore,
) -> None:
    """``lattice history --since/--until/--limit``: rows outside the window never leave
    the database, and the limit keeps the latest to END (not the latest submitted)."""
    late_submitted_early_end = ended("w4", at=250.0)
    late_submitted_early_end.submitted_at = 240.0
    await store.append(
        [
            ended("w1", at=100.0),
            ended("w2", at=200.0),
            ended("w3", at=300.0, user="bob"),
            late_submitted_early_end,
            ended("w5", at=400.0, code=1),
        ],
        revision=1,
    )
    got = await store.matching(ended_since=200.0, ended_until=400.0)
    assert [a.id for a in got] == ["w2", "w4", "w3"]  # oldest submission first
    assert [a.id for a in await store.matching(ended_since=260.0, user="alice")] == ["w5"]
    assert [a.id for a in await store.matching(ended_until=200.0)] == ["w1"]
    # the two latest to end are w5 (400) and w3 (300), though w4 was submitted after w3
    latest = await store.matching(ended_since=0.0, limit=2)
    assert sorted(a.id for a in latest) == ["w3", "w5"]
    assert await store.matching(ended_since=500.0) == []


async def test_usage_is_summed_by_the_database_as_the_ledger_counts(store: HistoryStore) -> None:
    """``usage_sums`` (SUM in SQL, one row per tenant and user) gives the numbers of the
    ledger run over the records: clipped to the window on both sides, nodes and GPUs
    (from the inventory given at append), an allocation that touched the window counted."""
    from lattice_common import ledger

    def run(aid: str, user: str, start: float, end: float, nodes: list[str]) -> Allocation:
        a = ended(aid, user=user, at=end)
        a.started_at, a.submitted_at, a.assigned_nodes = start, start - 1, nodes
        return a

    gpus = {"g1": 4, "g2": 4, "c1": 0}
    recs = [
        run("u1", "alice", 1000.0, 5000.0, ["g1", "g2"]),
        run("u2", "alice", 4000.0, 9000.0, ["c1"]),  # ends after the window
        run("u3", "bob", 100.0, 2000.0, ["g1"]),  # starts before it
        run("u4", "bob", 100.0, 200.0, ["g1"]),  # wholly before: not counted
        run("u5", "carol", 9500.0, 9900.0, ["g2"]),  # starts after it: not counted
    ]
    await store.append(recs, revision=1, node_gpus=gpus)
    since, until = 1500.0, 8000.0
    sums = await store.usage_sums(since, until)
    days = (until - since) / 86400.0
    for (tenant, user), (node_h, gpu_h, n) in sums.items():
        u = ledger.usage(recs, now=until, window_days=days, user=user, node_gpus=gpus)
        assert tenant == "t"
        assert node_h == pytest.approx(u.node_hours) and gpu_h == pytest.approx(u.gpu_hours)
        assert n == u.allocations
    assert set(sums) == {("t", "alice"), ("t", "bob")}
    assert sums[("t", "alice")][0] == pytest.approx((3500 * 2 + 4000) / 3600)
    assert sums[("t", "alice")][1] == pytest.approx(3500 * 8 / 3600)
    assert await store.usage_sums(since, until, user="bob") == {("t", "bob"): sums[("t", "bob")]}
    assert await store.stored_ids(["u1", "u5", "nope"]) == {"u1", "u5"}


async def test_a_store_made_before_the_ledger_columns_gets_them(tmp_path: Any) -> None:
    """Rows stored by the first version (no node/GPU counts) are filled in at open."""
    import sqlite3

    path = tmp_path / "old.db"
    s = await HistoryStore.open(sqlite_url(str(path)))
    a = ended("old1", at=5000.0)
    a.started_at, a.spec.nodes = 1400.0, 3
    await s.append([a], revision=1)
    await s.close()
    con = sqlite3.connect(path)  # as the first version made it
    con.execute("ALTER TABLE allocation_history DROP COLUMN node_count")
    con.execute("ALTER TABLE allocation_history DROP COLUMN gpu_count")
    con.commit()
    con.close()
    s = await HistoryStore.open(sqlite_url(str(path)))
    try:
        (node_h, _gpu_h, n) = (await s.usage_sums(0.0, 9000.0))[("t", "alice")]
        assert n == 1 and node_h == pytest.approx(3 * 3600 / 3600)
    finally:
        await s.close()
