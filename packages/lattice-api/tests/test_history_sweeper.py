"""The leader's history sweeper over a real state machine (LocalQuorum: the same apply)
and a real SQLite history store: records are stored before their removal is proposed,
a crash between the two only replays (nothing lost, nothing doubled), a follower does
nothing, and the readers (status by id, the history listing, usage) merge the store
with the live state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from lattice_api.auth import Identity, Role
from lattice_api.history_sweeper import HistorySweeper
from lattice_api.ops.allocations import AllocationOps
from lattice_api.ops.queue import QueueOps
from lattice_api.ops.usage import UsageOps
from lattice_common import commands as c
from lattice_common.history import HistoryStore, sqlite_url
from lattice_common.types import AllocationState
from lattice_quorum.local import LocalQuorum
from lattice_test_harness import builders as b

HOUR = 3600.0


class CrashOnce(LocalQuorum):
    """Dies once at the moment of proposing the removal (after the store was written)."""

    crash = True

    async def propose(self, cmd: c.Command) -> c.CommandResult:
        if isinstance(cmd, c.RemoveAllocations) and self.crash:
            self.crash = False
            raise ConnectionError("leader died before proposing")
        return await super().propose(cmd)


def ended_job(q: LocalQuorum, now: float, code: int = 0, user: str = "alice") -> str:
    a = q.apply(c.SubmitAllocation(spec=b.spec(tenant="t", vcluster="v", user=user), now=now))
    aid = a.allocation.id
    assert q.apply(c.AssignNodes(allocation_id=aid, node_ids=["n0000"], now=now + 1)).error is None
    state = AllocationState.COMPLETED if code == 0 else AllocationState.FAILED
    res = q.apply(
        c.UpdateAllocationState(allocation_id=aid, state=state, exit_code=code, now=now + 60)
    )
    assert res.error is None, res.error
    return aid


@pytest.fixture
async def world(tmp_path: Path) -> Any:
    q = CrashOnce()
    q.apply(c.CreateTenant(tenant=b.tenant("t"), now=1.0))
    q.apply(c.CreateVCluster(vcluster=b.vcluster("v"), now=1.0))
    q.apply(c.RegisterNode(node_id="n0000", now=2.0))
    store = await HistoryStore.open(sqlite_url(str(tmp_path / "history.db")))
    yield q, store
    await store.close()


async def test_a_crash_between_store_and_removal_only_replays(world: Any) -> None:
    q, store = world
    old = [ended_job(q, 100.0), ended_job(q, 200.0, code=2)]
    fresh = ended_job(q, 10 * HOUR)
    now = [10 * HOUR + 120]
    sweep = HistorySweeper(q, store, retention_seconds=HOUR, batch_size=10, clock=lambda: now[0])
    with pytest.raises(ConnectionError):
        await sweep.sweep()
    assert await store.count() == 2 and set(old) <= set(q.state.allocations)  # stored, kept
    assert await sweep.sweep() == 2  # the next leader's sweep: replays, then removes
    assert await store.count() == 2 and await store.cursor() == (q.state.revision - 1, 2)
    assert not set(old) & set(q.state.allocations) and fresh in q.state.allocations
    assert await sweep.sweep() == 0  # nothing more is due
    q.is_leader = False
    now[0] += 10 * HOUR
    assert await sweep.sweep() == 0 and fresh in q.state.allocations  # followers never sweep


async def test_readers_merge_the_store_with_the_live_state(world: Any) -> None:
    q, store = world
    q.crash = False
    gone = ended_job(q, 100.0, code=2)
    live = ended_job(q, 10 * HOUR)
    await HistorySweeper(q, store, retention_seconds=HOUR, clock=lambda: 10 * HOUR + 120).sweep()
    assert gone not in q.state.allocations
    ops = AllocationOps(q, logs=None, queue=QueueOps(q, budget_period_days=90))  # type: ignore[arg-type]
    ops.history = store
    who = Identity("alice", Role.USER, "t")
    got = await ops.find(who, gone)
    assert got.state == AllocationState.FAILED and got.exit_code == 2
    ended = await ops.list_with_history(who, state="Completed,Failed,Cancelled")
    assert [a.id for a in ended] == [gone, live]
    assert [a.id for a in await ops.list_with_history(who)] == [live]  # status: live only
    other = Identity("bob", Role.USER, "t")
    with pytest.raises(Exception, match="not found"):
        await ops.find(other, gone)  # the same visibility rule as the live state
    usage = UsageOps(q)
    usage.history = store
    u = await usage.read_user_usage(who, days=30, now=10 * HOUR + 120)
    assert u["allocations"] == 2
    assert usage.user_usage(who, days=30, now=10 * HOUR + 120)["allocations"] == 1


async def test_the_history_listing_filters_by_end_time_on_both_sides(world: Any) -> None:
    """``lattice history --since/--until/--limit`` through the operation: the window
    applies to moved and live allocations alike, the limit keeps the latest to end."""
    q, store = world
    q.crash = False
    moved = [ended_job(q, 100.0), ended_job(q, 1000.0), ended_job(q, 2000.0, code=1)]
    live = ended_job(q, 10 * HOUR)
    await HistorySweeper(q, store, retention_seconds=HOUR, clock=lambda: 10 * HOUR + 120).sweep()
    assert not set(moved) & set(q.state.allocations) and live in q.state.allocations
    ops = AllocationOps(q, logs=None, queue=QueueOps(q, budget_period_days=90))  # type: ignore[arg-type]
    ops.history = store
    who = Identity("alice", Role.USER, "t")
    ended = "Completed,Failed,Cancelled"

    async def ids(**kw: Any) -> list[str]:
        return [a.id for a in await ops.list_with_history(who, state=ended, **kw)]

    assert await ids(ended_since=1000.0) == [*moved[1:], live]
    assert await ids(ended_since=1000.0, ended_until=2050.0) == [moved[1]]  # 1060, not 2060
    assert await ids(ended_until=1100.0) == moved[:2]
    assert await ids(ended_since=0.0, limit=2) == [moved[2], live]
    assert await ids(ended_since=20 * HOUR) == []


async def test_usage_is_the_same_before_during_and_after_a_move(world: Any) -> None:
    """Usage read with the store's SQL sums: the same while the allocations are live,
    while they are stored but not yet removed (a leader died in between: counted once),
    and after they left the state."""
    q, store = world
    jobs = [ended_job(q, 100.0), ended_job(q, 500.0, user="bob"), ended_job(q, 10 * HOUR)]
    now = 10 * HOUR + 120
    usage = UsageOps(q)
    usage.history = store
    usage.retention_seconds = HOUR
    admin = Identity("root", Role.SYSTEM_ADMIN, "")
    alice = Identity("alice", Role.USER, "t")

    async def read() -> tuple[Any, Any]:
        t = await usage.read_tenant_usage(admin, "t", days=30, now=now)
        u = await usage.read_user_usage(alice, days=30, now=now)
        return t, u

    before = await read()
    assert before[0]["allocations"] == 3 and before[1]["allocations"] == 2
    sweep = HistorySweeper(q, store, retention_seconds=HOUR, clock=lambda: now)
    with pytest.raises(ConnectionError):
        await sweep.sweep()  # stored, still in the state
    assert await store.count() == 2 and set(jobs) <= set(q.state.allocations)
    assert await read() == before
    assert await sweep.sweep() == 2
    assert not set(jobs[:2]) & set(q.state.allocations)
    after = await read()
    assert after[0]["node_hours"] == pytest.approx(before[0]["node_hours"])

    def per_user(r: Any) -> list[tuple[str, int, Any]]:
        return [(x["user"], x["allocations"], pytest.approx(x["node_hours"])) for x in r["users"]]

    assert per_user(after[0]) == per_user(before[0])
    assert after[1]["allocations"] == before[1]["allocations"] == 2
    assert after[1]["node_hours"] == pytest.approx(before[1]["node_hours"])
    assert after[0]["fair_share_usage"] == pytest.approx(before[0]["fair_share_usage"])
