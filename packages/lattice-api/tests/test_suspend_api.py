"""Suspend and resume through both transports on the real servers over a LocalQuorum:
who may, what is refused (with a hint, changing nothing), and the states they lead to.
The agent's part (the checkpoint itself) is covered end to end in lattice-node-agent's
tests/test_checkpoint_cluster.py."""

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


async def test_owner_suspends_over_rest_and_resumes_over_grpc(served) -> None:
    api, _, rest, channel = served
    aid = _running(api, "alice", "shmem", "n2")
    status, body = await rest.call("POST", f"/api/v1/allocations/{aid}/suspend", bearer("bob"))
    assert status == 404, body  # not bob's: he cannot even see it
    status, body = await rest.call("POST", f"/api/v1/allocations/{aid}/suspend", bearer("alice"))
    assert status == 200 and body["state"] == "Checkpointing", body
    # the head node's agent reports the checkpoint: Suspended, node released
    ck = CheckpointRecord(id="ckpt-1", path=f"/ck/physics/default/{aid}/checkpoints/ckpt-1")
    res = await api.quorum.propose(
        c.RecordCheckpoint(allocation_id=aid, node_id="n2", checkpoint=ck, now=time.time())
    )
    assert res.error is None, res.error
    grpc = Grpc(channel, bearer("alice"))
    a = await grpc.alloc.get(v1.GetAllocationRequest(id=aid))
    assert a.state == "Suspended" and a.last_checkpoint.path == ck.path and not a.assigned_nodes
    a = await grpc.alloc.resume(v1.ResumeAllocationRequest(id=aid))
    assert a.state == "Pending" and a.resume_from_checkpoint and a.preempted_count == 1
    # resuming again: refused, with a hint
    code, err = await grpc_error(grpc.alloc.resume(v1.ResumeAllocationRequest(id=aid)))
    assert code == "FAILED_PRECONDITION", err
    assert "Suspended" in err["message"] and err.get("hint"), err


async def test_suspend_without_a_protocol_is_refused_and_changes_nothing(served) -> None:
    api, _, rest, channel = served
    aid = _running(api, "alice", "", "n3")
    status, body = await rest.call("POST", f"/api/v1/allocations/{aid}/suspend", bearer("alice"))
    assert status == 412, body
    assert "--checkpoint" in body["error"]["hint"], body
    assert api.quorum.read(lambda s: s.allocations[aid].state) == AllocationState.RUNNING
    # a system admin may suspend anyone's (here: refused for the same reason, not 403)
    grpc = Grpc(channel, bearer("root", Role.SYSTEM_ADMIN))
    code, err = await grpc_error(grpc.alloc.suspend(v1.SuspendAllocationRequest(id=aid)))
    assert code == "FAILED_PRECONDITION" and "checkpoint protocol" in err["message"], (code, err)


async def test_submission_validates_the_checkpoint_fields(served) -> None:
    _, _, rest, _ = served
    base = {"entrypoint": "true", "tenant": "physics", "vcluster": "batch", "walltime": "1h"}
    status, body = await rest.call(
        "POST", "/api/v1/allocations", bearer("alice"), {**base, "checkpoint": "grpc"}
    )
    assert status == 201, body
    spec = body["spec"]
    assert (spec["checkpoint"], spec["checkpoint_protocol"]) == ("auto", "grpc")
    status, body = await rest.call(
        "POST", "/api/v1/allocations", bearer("alice"), {**base, "checkpoint": "sigusr"}
    )
    assert status == 400 and "checkpoint" in body["error"]["message"], body
    assert "--checkpoint=signal|shmem|grpc" in body["error"]["hint"]
    status, body = await rest.call(
        "POST",
        "/api/v1/allocations",
        bearer("alice"),
        {**base, "checkpoint": "none", "checkpoint_protocol": "shmem"},
    )
    assert status == 400, body
