"""A real single-member QuorumMember: pysyncobj on loopback with a temporary data dir.

Covers propose/read, micro-batching of concurrent proposals, the watch stream
(snapshot then deltas), restart from disk and the bootstrap rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from lattice_cli.devcluster import free_port
from lattice_common import commands as c
from lattice_common.errors import ValidationError
from lattice_common.types import AllocationState
from lattice_common.watch import StateDelta, decode_delta
from lattice_quorum.member import MARKER, QuorumMember
from lattice_quorum.state import GlobalState
from lattice_test_harness import builders as b

pytestmark = pytest.mark.timeout(120)


def make_member(data_dir: Path, *, bootstrap: bool, node_id: int = 1) -> QuorumMember:
    return QuorumMember(
        node_id=node_id,
        bind=f"127.0.0.1:{free_port()}",
        peers={},
        data_dir=data_dir,
        bootstrap=bootstrap,
    )


async def eventually(pred: Callable[[], bool], timeout: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or pred}")
        await asyncio.sleep(0.02)


async def started(m: QuorumMember) -> QuorumMember:
    m.attach_loop(asyncio.get_running_loop())
    await eventually(lambda: m.is_leader, what="leadership")
    return m


@contextlib.asynccontextmanager
async def member(data_dir: Path, *, bootstrap: bool) -> AsyncIterator[QuorumMember]:
    m = make_member(data_dir, bootstrap=bootstrap)
    try:
        yield await started(m)
    finally:
        m.close()


async def seed(m: QuorumMember) -> None:
    for cmd in (
        c.CreateTenant(tenant=b.tenant("t"), now=1.0),
        c.CreateVCluster(vcluster=b.vcluster("v"), now=1.0),
        c.RegisterNode(node_id="n1", now=1.0),
        c.RegisterNode(node_id="n2", now=1.0),
    ):
        res = await m.propose(cmd)
        assert res.error is None, res.error


def submit_cmd(i: int = 0, **kw: Any) -> c.SubmitAllocation:
    return c.SubmitAllocation(spec=b.spec(f"echo {i}", tenant="t", vcluster="v", **kw), now=2.0)


async def test_propose_and_read(tmp_path: Path) -> None:
    async with member(tmp_path, bootstrap=True) as m:
        await seed(m)
        res = await m.propose(submit_cmd(nodes=2))
        assert res.error is None
        assert res.allocation is not None
        aid = res.allocation.id
        assert res.revision == m.revision
        assert m.read(lambda s: s.allocations[aid].state) == AllocationState.PENDING
        res = await m.propose(c.AssignNodes(allocation_id=aid, node_ids=["n1", "n2"], now=3.0))
        assert res.error is None
        assert m.read(lambda s: (s.nodes["n1"].owner, s.nodes["n2"].owner)) == (aid, aid)
        status = m.status()
        assert status["is_leader"] is True
        assert status["member_id"] == 1
        assert status["revision"] == m.revision


async def test_rejected_command_returns_error_result(tmp_path: Path) -> None:
    async with member(tmp_path, bootstrap=True) as m:
        await seed(m)
        before = m.read(msgspec.msgpack.encode)
        res = await m.propose(c.SubmitAllocation(spec=b.spec(tenant="nobody", vcluster="v")))
        assert res.error is not None
        assert res.error["code"] == "not_found"
        assert res.error["details"]["available"] == "t"
        assert m.read(msgspec.msgpack.encode) == before


async def test_propose_many_micro_batches_and_commits_all(tmp_path: Path) -> None:
    async with member(tmp_path, bootstrap=True) as m:
        await seed(m)
        q = m.subscribe()
        snapshot = decode_delta(await q.get())
        assert snapshot.snapshot
        results = await m.propose_many([submit_cmd(i) for i in range(1000)])
        assert len(results) == 1000
        assert all(r.error is None for r in results)
        ids = [r.allocation.id for r in results if r.allocation is not None]
        assert len(set(ids)) == 1000
        assert m.read(lambda s: len(s.allocations)) == 1000
        # Each result corresponds to its own command, in order.
        entrypoints = m.read(lambda s: [s.allocations[i].spec.entrypoint for i in ids])
        assert entrypoints == [f"echo {i}" for i in range(1000)]
        # Proposed in one loop iteration -> very few Raft entries -> very few deltas.
        await eventually(lambda: not q.empty(), what="a delta")
        await asyncio.sleep(0.2)
        deltas = [decode_delta(q.get_nowait()) for _ in range(q.qsize())]
        assert 1 <= len(deltas) <= 10
        assert sum(len(d.allocations) for d in deltas) == 1000


async def test_mixed_batch_results_are_per_command(tmp_path: Path) -> None:
    async with member(tmp_path, bootstrap=True) as m:
        await seed(m)
        bad = c.SubmitAllocation(spec=b.spec(tenant="t", vcluster="nope"))
        results = await m.propose_many([submit_cmd(1), bad, submit_cmd(2)])
        assert [r.error["code"] if r.error else None for r in results] == [
            None,
            "not_found",
            None,
        ]


async def test_subscribe_gets_snapshot_then_increasing_deltas(tmp_path: Path) -> None:
    async with member(tmp_path, bootstrap=True) as m:
        await seed(m)
        q = m.subscribe()
        snap = decode_delta(await asyncio.wait_for(q.get(), 5))
        assert snap.snapshot
        assert snap.revision == m.revision
        assert {n.id for n in snap.nodes} == {"n1", "n2"}
        assert [t.name for t in snap.tenants] == ["t"]
        res = await m.propose(submit_cmd(nodes=1))
        assert res.allocation is not None
        aid = res.allocation.id
        await m.propose(c.AssignNodes(allocation_id=aid, node_ids=["n1"], now=3.0))
        await m.propose(c.DrainNode(node_id="n2", now=4.0))
        # a rejected command produces no delta
        await m.propose(c.UndrainNode(node_id="n1", now=5.0))
        got: list[StateDelta] = []
        for _ in range(3):
            got.append(decode_delta(await asyncio.wait_for(q.get(), 5)))
        revs = [d.revision for d in got]
        assert revs == sorted(revs)
        assert len(set(revs)) == 3
        assert revs[0] > snap.revision
        assert revs[-1] == m.revision
        assert not any(d.snapshot for d in got)
        assert [a.id for a in got[0].allocations] == [aid]
        assert got[1].allocations[0].state == AllocationState.RUNNING
        assert {n.id for n in got[1].nodes} == {"n1"}
        assert [n.state.value for n in got[2].nodes] == ["Drained"]
        await asyncio.sleep(0.1)
        assert q.empty()
        m.unsubscribe(q)
        await m.propose(c.UndrainNode(node_id="n2", now=6.0))
        await asyncio.sleep(0.1)
        assert q.empty()


async def test_restart_from_disk_restores_state(tmp_path: Path) -> None:
    async with member(tmp_path, bootstrap=True) as m:
        await seed(m)
        results = await m.propose_many([submit_cmd(i) for i in range(50)])
        aid = results[0].allocation.id  # type: ignore[union-attr]
        await m.propose(c.AssignNodes(allocation_id=aid, node_ids=["n1"], now=3.0))
        expected = m.read(msgspec.msgpack.encode)
        expected_rev = m.revision
    marker = json.loads((tmp_path / MARKER).read_text())
    assert marker["member_id"] == 1
    async with member(tmp_path, bootstrap=False) as m2:
        await eventually(lambda: m2.revision == expected_rev, what="journal replay")
        assert m2.read(msgspec.msgpack.encode) == expected
        state = m2.read(
            lambda s: msgspec.msgpack.decode(msgspec.msgpack.encode(s), type=GlobalState)
        )
        assert state.nodes["n1"].owner == aid
        # and it keeps working: ids continue without reuse
        res = await m2.propose(submit_cmd(99))
        assert res.allocation is not None
        assert res.allocation.id not in state.allocations


def test_member_1_without_marker_needs_bootstrap(tmp_path: Path) -> None:
    with pytest.raises(ValidationError) as ei:
        make_member(tmp_path, bootstrap=False)
    assert "no Raft state" in ei.value.message
    assert "--bootstrap" in ei.value.hint
    assert not (tmp_path / MARKER).exists()  # a later --bootstrap still works


async def test_bootstrap_twice_is_an_error(tmp_path: Path) -> None:
    async with member(tmp_path, bootstrap=True):
        pass
    assert (tmp_path / MARKER).exists()
    with pytest.raises(ValidationError) as ei:
        make_member(tmp_path, bootstrap=True)
    assert "already bootstrapped" in ei.value.message
    assert "restart without it" in ei.value.hint


def test_bootstrap_of_member_2_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValidationError) as ei:
        make_member(tmp_path, bootstrap=True, node_id=2)
    assert "only valid for member 1" in ei.value.message
    assert ei.value.hint
    assert not (tmp_path / MARKER).exists()


async def test_members_started_together_take_turns_writing_their_full_dumps(
    tmp_path: Path,
) -> None:
    addrs = {i: f"127.0.0.1:{free_port()}" for i in (1, 2, 3)}
    interval = 3.0
    members = [
        QuorumMember(
            node_id=i,
            bind=addrs[i],
            peers={j: a for j, a in addrs.items() if j != i},
            data_dir=tmp_path / f"m{i}",
            bootstrap=i == 1,
            log_compaction_min_time=interval,
        )
        for i in (1, 2, 3)
    ]
    loop = asyncio.get_running_loop()
    first: dict[int, float] = {}
    try:
        for m in members:
            m.attach_loop(loop)
        await eventually(lambda: any(m.is_leader for m in members), what="a leader")
        leader = next(m for m in members if m.is_leader)
        await seed(leader)
        deadline = time.monotonic() + 4 * interval
        while len(first) < 3 and time.monotonic() < deadline:
            await leader.propose(submit_cmd(len(first)))  # something new to dump
            for m in members:
                if m.node_id not in first and (m.data_dir / "raft.dump").exists():
                    first[m.node_id] = time.monotonic()
            await asyncio.sleep(0.05)
    finally:
        for m in members:
            m.close()
    assert len(first) == 3, first
    times = sorted(first.values())
    # a third of the interval apart (1 s), less the time a dump and a tick take
    assert min(b - a for a, b in itertools.pairwise(times)) > interval / 3 - 0.5


async def test_a_lone_leader_commits_without_waiting_for_its_next_tick(tmp_path: Path) -> None:
    # ticks half a second apart: a commit that waited for the next tick would take that
    # long, where one that wakes the leader's poll takes a few milliseconds
    m = QuorumMember(
        node_id=1,
        bind=f"127.0.0.1:{free_port()}",
        peers={},
        data_dir=tmp_path,
        bootstrap=True,
        auto_tick_period=0.5,
    )
    try:
        await started(m)
        await seed(m)
        took = []
        for i in range(5):
            t0 = time.perf_counter()
            res = await m.propose(submit_cmd(i))
            took.append(time.perf_counter() - t0)
            assert res.error is None
        assert max(took) < 0.25, took
        assert m.read(lambda s: len(s.allocations)) == 5
    finally:
        m.close()
