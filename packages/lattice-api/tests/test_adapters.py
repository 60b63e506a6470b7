"""The gRPC adapters and REST routes through the real servers over a LocalQuorum.

What each transport adds on top of the operations: message and JSON shapes, streams,
status codes, the agent side, the internal QuorumService, public routes, UNIMPLEMENTED
answers, and the listing rule (the caller's own unless all users or a user is asked).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpclib
import jwt
import pytest
from grpclib.const import Status
from lattice_api.auth import Role
from lattice_common import commands as c
from lattice_common.proto.lattice import v1
from lattice_common.types import Allocation, AllocationState
from lattice_common.watch import decode_delta
from lattice_common.wire import from_message, to_message
from served_api import SECRET, Grpc, World, bearer, grpc_error

pytestmark = pytest.mark.timeout(60)

ALICE = bearer("alice")
BOB = bearer("bob")
ROOT = bearer("root", Role.SYSTEM_ADMIN)
AGENT = bearer("agent", Role.AGENT)


def grpc(channel: Any, who: dict[str, str]) -> Grpc:
    return Grpc(channel, who)


# --------------------------------------------------------------------------- allocations


async def test_submit_over_both_transports(served: Any) -> None:
    api, _w, rest, channel = served
    body = {"entrypoint": "echo hi", "tenant": "physics", "vcluster": "batch", "walltime": "1h"}
    status, a = await rest.call("POST", "/api/v1/allocations", ALICE, body)
    assert status == 201 and a["state"] == "Pending" and a["spec"]["user"] == "alice"
    spec = World.spec("ignored")  # the server sets the user from the identity
    res = await grpc(channel, ALICE).alloc.submit(
        v1.SubmitRequest(allocation=to_message(spec, v1.AllocationSpec))
    )
    assert len(res.allocation_ids) == 1
    stored = api.quorum.state.allocations[res.allocation_ids[0]]
    assert stored.spec.user == "alice"
    assert from_message(res.allocations[0], Allocation).id == stored.id


async def test_a_bulk_submitter_gets_the_ids_alone_over_both_transports(served: Any) -> None:
    api, _w, rest, channel = served
    body = {"entrypoint": "echo hi", "tenant": "physics", "vcluster": "batch", "walltime": "1h"}
    status, out = await rest.call("POST", "/api/v1/allocations", ALICE, body, ids_only="true")
    assert status == 201 and set(out) == {"allocation_ids"}
    assert api.quorum.state.allocations[out["allocation_ids"][0]].spec.user == "alice"
    spec = to_message(World.spec("ignored"), v1.AllocationSpec)
    res = await grpc(channel, ALICE).alloc.submit(v1.SubmitRequest(allocation=spec, ids_only=True))
    assert len(res.allocation_ids) == 1 and res.allocations == []
    assert res.allocation_ids[0] in api.quorum.state.allocations  # stored all the same
    full = await grpc(channel, ALICE).alloc.submit(v1.SubmitRequest(allocation=spec))
    assert [a.id for a in full.allocations] == full.allocation_ids


async def test_task_groups_over_both_transports(served: Any) -> None:
    _api, _w, rest, channel = served
    body = {"entrypoint": "x", "tenant": "physics", "vcluster": "batch", "walltime": "1h"}
    status, out = await rest.call(
        "POST", "/api/v1/allocations", ALICE, {**body, "task_group": "0-3%2"}
    )
    assert status == 201 and out["tasks"] == 4 and out["concurrency"] == 2
    tg = v1.TaskGroupSpec(
        template=to_message(World.spec("alice"), v1.AllocationSpec),
        range_start=0,
        range_end=2,
        concurrency=1,
    )
    res = await grpc(channel, ALICE).alloc.submit(v1.SubmitRequest(task_group=tg))
    assert len(res.allocation_ids) == 3 and res.task_group_id
    status, listed = await rest.call(
        "GET", "/api/v1/allocations", ALICE, task_group=res.task_group_id
    )
    assert sorted(a["id"] for a in listed["allocations"]) == sorted(res.allocation_ids)


async def test_empty_submit_is_refused_and_watch_all_is_unimplemented(served: Any) -> None:
    _api, _w, _rest, channel = served
    stub = grpc(channel, ALICE).alloc
    with pytest.raises(grpclib.GRPCError) as e:
        await stub.submit(v1.SubmitRequest())
    assert e.value.status == Status.INVALID_ARGUMENT and "a dag" in (e.value.message or "")
    with pytest.raises(grpclib.GRPCError) as e:
        async for _ in stub.watch(v1.WatchAllocationsRequest()):
            pass
    assert e.value.status == Status.UNIMPLEMENTED


@pytest.mark.parametrize(
    ("service", "call", "request_type", "text"),
    [
        ("nodes", "get_node_health", v1.GetNodeRequest, "NodeService.get_node_health"),
        ("admin", "delete_tenant", v1.DeleteTenantRequest, "AdminService.delete_tenant"),
        ("quorum", "read", v1.ReadRequest, "QuorumService.read"),
    ],
)
async def test_rpcs_not_built_name_themselves_to_anyone(
    served: Any, service: str, call: str, request_type: type, text: str
) -> None:
    _api, _w, _rest, channel = served
    stub = getattr(grpc(channel, {}), service)  # not even authenticated
    with pytest.raises(grpclib.GRPCError) as e:
        await getattr(stub, call)(request_type())
    assert e.value.status == Status.UNIMPLEMENTED
    assert e.value.message == f"{text} is not implemented yet"


async def test_watch_streams_every_change_until_terminal(served: Any) -> None:
    api, w, rest, channel = served
    aid = w.alice_pending

    async def drive() -> None:
        await asyncio.sleep(0.1)
        api.start(aid, ["n3"])
        await asyncio.sleep(0.05)
        api.set_state(aid, AllocationState.COMPLETED, exit_code=0)

    driver = asyncio.create_task(drive())
    events = [
        (ev.revision, from_message(ev.allocation, Allocation).state)
        async for ev in grpc(channel, ALICE).alloc.watch(v1.WatchAllocationsRequest(id=aid))
    ]
    await driver
    assert [s for _, s in events] == ["Pending", "Running", "Completed"]
    assert [r for r, _ in events] == sorted(r for r, _ in events)
    status, lines = await rest.call("GET", f"/api/v1/allocations/{aid}/watch", ALICE)
    assert status == 200 and [ln["allocation"]["state"] for ln in lines] == ["Completed"]
    status, err = await rest.call("GET", "/api/v1/allocations/nope/watch", ALICE)
    assert status == 404 and err["error"]["code"] == "not_found"


async def test_logs_over_both_transports(served: Any) -> None:
    _api, w, rest, channel = served
    aid = w.bob_running
    status, out = await rest.call("GET", f"/api/v1/allocations/{aid}/logs", BOB, tail=1)
    assert status == 200 and [ln["line"] for ln in out["lines"]] == ["warning"]
    status, lines = await rest.call(
        "GET", f"/api/v1/allocations/{aid}/logs/stream", BOB, stream="stdout"
    )
    assert [ln["line"] for ln in lines] == ["epoch 1"]
    stub = grpc(channel, BOB).alloc
    got = await stub.get_logs(v1.GetLogsRequest(allocation_id=aid))
    assert [(ln.line, ln.stream) for ln in got.lines] == [
        ("epoch 1", "stdout"),
        ("warning", "stderr"),
    ]
    streamed = [ln.line async for ln in stub.stream_logs(v1.StreamLogsRequest(allocation_id=aid))]
    assert streamed == ["epoch 1", "warning"]


# --------------------------------------------------------------------------- listing rule


async def ids_rest(rest: Any, who: dict[str, str], **q: Any) -> tuple[int, Any]:
    status, body = await rest.call("GET", "/api/v1/allocations", who, **q)
    return status, (sorted(a["id"] for a in body["allocations"]) if status == 200 else body)


async def ids_grpc(channel: Any, who: dict[str, str], **q: Any) -> list[str]:
    res = await grpc(channel, who).alloc.list(v1.ListAllocationsRequest(**q))
    return sorted(a.id for a in res.allocations)


async def test_listing_rule_is_the_same_over_both_transports(served: Any) -> None:
    _api, w, rest, channel = served
    alice = sorted([w.alice_pending, w.alice_done])
    everyone = sorted([*alice, w.bob_running])
    # the caller's own by default, whatever the role
    assert await ids_rest(rest, ALICE) == (200, alice)
    assert await ids_grpc(channel, ALICE) == alice
    assert await ids_rest(rest, ROOT) == (200, [])
    assert await ids_grpc(channel, ROOT) == []
    # a named user: oneself, or anyone with allocation.list_all
    assert await ids_rest(rest, ALICE, user="alice") == (200, alice)
    assert await ids_rest(rest, ROOT, user="bob") == (200, [w.bob_running])
    assert await ids_grpc(channel, ROOT, user="bob") == [w.bob_running]
    status, err = await ids_rest(rest, ALICE, user="bob")
    assert status == 403 and "allocation.list_all" in err["error"]["message"]
    with pytest.raises(grpclib.GRPCError) as denied:
        await ids_grpc(channel, ALICE, user="bob")
    assert denied.value.status == Status.PERMISSION_DENIED
    # all users: REST's explicit ?all, with allocation.list_all
    assert await ids_rest(rest, ROOT, all="true") == (200, everyone)
    status, err = await ids_rest(rest, ALICE, all="true")
    assert status == 403 and "allocation.list_all" in err["error"]["message"]
    # filters and limit
    assert await ids_rest(rest, ALICE, state="completed") == (200, [w.alice_done])
    assert await ids_grpc(channel, ALICE, state="completed") == [w.alice_done]
    assert await ids_grpc(channel, ALICE, tenant="bio") == [w.alice_done]
    assert await ids_grpc(channel, ALICE, limit=1) == [w.alice_done]  # the newest


# --------------------------------------------------------------------------- nodes, agents


async def test_node_actions_one_route_each(served: Any) -> None:
    _api, _w, rest, channel = served
    status, n = await rest.call("POST", "/api/v1/nodes/n3/drain", ROOT, {"reason": "fw"})
    assert status == 200 and n["state"] == "Drained" and n["state_reason"] == "fw"
    status, n = await rest.call("POST", "/api/v1/nodes/n3/undrain", ROOT)
    assert status == 200 and n["state"] == "Ready"
    node = await grpc(channel, ROOT).nodes.disable_node(v1.NodeActionRequest(id="n3", reason="x"))
    assert node.id == "n3"
    status, n = await rest.call("POST", "/api/v1/nodes/n3/enable", ROOT)
    assert status == 200
    status, _ = await rest.call("POST", "/api/v1/nodes/n3/reboot", ROOT)
    assert status == 404
    status, err = await rest.call("POST", "/api/v1/nodes/n3/drain", ALICE)
    assert status == 403 and "node.admin" in err["error"]["message"]
    # release is its own permission: a plain user is refused by the table
    status, err = await rest.call("POST", "/api/v1/nodes/n3/release", ALICE)
    assert status == 403 and "node.release" in err["error"]["message"]


async def test_agent_register_heartbeat_and_desired_state(served: Any) -> None:
    api, _w, rest, channel = served
    status, n = await rest.call(
        "POST", "/api/v1/nodes/register", AGENT, {"node_id": "r1", "capabilities": {"gpu_count": 2}}
    )
    assert status == 200 and n["capabilities"]["gpu_count"] == 2
    assert "r1" in api.ops.nodes.monitor.last_seen
    status, out = await rest.call("POST", "/api/v1/nodes/r1/heartbeat", AGENT, {"sequence": 1})
    assert status == 200 and out == {"accepted": True, "reregister": False}
    status, out = await rest.call("POST", "/api/v1/nodes/zz/heartbeat", AGENT, {"sequence": 1})
    assert out["reregister"] is True
    stub = grpc(channel, AGENT).nodes
    health = v1.HealthSummary(telemetry_sources=["proc", "ebpf"])
    hb = await stub.heartbeat(v1.HeartbeatRequest(node_id="r1", sequence=2, health=health))
    assert hb.generation > 0 and not hb.reregister and not hb.leader_hint
    # the collectors the agent reported show on the node (`lattice nodes r1`)
    status, node = await rest.call("GET", "/api/v1/nodes/r1", AGENT)
    assert node["telemetry"] == "ebpf, proc"
    aid = api.submit(World.spec("alice")).id
    desired = stub.watch_desired_state(v1.WatchDesiredStateRequest(node_id="r1")).__aiter__()
    first = await desired.__anext__()
    assert first.node_id == "r1" and first.allocations == []
    api.start(aid, ["r1"])
    second = await asyncio.wait_for(desired.__anext__(), 5)
    assert [a.id for a in second.allocations] == [aid] and second.generation > first.generation
    await desired.aclose()
    # a follower points agents at the leader (gRPC) or refuses (REST)
    api.quorum.is_leader = False
    hb = await stub.heartbeat(v1.HeartbeatRequest(node_id="r1", sequence=3))
    assert hb.generation == 0 and hb.leader_hint == ""
    status, err = await rest.call("POST", "/api/v1/nodes/r1/heartbeat", AGENT, {"sequence": 4})
    assert status == 503 and err["error"]["code"] == "not_leader"


# --------------------------------------------------------------------------- quorum, public


async def test_quorum_service_propose_and_watch_state(served: Any) -> None:
    api, _w, _rest, channel = served
    stub = grpc(channel, AGENT).quorum
    cmd = c.AssignNodes(allocation_id="no-such-allocation", node_ids=["n1"], now=1.0)
    res = c.decode_result(
        (await stub.propose(v1.ProposeRequest(command=c.encode_command(cmd)))).result
    )
    assert res.error is not None and res.error["code"] == "not_found"
    # only scheduling decisions go through Propose: a tenant has its own RPC
    tenant = c.CreateTenant(tenant=api.ops.admin.get_tenant(None, "bio"), now=1.0)  # type: ignore[arg-type]
    err = await grpc_error(stub.propose(v1.ProposeRequest(command=c.encode_command(tenant))))
    assert err[0] == "PERMISSION_DENIED" and "CreateTenant" in err[1]["message"]
    err = await grpc_error(stub.propose(v1.ProposeRequest(command=b"\xff junk")))
    assert err[0] == "INVALID_ARGUMENT" and "undecodable" in err[1]["message"]
    events = stub.watch_state(v1.WatchStateRequest()).__aiter__()
    snap = decode_delta((await events.__anext__()).payload)
    assert snap.snapshot and {t.name for t in snap.tenants} == {"physics", "bio"}
    api.add_tenant("chem")
    delta = decode_delta((await asyncio.wait_for(events.__anext__(), 5)).payload)
    assert [t.name for t in delta.tenants] == ["chem"]
    await events.aclose()
    denied = await grpc_error(grpc(channel, ALICE).quorum.propose(v1.ProposeRequest()))
    assert denied[0] == "PERMISSION_DENIED"


async def test_public_routes_need_no_identity(served: Any) -> None:
    api, _w, rest, _channel = served
    status, h = await rest.call("GET", "/healthz", {})
    assert status == 200 and h["status"] == "ok" and h["is_leader"] is True
    assert h["revision"] == api.quorum.revision
    status, d = await rest.call("GET", "/api/v1/auth/discovery", {})
    assert status == 200 and d["client_id"] == "lattice"
    async with rest.session.get(rest.url + "/metrics") as r:
        text = await r.text()
    assert r.status == 200 and "lattice_api_requests_total" in text
    assert 'method="GET /healthz"' in text
    status, err = await rest.call("GET", "/api/v1/allocations", {})
    assert status == 401 and "lattice login" in err["error"]["hint"]
    err2 = await grpc_error(grpc(_channel, {}).alloc.get(v1.GetAllocationRequest(id="x")))
    assert err2[0] == "UNAUTHENTICATED"


async def test_bad_bodies_and_raft_status(served: Any) -> None:
    _api, _w, rest, channel = served
    async with rest.session.post(rest.url + "/api/v1/tenants", data=b"{nope", headers=ROOT) as r:
        assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]
    status, err = await rest.call("POST", "/api/v1/tenants", ROOT, ["a"])
    assert status == 400 and "JSON object" in err["error"]["message"]
    status, st = await rest.call("GET", "/api/v1/raft/status", ALICE)
    assert status == 200 and st["is_leader"] and "leader_api_address" in st
    rs = await grpc(channel, ALICE).admin.get_raft_status(v1.GetRaftStatusRequest())
    assert rs.member_id == "1" and rs.members[0].state == "leader"


# --------------------------------------------------------------------------- object scope


def _tenant_admin(tenant: str) -> dict[str, str]:
    claims = {"sub": f"ta-{tenant}", "exp": int(time.time()) + 600, "scope": "tenant:admin"}
    return {"authorization": "Bearer " + jwt.encode({**claims, "tenant": tenant}, SECRET, "HS256")}


async def test_another_users_allocation_is_invisible_and_ids_cannot_be_probed(
    served: Any,
) -> None:
    _api, w, rest, channel = served
    aid = w.bob_running  # bob's, in tenant physics
    base = f"/api/v1/allocations/{aid}"
    for method, path in [
        ("GET", base),
        ("DELETE", base),
        ("GET", f"{base}/logs"),
        ("GET", f"{base}/logs/stream"),
        ("GET", f"{base}/watch"),
        ("GET", f"{base}/attach"),
    ]:
        status, err = await rest.call(method, path, ALICE)
        unknown, same = await rest.call(method, path.replace(aid, "ffffffff"), ALICE)
        assert (status, unknown) == (404, 404), (method, path, err)
        assert err["error"]["message"].replace(aid, "X") == same["error"]["message"].replace(
            "ffffffff", "X"
        )  # the same answer as for an id that does not exist
    assert aid not in (await ids_rest(rest, ALICE))[1]
    with pytest.raises(grpclib.GRPCError) as e:
        await grpc(channel, ALICE).alloc.get(v1.GetAllocationRequest(id=aid))
    assert e.value.status == Status.NOT_FOUND
    # bob himself, a tenant admin of physics and a read-only auditor see it
    for who in (bearer("bob"), _tenant_admin("physics"), bearer("ro", Role.READ_ONLY)):
        status, a = await rest.call("GET", base, who)
        assert status == 200 and a["id"] == aid
    # a tenant admin of bio does not, and lists only bio's allocations
    status, _ = await rest.call("GET", base, _tenant_admin("bio"))
    assert status == 404
    status, listed = await rest.call("GET", "/api/v1/allocations", _tenant_admin("bio"), all="true")
    assert status == 200 and [a["id"] for a in listed["allocations"]] == [w.alice_done]


async def test_a_tenants_maximum_preemption_class_caps_its_users(served: Any) -> None:
    _api, _w, rest, _channel = served
    status, t = await rest.call(
        "POST", "/api/v1/tenants", ROOT, {"name": "capped", "max_preemption_class": 3}
    )
    assert status == 201 and t["max_preemption_class"] == 3, t
    body = {"entrypoint": "true", "tenant": "capped", "vcluster": "batch", "walltime": "1h"}
    status, err = await rest.call(
        "POST", "/api/v1/allocations", ALICE, {**body, "preemption_class": 5}
    )
    assert status == 403 and "above tenant capped's maximum of 3" in err["error"]["message"]
    assert "--preemption-class 3" in err["error"]["hint"]
    status, a = await rest.call(
        "POST", "/api/v1/allocations", ALICE, {**body, "preemption_class": 3}
    )
    assert status == 201, a
    status, err = await rest.call(
        "PATCH", "/api/v1/tenants/capped", ROOT, {"max_preemption_class": 11}
    )
    assert status == 400 and "0 to 10" in err["error"]["message"]


async def test_a_caller_that_closed_its_stream_is_not_an_unhandled_error(
    served: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A caller that resets the stream (it gave up) while the answer is being made: h2
    refuses the send with StreamClosedError. That is the caller's doing: logged at info,
    counted as CANCELLED, and no 'unhandled error' traceback in the server's log."""
    import h2.exceptions
    from lattice_api.http import REQUESTS

    api, w, _rest, channel = served

    async def closed(*_: Any, **__: Any) -> Any:
        raise h2.exceptions.StreamClosedError(1)

    monkeypatch.setattr(api.ops.allocations, "find", closed)
    name = "/lattice.v1.AllocationService/Get"
    before = REQUESTS.labels(name, "CANCELLED")._value.get()
    with caplog.at_level("INFO"), pytest.raises(grpclib.GRPCError) as e:
        await grpc(channel, ALICE).alloc.get(v1.GetAllocationRequest(id=w.alice_pending))
    assert e.value.status == Status.CANCELLED
    assert REQUESTS.labels(name, "CANCELLED")._value.get() == before + 1
    assert [r.getMessage() for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")] == []
    assert f"{name}: the caller closed the stream before the answer" in caplog.text
