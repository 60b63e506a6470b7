"""LocalQuorum: the Quorum protocol in process (apply under a lock, no Raft).

It must behave like a QuorumMember where the API can tell: results are copies, the
watch stream is a snapshot then one delta per applied command, encoded the same way
(compared against a real single-member QuorumMember below), and the role/caught-up
flags drive the same errors.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from lattice_cli.devcluster import free_port as _free_port
from lattice_common import commands as c
from lattice_common.errors import Unavailable
from lattice_common.types import AllocationState
from lattice_common.watch import decode_delta
from lattice_quorum import queries
from lattice_quorum.local import LocalQuorum
from lattice_quorum.member import QuorumMember
from lattice_quorum.quorum import Quorum, encode_snapshot
from lattice_quorum.state import GlobalState
from lattice_test_harness import builders as b

pytestmark = pytest.mark.timeout(60)

SEED: list[c.Command] = [
    c.CreateTenant(tenant=b.tenant("t"), now=1.0),
    c.CreateVCluster(vcluster=b.vcluster("v"), now=1.0),
    c.RegisterNode(node_id="n1", now=1.0),
    c.RegisterNode(node_id="n2", now=1.0),
]


async def seeded() -> LocalQuorum:
    q = LocalQuorum()
    for cmd in SEED:
        res = await q.propose(cmd)
        assert res.error is None, res.error
    return q


def test_implements_the_protocol() -> None:
    assert isinstance(LocalQuorum(), Quorum)


async def test_propose_applies_and_results_are_copies() -> None:
    q = await seeded()
    res = await q.propose(c.SubmitAllocation(spec=b.spec("true"), now=2.0))
    assert res.error is None and res.allocation is not None
    aid = res.allocation.id
    assert q.revision == res.revision == 5
    res.allocation.state = AllocationState.FAILED  # must not reach the state
    stored = q.read(queries.allocation, aid)
    assert stored is not None and stored.state == AllocationState.PENDING
    assert stored is not q.state.allocations[aid]  # the query copies too


async def test_rejected_command_returns_error_and_changes_nothing() -> None:
    q = await seeded()
    before = q.revision
    res = await q.propose(c.CreateTenant(tenant=b.tenant("t"), now=2.0))
    assert res.error is not None and res.error["code"] == "already_exists"
    assert q.revision == before


async def test_propose_many_and_batch() -> None:
    q = await seeded()
    results = await q.propose_many(
        [c.SubmitAllocation(spec=b.spec("true"), now=2.0) for _ in range(3)]
    )
    assert [r.error for r in results] == [None] * 3
    batch = await q.propose(
        c.Batch(commands=[c.DrainNode(node_id="n1", now=3.0), c.DrainNode(node_id="nx", now=3.0)])
    )
    assert batch.results is not None and len(batch.results) == 2
    assert batch.results[0].error is None and batch.results[1].error is not None


async def test_read_passes_arguments() -> None:
    q = await seeded()
    assert q.read(queries.tenant_and_vcluster_names) == ({"t"}, {"v"})
    assert [n.id for n in q.read(queries.nodes)] == ["n1", "n2"]
    assert q.read(queries.node, "n9") is None


async def test_watch_snapshot_then_one_delta_per_command() -> None:
    q = await seeded()
    w = q.subscribe()
    first = decode_delta(await w.get())  # type: ignore[arg-type]
    assert first.snapshot and first.revision == 4
    assert {n.id for n in first.nodes} == {"n1", "n2"}
    await q.propose(c.DrainNode(node_id="n1", reason="x", now=2.0))
    d = decode_delta(await asyncio.wait_for(w.get(), 2))  # type: ignore[arg-type]
    assert not d.snapshot and d.revision == 5 and [n.id for n in d.nodes] == ["n1"]
    q.unsubscribe(w)
    await q.propose(c.UndrainNode(node_id="n1", now=3.0))
    await asyncio.sleep(0)
    assert w.empty()


async def test_propose_from_another_thread_reaches_watchers() -> None:
    q = await seeded()
    w = q.subscribe()
    await w.get()
    t = threading.Thread(target=q.apply, args=(c.DrainNode(node_id="n2", now=2.0),))
    t.start()
    t.join()
    d = decode_delta(await asyncio.wait_for(w.get(), 2))  # type: ignore[arg-type]
    assert [n.id for n in d.nodes] == ["n2"]


async def test_replaced_state_tells_watchers_to_resubscribe() -> None:
    q = await seeded()
    w = q.subscribe()
    await w.get()
    q.replace_state(GlobalState())
    assert await asyncio.wait_for(w.get(), 2) is None
    assert q.revision == 0


async def test_caught_up_and_leadership_flags() -> None:
    q = await seeded()
    q.require_caught_up()
    q.caught_up = False
    with pytest.raises(Unavailable) as e:
        q.require_caught_up()
    assert e.value.hint
    with pytest.raises(Unavailable):
        q.subscribe()
    heard: list[bool] = []
    q.on_leadership(heard.append)
    q.set_leader(False)
    assert heard == [True, False] and not q.is_leader


async def test_status_has_the_members_shape() -> None:
    q = await seeded()
    st = q.status()
    assert st["is_leader"] and st["member_id"] == 1 and st["revision"] == 4
    assert st["commit_index"] == st["last_applied"] == 4
    assert st["leader_address"] == q.leader_raft_address
    assert st["members"] == [{"id": 1, "address": q.address, "state": "leader"}]
    assert q.snapshot_delta() == encode_snapshot(q.state)


# --------------------------------------------------------------------------- vs a member


async def test_same_watch_stream_as_a_real_member(tmp_path: Path) -> None:
    """The same commands give byte-identical snapshots and deltas from both."""
    cmds: list[c.Command] = [
        *SEED,
        c.SubmitAllocation(spec=b.spec("true", tenant="t", vcluster="v"), now=2.0),
        c.DrainNode(node_id="n2", reason="r", now=3.0),
        c.CreateTenant(tenant=b.tenant("t"), now=4.0),  # rejected: no delta
        c.UndrainNode(node_id="n2", now=5.0),
    ]
    m = QuorumMember(
        node_id=1, bind=f"127.0.0.1:{_free_port()}", peers={}, data_dir=tmp_path, bootstrap=True
    )
    m.attach_loop(asyncio.get_running_loop())
    try:
        deadline = time.monotonic() + 15
        while not (m.is_leader and m.caught_up):
            assert time.monotonic() < deadline, "no leadership"
            await asyncio.sleep(0.02)
        local = LocalQuorum()
        streams = []
        for q in (m, local):
            w = q.subscribe()
            for cmd in cmds:
                await q.propose(cmd)  # one by one: the member may not batch them
            got = [await asyncio.wait_for(w.get(), 5) for _ in range(len(cmds))]
            q.unsubscribe(w)
            streams.append(got)
        member_stream, local_stream = streams
        assert member_stream == local_stream
        assert m.snapshot_delta() == local.snapshot_delta()
    finally:
        m.close()
