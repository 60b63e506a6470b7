"""Checkpoint-now (AllocationService.Checkpoint, POST .../checkpoint) through both
transports on the real servers over a LocalQuorum: the owner's hint is recorded and the
allocation keeps running; a second one waits for the first; refusals carry a hint and
change nothing. The agent's part is in lattice-node-agent's tests/test_checkpoint_hint.py."""

from __future__ import annotations

import time

from lattice_api.auth import Role
from lattice_common import commands as c
from lattice_common.proto.lattice import v1
from lattice_common.types import AllocationSpec, AllocationState, CheckpointRecord
from served_api import Grpc, bearer, grpc_error


def _running(api, user: str, protocol: str, node: str) -> str:
    spec = AllocationSpec(
        entrypoint="python train.py",
        tenant="physics",
        vcluster="batch",
        user=user,
        walltime_seconds=3600,
        checkpoint="auto" if protocol else "none",
        checkpoint_protocol=protocol,
    )
    aid = api.submit(spec, now=time.time()).id
    api.start(aid, [node], now=time.time())
    return aid


async def test_owner_asks_for_a_checkpoint_and_the_allocation_keeps_running(served) -> None:
    api, _, rest, channel = served
    aid = _running(api, "alice", "signal", "n2")
    path = f"/api/v1/allocations/{aid}/checkpoint"
    status, body = await rest.call("POST", path, bearer("bob"))
    assert status == 404, body  # not bob's: he cannot even see it
    status, body = await rest.call("POST", path, bearer("alice"))
    assert status == 200 and body["state"] == "Running", body
    assert body["checkpoint_hint"]["id"] == "hint-1" and body["checkpoint_hints"] == 1, body
    assert "alice" in body["checkpoint_hint"]["reason"]
    # a second one while the first is being written: refused, with a hint
    status, body = await rest.call("POST", path, bearer("alice"))
    assert status == 412 and body["error"]["hint"], body
    # the head node's agent reports it: recorded, still running; the next one is accepted
    ck = CheckpointRecord(id="ckpt-1-hint-1", path=f"/ck/physics/default/{aid}/checkpoints/x")
    res = await api.quorum.propose(
        c.CompleteCheckpointHint(
            allocation_id=aid, node_id="n2", hint_id="hint-1", checkpoint=ck, now=time.time()
        )
    )
    assert res.error is None, res.error
    grpc = Grpc(channel, bearer("alice"))
    resp = await grpc.alloc.checkpoint(v1.CheckpointRequest(id=aid))
    assert resp.accepted and "hint-2" in resp.message, resp
    a = await grpc.alloc.get(v1.GetAllocationRequest(id=aid))
    assert a.state == "Running" and a.last_checkpoint.path == ck.path and a.checkpoint_hints == 2


async def test_checkpoint_without_a_protocol_is_refused_and_changes_nothing(served) -> None:
    api, _, rest, channel = served
    aid = _running(api, "alice", "", "n3")
    status, body = await rest.call("POST", f"/api/v1/allocations/{aid}/checkpoint", bearer("alice"))
    assert status == 412 and "--checkpoint" in body["error"]["hint"], body
    assert api.quorum.read(lambda s: s.allocations[aid].checkpoint_hints) == 0
    # a system admin may ask for anyone's (here: refused for the same reason, not 403)
    grpc = Grpc(channel, bearer("root", Role.SYSTEM_ADMIN))
    code, err = await grpc_error(grpc.alloc.checkpoint(v1.CheckpointRequest(id=aid)))
    assert code == "FAILED_PRECONDITION" and "checkpoint protocol" in err["message"], (code, err)
    assert api.quorum.read(lambda s: s.allocations[aid].state) == AllocationState.RUNNING
