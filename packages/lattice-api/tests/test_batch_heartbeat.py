"""BatchHeartbeat (spec: heartbeat coalescing): many nodes' heartbeats in one call,
through the real gRPC and REST servers over a LocalQuorum.

Each heartbeat in a batch is handled as a single Heartbeat would be (liveness, replay
and rate checks, back to Ready, exits committed) and answered on its own, in order; one
refused heartbeat does not refuse the others.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from lattice_api.auth import Role
from lattice_api.ops.nodes import MAX_HEARTBEAT_BATCH
from lattice_common import commands as c
from lattice_common.proto.lattice import v1
from lattice_common.types import AllocationState, NodeState
from served_api import Grpc, bearer

pytestmark = pytest.mark.timeout(60)

AGENT = bearer("agent", Role.AGENT)
ALICE = bearer("alice")


def beat(node: str, seq: int, **kw: Any) -> v1.HeartbeatRequest:
    return v1.HeartbeatRequest(node_id=node, sequence=seq, **kw)


async def test_a_batch_is_answered_per_node_in_order(served: Any) -> None:
    api, _w, _rest, channel = served
    stub = Grpc(channel, AGENT).nodes
    out = await stub.batch_heartbeat(
        v1.BatchHeartbeatRequest(heartbeats=[beat("n2", 1), beat("zz", 1), beat("n3", 1)])
    )
    assert [r.node_id for r in out.results] == ["n2", "zz", "n3"]
    n2, zz, n3 = out.results
    assert n2.error is None and not n2.reregister and n2.generation > 0
    assert zz.reregister  # unknown here: register first
    assert n3.error is None and not n3.reregister
    monitor = api.ops.nodes.monitor
    assert monitor.sequence["n2"] == 1 and monitor.sequence["n3"] == 1
    # a replayed sequence is refused for that node only
    out = await stub.batch_heartbeat(
        v1.BatchHeartbeatRequest(heartbeats=[beat("n2", 1), beat("n3", 2)])
    )
    n2, n3 = out.results
    assert n2.error is not None and n2.error.code == "stale_revision" and n2.error.hint
    assert n3.error is None and monitor.sequence["n3"] == 2


async def test_a_batch_commits_what_its_heartbeats_report(served: Any) -> None:
    api, w, _rest, channel = served
    stub = Grpc(channel, AGENT).nodes
    api.propose(c.SetNodeHealth(node_id="n3", state=NodeState.DEGRADED, now=time.time()))
    assert api.quorum.state.nodes["n3"].state == NodeState.DEGRADED
    exited = v1.AllocationReport(
        allocation_id=w.bob_running, phase="exited", exit_code=0, finished_at=time.time()
    )
    out = await stub.batch_heartbeat(
        v1.BatchHeartbeatRequest(
            heartbeats=[beat("n1", 1, allocations=[exited]), beat("n3", 1), beat("n2", 1)]
        )
    )
    assert all(r.error is None for r in out.results)
    # the degraded node is Ready again, the head node's exit completed its allocation
    assert api.quorum.state.nodes["n3"].state == NodeState.READY
    assert api.quorum.state.allocations[w.bob_running].state == AllocationState.COMPLETED


async def test_rest_batch_and_its_errors(served: Any) -> None:
    api, _w, rest, _channel = served
    body = {"heartbeats": [{"node_id": "n2", "sequence": 5}, {"node_id": "zz", "sequence": 1}]}
    status, out = await rest.call("POST", "/api/v1/nodes/heartbeats", AGENT, body)
    assert status == 200, out
    assert [(r["node_id"], r["reregister"], r["error"]) for r in out["results"]] == [
        ("n2", False, None),
        ("zz", True, None),
    ]
    # the same sequence again: refused for that node, in the result, not the call
    status, out = await rest.call("POST", "/api/v1/nodes/heartbeats", AGENT, body)
    assert status == 200 and out["results"][0]["error"]["code"] == "stale_revision"
    # bad input: a clear error and nothing recorded
    bad = {"heartbeats": [{"node_id": "n3", "sequence": "x"}]}
    status, err = await rest.call("POST", "/api/v1/nodes/heartbeats", AGENT, bad)
    assert status == 400 and err["error"]["hint"]
    assert "n3" not in api.ops.nodes.monitor.sequence
    too_many = {"heartbeats": [{"node_id": "n3", "sequence": 1}] * (MAX_HEARTBEAT_BATCH + 1)}
    status, err = await rest.call("POST", "/api/v1/nodes/heartbeats", AGENT, too_many)
    assert status == 400 and "at most" in err["error"]["message"]
    assert "n3" not in api.ops.nodes.monitor.sequence
    # only agents heartbeat
    status, err = await rest.call("POST", "/api/v1/nodes/heartbeats", ALICE, body)
    assert status == 403


async def test_a_follower_points_the_batch_at_the_leader(served: Any) -> None:
    api, _w, rest, channel = served
    api.quorum.is_leader = False
    stub = Grpc(channel, AGENT).nodes
    out = await stub.batch_heartbeat(v1.BatchHeartbeatRequest(heartbeats=[beat("n2", 1)]))
    assert out.results == [] and out.leader_hint == ""
    body = {"heartbeats": [{"node_id": "n2", "sequence": 1}]}
    status, err = await rest.call("POST", "/api/v1/nodes/heartbeats", AGENT, body)
    assert status == 503 and err["error"]["code"] == "not_leader"
    assert "n2" not in api.ops.nodes.monitor.sequence


async def test_steady_heartbeats_write_nothing_to_the_quorum(served: Any) -> None:
    """Ready nodes reporting what they already reported: answered from memory, no
    commit at all (the state's revision stays where it was)."""
    api, w, _rest, channel = served
    stub = Grpc(channel, AGENT).nodes
    running = v1.AllocationReport(allocation_id=w.bob_running, phase="running", pid=7)
    health = v1.HealthSummary(conformance_fingerprint="", telemetry_sources=["proc"])
    await stub.batch_heartbeat(
        v1.BatchHeartbeatRequest(heartbeats=[beat("n1", 1, allocations=[running]), beat("n2", 1)])
    )
    before = api.quorum.revision
    for seq in range(2, 6):
        out = await stub.batch_heartbeat(
            v1.BatchHeartbeatRequest(
                heartbeats=[
                    beat("n1", seq, allocations=[running], health=health),
                    beat("n2", seq, health=health),
                ]
            )
        )
        assert all(r.error is None and not r.reregister for r in out.results)
        single = await stub.heartbeat(beat("n3", seq, health=health))
        assert not single.reregister
    assert api.quorum.revision == before
