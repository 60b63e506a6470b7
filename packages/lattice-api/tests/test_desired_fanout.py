"""The agents' desired-state streams, many at once, over the real gRPC server.

Each node's stream gets its own node's changes and only those; all the streams of a
member share one subscription to the quorum; a replaced state (a dump loaded) reaches
every stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from typing import Any

import msgspec
from lattice_common import commands as c
from lattice_common.proto.lattice import v1
from lattice_common.types import AllocationSpec, AllocationState, SchedulerType
from lattice_quorum.state import GlobalState

NODES = [f"fan-{i:02d}" for i in range(20)]


def _spec() -> AllocationSpec:
    return AllocationSpec(
        entrypoint="true", tenant="t", vcluster="batch", user="alice", walltime_seconds=600
    )


async def _open(stub: v1.NodeServiceStub, node_id: str) -> tuple[Any, v1.DesiredState]:
    it = stub.watch_desired_state(v1.WatchDesiredStateRequest(node_id=node_id)).__aiter__()
    first = await asyncio.wait_for(it.__anext__(), 10)
    return it, first


async def test_each_stream_gets_its_own_nodes_changes_from_one_subscription(
    local_api: Any,
) -> None:
    local_api.add_tenant("t")
    local_api.add_vcluster("batch")
    for n in NODES:
        local_api.add_node(n)
    watchers_before = len(local_api.quorum._watchers)
    channel = local_api.channel()
    try:
        stub = v1.NodeServiceStub(channel)
        opened = await asyncio.gather(*(_open(stub, n) for n in NODES))
        streams = dict(zip(NODES, opened, strict=True))
        assert all(first.allocations == [] for _, first in streams.values())
        # twenty streams, one more quorum subscription
        assert len(local_api.quorum._watchers) == watchers_before + 1
        pending = {n: asyncio.ensure_future(it.__anext__()) for n, (it, _) in streams.items()}

        a = local_api.submit(_spec())
        local_api.start(a.id, ["fan-03"])
        got = await asyncio.wait_for(pending.pop("fan-03"), 10)
        assert [x.id for x in got.allocations] == [a.id]
        assert got.generation > streams["fan-03"][1].generation
        # a second allocation on another node reaches that node; fan-03 heard nothing more
        b = local_api.submit(_spec())
        local_api.start(b.id, ["fan-11"])
        got = await asyncio.wait_for(pending.pop("fan-11"), 10)
        assert [x.id for x in got.allocations] == [b.id]
        await asyncio.sleep(0.3)
        assert not any(f.done() for f in pending.values()), [
            n for n, f in pending.items() if f.done()
        ]

        # the state is replaced (a member loads a dump): every stream looks again and
        # follows the new state; here it no longer holds b, so fan-11 is told so
        s = local_api.quorum.read(lambda st: copy.deepcopy(st))
        assert isinstance(s, GlobalState)
        s.allocations.pop(b.id)
        s.nodes["fan-11"].owner = ""
        s.revision += 1
        s.nodes["fan-11"].revision = s.revision
        local_api.quorum.replace_state(s)
        it11 = streams["fan-11"][0]
        after = await asyncio.wait_for(it11.__anext__(), 10)
        assert after.allocations == []
        # and changes after the reset still arrive
        c2 = local_api.submit(_spec())
        local_api.start(c2.id, ["fan-07"])
        got = await asyncio.wait_for(pending.pop("fan-07"), 10)
        assert [x.id for x in got.allocations] == [c2.id]

        for f in pending.values():
            f.cancel()
        await asyncio.gather(*pending.values(), return_exceptions=True)
        for it, _ in streams.values():
            with contextlib.suppress(Exception):
                await it.aclose()
        # the last stream gone, the subscription is dropped
        for _ in range(50):
            if len(local_api.quorum._watchers) == watchers_before:
                break
            await asyncio.sleep(0.05)
        assert len(local_api.quorum._watchers) == watchers_before
    finally:
        channel.close()


async def test_a_reconnecting_agent_is_not_sent_the_set_it_already_has(local_api: Any) -> None:
    """After a leader change every agent reconnects at once with the generation it
    applied: a member sends nothing to those still current, and a change later as usual;
    an agent whose set changed meanwhile gets it at once."""
    local_api.add_tenant("t")
    local_api.add_vcluster("batch")
    for n in ("re-1", "re-2"):
        local_api.add_node(n)
    a = local_api.submit(_spec())
    local_api.start(a.id, ["re-1"])
    channel = local_api.channel()
    try:
        stub = v1.NodeServiceStub(channel)
        it, first = await _open(stub, "re-1")
        assert [x.id for x in first.allocations] == [a.id]
        await it.aclose()
        it2, first2 = await _open(stub, "re-2")
        await it2.aclose()
        # re-1 comes back with what it has: nothing to send until something changes
        again = stub.watch_desired_state(
            v1.WatchDesiredStateRequest(node_id="re-1", known_generation=first.generation)
        ).__aiter__()
        nxt = asyncio.ensure_future(again.__anext__())
        await asyncio.sleep(0.5)
        assert not nxt.done()
        b = local_api.submit(_spec())
        local_api.start(b.id, ["re-2"])  # another node's change: still nothing for re-1
        await asyncio.sleep(0.3)
        assert not nxt.done()
        local_api.set_state(a.id, AllocationState.COMPLETED, exit_code=0)
        got = await asyncio.wait_for(nxt, 10)
        assert got.allocations == [] and got.generation > first.generation
        await again.aclose()
        # re-2 comes back with a stale generation: its new set at once
        stale = stub.watch_desired_state(
            v1.WatchDesiredStateRequest(node_id="re-2", known_generation=first2.generation)
        ).__aiter__()
        got = await asyncio.wait_for(stale.__anext__(), 10)
        assert [x.id for x in got.allocations] == [b.id]
        await stale.aclose()
    finally:
        channel.close()


async def test_a_change_to_the_node_alone_is_not_sent_and_the_claim_comes_with_the_work(
    local_api: Any,
) -> None:
    """An agent acts on its allocations and on the node's sensitive claim only: queueing
    the node's next allocation (a node-only change) sends it nothing, while sensitive
    work arrives with the claim in the same message (no lookup per allocation)."""
    local_api.add_tenant("t")
    local_api.add_vcluster("batch")
    local_api.add_vcluster("sens", scheduler_type=SchedulerType.SENSITIVE_RESERVATION)
    for n in ("nc-1", "nc-2"):
        local_api.add_node(n)
    a = local_api.submit(_spec())
    local_api.start(a.id, ["nc-1"])
    waiting = local_api.submit(_spec())
    channel = local_api.channel()
    try:
        stub = v1.NodeServiceStub(channel)
        it, first = await _open(stub, "nc-1")
        assert [x.id for x in first.allocations] == [a.id] and first.claimed_by == ""
        nxt = asyncio.ensure_future(it.__anext__())
        local_api.propose(c.SetNextAllocations(next={"nc-1": waiting.id}, now=time.time()))
        node = local_api.quorum.read(lambda s: s.nodes["nc-1"])
        assert node.next_allocation == waiting.id  # the node changed ...
        await asyncio.sleep(0.3)
        assert not nxt.done()  # ... and its agent was not told again
        local_api.set_state(a.id, AllocationState.COMPLETED, exit_code=0)
        handed = await asyncio.wait_for(nxt, 10)  # the hand-over: the next job, at once
        assert [x.id for x in handed.allocations] == [waiting.id]
        await it.aclose()

        s = local_api.submit(msgspec.structs.replace(_spec(), vcluster="sens"))
        local_api.start(s.id, ["nc-2"])
        it2, got = await _open(stub, "nc-2")
        assert [x.id for x in got.allocations] == [s.id] and got.claimed_by == "alice"
        await it2.aclose()
    finally:
        channel.close()
