"""Parity: each implemented RPC run through gRPC and through REST gives the same records,
the same errors (code, message, details, hint, and the status each transport maps it
to) and the same listing rules. Both go to the same operations; this keeps the adapters
honest."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpclib
import msgspec
import pytest
from grpclib.const import Status
from lattice_api.auth import Role
from lattice_api.ops.dags import DagView
from lattice_common.errors import LatticeError
from lattice_common.proto.lattice import v1
from lattice_common.types import Allocation, AllocationSpec, Node, Tenant, VCluster
from lattice_common.wire import from_message, to_message
from served_api import Grpc, Rest, World, bearer, grpc_error

pytestmark = pytest.mark.timeout(60)

ALICE = bearer("alice")
BOB = bearer("bob")
ROOT = bearer("root", Role.SYSTEM_ADMIN)
AGENT = bearer("agent", Role.AGENT)
VOLATILE = {
    "id",
    "name",
    "created_at",
    "submitted_at",
    "registered_at",
    "revision",
    "started_at",
    "finished_at",
    "last_heartbeat",
}


def plain(record: Any, *, drop: set[str] = frozenset()) -> dict[str, Any]:  # type: ignore[assignment]
    data = msgspec.to_builtins(record)
    return {k: v for k, v in data.items() if k not in drop}


def from_rest(data: Any, t: type) -> Any:
    return msgspec.convert(data, t)


async def both(
    rest: Rest,
    grpc_call: Awaitable[Any],
    method: str,
    path: str,
    who: dict[str, str],
    body: Any = None,
    **query: Any,
) -> tuple[Any, Any]:
    got = await grpc_call
    status, data = await rest.call(method, path, who, body, **query)
    assert status in (200, 201), data
    return got, data


# --------------------------------------------------------------------------- reads


async def test_reads_give_the_same_records(served: Any) -> None:
    _api, w, rest, channel = served
    g = Grpc(channel, ALICE)
    got, data = await both(
        rest,
        g.alloc.get(v1.GetAllocationRequest(id=w.alice_done)),
        "GET",
        f"/api/v1/allocations/{w.alice_done}",
        ALICE,
    )
    assert plain(from_message(got, Allocation)) == plain(from_rest(data, Allocation))

    for query in ({}, {"user": "alice"}, {"state": "completed"}, {"tenant": "physics"}):
        got, data = await both(
            rest,
            g.alloc.list(v1.ListAllocationsRequest(**query)),
            "GET",
            "/api/v1/allocations",
            ALICE,
            **query,
        )
        assert [plain(from_message(a, Allocation)) for a in got.allocations] == [
            plain(from_rest(a, Allocation)) for a in data["allocations"]
        ], query

    # every user's allocations: ?all on REST, all_users on gRPC, for a role allowed to
    root = Grpc(channel, ROOT)
    got, data = await both(
        rest,
        root.alloc.list(v1.ListAllocationsRequest(all_users=True)),
        "GET",
        "/api/v1/allocations",
        ROOT,
        all="true",
    )
    everyone = [plain(from_message(a, Allocation)) for a in got.allocations]
    assert everyone == [plain(from_rest(a, Allocation)) for a in data["allocations"]]
    assert {a["spec"]["user"] for a in everyone} >= {"alice", "bob"}

    for query in ({}, {"state": "ready"}):
        got, data = await both(
            rest,
            g.nodes.list_nodes(v1.ListNodesRequest(**query)),
            "GET",
            "/api/v1/nodes",
            ALICE,
            **query,
        )
        assert [plain(from_message(n, Node)) for n in got.nodes] == [
            plain(from_rest(n, Node)) for n in data["nodes"]
        ]
    got, data = await both(
        rest, g.nodes.get_node(v1.GetNodeRequest(id="n1")), "GET", "/api/v1/nodes/n1", ALICE
    )
    assert plain(from_message(got, Node)) == plain(from_rest(data, Node))

    got, data = await both(
        rest, g.admin.list_tenants(v1.ListTenantsRequest()), "GET", "/api/v1/tenants", ALICE
    )
    assert [plain(from_message(t, Tenant)) for t in got.tenants] == [
        plain(from_rest(t, Tenant)) for t in data["tenants"]
    ]
    got, data = await both(
        rest,
        g.admin.get_tenant(v1.GetTenantRequest(name="physics")),
        "GET",
        "/api/v1/tenants/physics",
        ALICE,
    )
    assert plain(from_message(got, Tenant)) == plain(from_rest(data, Tenant))
    got, data = await both(
        rest,
        g.admin.list_v_clusters(v1.ListVClustersRequest()),
        "GET",
        "/api/v1/vclusters",
        ALICE,
    )
    assert [plain(from_message(v, VCluster)) for v in got.vclusters] == [
        plain(from_rest(v, VCluster)) for v in data["vclusters"]
    ]
    got, data = await both(
        rest,
        g.admin.get_v_cluster(v1.GetVClusterRequest(name="batch")),
        "GET",
        "/api/v1/vclusters/batch",
        ALICE,
    )
    assert plain(from_message(got, VCluster)) == plain(from_rest(data, VCluster))

    got, data = await both(
        rest,
        g.admin.get_raft_status(v1.GetRaftStatusRequest()),
        "GET",
        "/api/v1/raft/status",
        ALICE,
    )
    assert (int(got.member_id), got.term, got.commit_index, got.last_applied) == (
        data["member_id"],
        data["term"],
        data["commit_index"],
        data["last_applied"],
    )
    assert [(int(m.id), m.address, m.state) for m in got.members] == [
        (m["id"], m["address"], m["state"]) for m in data["members"]
    ]


async def test_streams_and_logs_give_the_same_lines(served: Any) -> None:
    _api, w, rest, channel = served
    g = Grpc(channel, ALICE)
    events = [
        (ev.revision, plain(from_message(ev.allocation, Allocation)))
        async for ev in g.alloc.watch(v1.WatchAllocationsRequest(id=w.alice_done))
    ]
    status, lines = await rest.call("GET", f"/api/v1/allocations/{w.alice_done}/watch", ALICE)
    assert status == 200
    assert events == [
        (ln["revision"], plain(from_rest(ln["allocation"], Allocation))) for ln in lines
    ]

    aid = w.bob_running  # bob's own logs (to alice, bob's allocation does not exist)
    g = Grpc(channel, BOB)
    got = await g.alloc.get_logs(v1.GetLogsRequest(allocation_id=aid, stream="stderr"))
    status, data = await rest.call("GET", f"/api/v1/allocations/{aid}/logs", BOB, stream="stderr")
    assert [ln.to_dict() for ln in got.lines] == [
        v1.LogLine(**ln).to_dict() for ln in data["lines"]
    ]
    streamed = [
        ln.to_dict()
        async for ln in g.alloc.stream_logs(v1.StreamLogsRequest(allocation_id=aid, tail=1))
    ]
    status, data = await rest.call("GET", f"/api/v1/allocations/{aid}/logs/stream", BOB, tail=1)
    assert streamed == [v1.LogLine(**ln).to_dict() for ln in data]


async def test_usage_gives_the_same_numbers(served: Any) -> None:
    _api, _w, rest, channel = served
    g = Grpc(channel, ALICE)
    got = await g.admin.get_tenant_usage(v1.GetTenantUsageRequest(tenant="physics"))
    status, data = await rest.call("GET", "/api/v1/tenants/physics/usage", ALICE)
    assert status == 200 and got.tenant == data["tenant"]
    for field in ("node_hours", "gpu_hours", "fair_share_usage"):  # bob's job still runs
        assert getattr(got, field) == pytest.approx(data[field], rel=0.05, abs=1e-3), field
    for field in ("nodes_in_use", "running_allocations", "max_nodes", "node_hours_budget"):
        assert getattr(got, field) == data[field], field
    got = await g.admin.get_user_usage(v1.GetUserUsageRequest(tenant="bio"))
    status, data = await rest.call("GET", "/api/v1/usage", ALICE, tenant="bio")
    assert (got.user, got.tenant, got.allocations) == (data["user"], data["tenant"], 1)
    assert got.node_hours == pytest.approx(data["node_hours"])


# --------------------------------------------------------------------------- writes


async def test_writes_give_the_same_records(served: Any) -> None:
    api, w, rest, channel = served
    g, admin = Grpc(channel, ALICE), Grpc(channel, ROOT)
    spec = w.spec("alice")
    res = await g.alloc.submit(v1.SubmitRequest(allocation=to_message(spec, v1.AllocationSpec)))
    status, data = await rest.call("POST", "/api/v1/allocations", ALICE, msgspec.to_builtins(spec))
    assert status == 201
    assert plain(from_message(res.allocations[0], Allocation), drop=VOLATILE) == plain(
        from_rest(data, Allocation), drop=VOLATILE
    )

    got = await g.alloc.cancel(v1.CancelAllocationRequest(id=res.allocation_ids[0]))
    status, data = await rest.call("DELETE", f"/api/v1/allocations/{data['id']}", ALICE)
    assert plain(from_message(got, Allocation), drop=VOLATILE) == plain(
        from_rest(data, Allocation), drop=VOLATILE
    )

    for rpc, action in (
        ("drain_node", "drain"),
        ("undrain_node", "undrain"),
        ("disable_node", "disable"),
        ("enable_node", "enable"),
    ):
        got = await getattr(admin.nodes, rpc)(v1.NodeActionRequest(id="n2", reason="r"))
        status, data = await rest.call("POST", f"/api/v1/nodes/n3/{action}", ROOT, {"reason": "r"})
        assert status == 200
        assert plain(from_message(got, Node), drop=VOLATILE) == plain(
            from_rest(data, Node), drop=VOLATILE
        ), action

    tenant = Tenant(name="t-grpc", max_nodes=4, fair_share_target=0.25)
    got = await admin.admin.create_tenant(
        v1.CreateTenantRequest(tenant=to_message(tenant, v1.Tenant))
    )
    status, data = await rest.call(
        "POST",
        "/api/v1/tenants",
        ROOT,
        {"name": "t-rest", "max_nodes": 4, "fair_share_target": 0.25},
    )
    assert status == 201
    assert plain(from_message(got, Tenant), drop=VOLATILE) == plain(
        from_rest(data, Tenant), drop=VOLATILE
    )
    got = await admin.admin.update_tenant(
        v1.UpdateTenantRequest(
            tenant=v1.Tenant(name="t-grpc", max_nodes=9), update_mask=["max_nodes"]
        )
    )
    status, data = await rest.call("PATCH", "/api/v1/tenants/t-rest", ROOT, {"max_nodes": 9})
    assert got.max_nodes == data["max_nodes"] == 9
    assert plain(from_message(got, Tenant), drop=VOLATILE) == plain(
        from_rest(data, Tenant), drop=VOLATILE
    )

    vc = VCluster(name="v-grpc", cycle_interval_seconds=5.0)
    got = await admin.admin.create_v_cluster(
        v1.CreateVClusterRequest(vcluster=to_message(vc, v1.VCluster))
    )
    status, data = await rest.call(
        "POST", "/api/v1/vclusters", ROOT, {"name": "v-rest", "cycle_interval_seconds": 5.0}
    )
    assert plain(from_message(got, VCluster), drop=VOLATILE) == plain(
        from_rest(data, VCluster), drop=VOLATILE
    )

    agent = Grpc(channel, AGENT)
    node = Node(id="r-grpc", hostname="h", group=2)
    got = await agent.nodes.register_node(v1.RegisterNodeRequest(node=to_message(node, v1.Node)))
    status, data = await rest.call(
        "POST", "/api/v1/nodes/register", AGENT, {"node_id": "r-rest", "hostname": "h", "group": 2}
    )
    assert plain(from_message(got.node, Node), drop=VOLATILE | {"hostname"}) == plain(
        from_rest(data, Node), drop=VOLATILE | {"hostname"}
    )
    for node_id, expected in (("r-grpc", False), ("ghost", True)):
        hb = await agent.nodes.heartbeat(v1.HeartbeatRequest(node_id=node_id, sequence=1))
        # the next heartbeat of the node carries the next sequence number (1 = a replay)
        status, out = await rest.call(
            "POST", f"/api/v1/nodes/{node_id}/heartbeat", AGENT, {"sequence": 2}
        )
        assert hb.reregister == out["reregister"] == expected
    assert api.quorum.read(lambda s: {"r-grpc", "r-rest"} <= set(s.nodes))


def _dag_body(w: Any, *, cycle: bool = False) -> dict[str, Any]:
    """A two-member DAG of alice's (b after a; with ``cycle``, a after b too)."""
    a = {"id": "a", **_spec_body(w)}
    if cycle:
        a["depends_on"] = [{"ref": "b", "condition": "success"}]
    b = {"id": "b", **_spec_body(w), "depends_on": [{"ref": "a", "condition": "any"}]}
    return {"name": "pair", "allocations": [a, b]}


def _dag_message(w: Any, *, cycle: bool = False) -> v1.SubmitRequest:
    members = []
    for m in _dag_body(w, cycle=cycle)["allocations"]:
        spec = msgspec.convert({k: v for k, v in m.items() if k != "id"}, AllocationSpec)
        members.append(v1.DagAllocation(id=m["id"], spec=to_message(spec, v1.AllocationSpec)))
    return v1.SubmitRequest(dag=v1.DagSpec(name="pair", allocations=members))


def _dag_plain(view: DagView) -> dict[str, Any]:
    data = plain(view, drop=VOLATILE)
    for m in data["members"]:
        m.pop("allocation_id")
    return data


async def test_dags_give_the_same_records(served: Any) -> None:
    _api, w, rest, channel = served
    g = Grpc(channel, ALICE)
    res = await g.alloc.submit(_dag_message(w))
    status, data = await rest.call("POST", "/api/v1/dags", ALICE, _dag_body(w))
    assert status == 201
    drop = VOLATILE | {"dag_id"}
    assert [plain(from_message(a, Allocation), drop=drop) for a in res.allocations] == [
        plain(from_rest(a, Allocation), drop=drop) for a in data["allocations"]
    ]
    got = await g.alloc.get_dag(v1.GetDagRequest(id=res.dag_id))
    status, same = await rest.call("GET", f"/api/v1/dags/{res.dag_id}", ALICE)
    assert from_message(got, DagView) == from_rest(same, DagView)
    assert _dag_plain(from_rest(same, DagView)) == _dag_plain(from_rest(data["dag"], DagView))
    assert [m.state for m in got.members] == ["Pending", "Blocked"]

    for query in ({}, {"state": "running"}, {"user": "alice"}, {"tenant": "bio"}):
        got, data = await both(
            rest,
            g.alloc.list_dags(v1.ListDagsRequest(**query)),
            "GET",
            "/api/v1/dags",
            ALICE,
            **query,
        )
        assert [from_message(d, DagView) for d in got.dags] == [
            from_rest(d, DagView) for d in data["dags"]
        ], query

    status, second = await rest.call("POST", "/api/v1/dags", ALICE, _dag_body(w))
    got = await g.alloc.cancel_dag(v1.CancelDagRequest(id=res.dag_id, reason="r"))
    status, data = await rest.call("DELETE", f"/api/v1/dags/{second['dag_id']}", ALICE, reason="r")
    assert status == 200
    assert _dag_plain(from_message(got.dag, DagView)) == _dag_plain(from_rest(data["dag"], DagView))
    assert len(got.cancelled_allocation_ids) == len(data["cancelled_allocation_ids"]) == 2


# --------------------------------------------------------------------------- errors


def rest_status_of(err: dict[str, Any]) -> int:
    return type(LatticeError.from_dict(err)).http_status


def grpc_status_of(err: dict[str, Any]) -> str:
    return Status(type(LatticeError.from_dict(err)).grpc_status).name


Case = tuple[str, Callable[[Grpc, Any], Awaitable[Any]], tuple[Any, ...], dict[str, str]]


def _spec_body(w: Any, **kw: Any) -> dict[str, Any]:
    return {**msgspec.to_builtins(w.spec("alice")), **kw}


def _spec_message(w: Any, **kw: Any) -> v1.AllocationSpec:
    return to_message(msgspec.convert(_spec_body(w, **kw), AllocationSpec), v1.AllocationSpec)


ERROR_CASES: list[Case] = [
    (
        "more nodes than the vCluster could ever offer",
        lambda g, w: g.alloc.submit(v1.SubmitRequest(allocation=_spec_message(w, nodes=9))),
        ("POST", "/api/v1/allocations", "{spec_nine}"),
        ALICE,
    ),
    (
        "more nodes than the tenant's max_nodes",
        lambda g, w: g.alloc.submit(v1.SubmitRequest(allocation=_spec_message(w, nodes=11))),
        ("POST", "/api/v1/allocations", "{spec_eleven}"),
        ALICE,
    ),
    (
        "a gpu type no node has",
        lambda g, w: g.alloc.submit(
            v1.SubmitRequest(
                allocation=_spec_message(w, constraints={"gpu_type": "H100"}), test_only=True
            )
        ),
        ("POST", "/api/v1/allocations", "{spec_h100_test_only}"),
        ALICE,
    ),
    (
        "queue of an unknown vcluster",
        lambda g, w: g.admin.get_v_cluster_queue(v1.GetVClusterQueueRequest(name="x")),
        ("GET", "/api/v1/vclusters/x/queue"),
        ALICE,
    ),
    (
        "get unknown",
        lambda g, w: g.alloc.get(v1.GetAllocationRequest(id="nope")),
        ("GET", "/api/v1/allocations/nope"),
        ALICE,
    ),
    (
        "list all users without the permission",
        lambda g, w: g.alloc.list(v1.ListAllocationsRequest(all_users=True)),
        ("GET", "/api/v1/allocations", None, {"all": "true"}),
        ALICE,
    ),
    (
        "list bad state",
        lambda g, w: g.alloc.list(v1.ListAllocationsRequest(state="bogus")),
        ("GET", "/api/v1/allocations", None, {"state": "bogus"}),
        ALICE,
    ),
    (
        "cancel another's",
        lambda g, w: g.alloc.cancel(v1.CancelAllocationRequest(id=w.bob_running)),
        ("DELETE", "/api/v1/allocations/{bob_running}"),
        ALICE,
    ),
    (
        "cancel finished",
        lambda g, w: g.alloc.cancel(v1.CancelAllocationRequest(id=w.alice_done)),
        ("DELETE", "/api/v1/allocations/{alice_done}"),
        ALICE,
    ),
    (
        "submit unknown tenant",
        lambda g, w: g.alloc.submit(
            v1.SubmitRequest(allocation=to_message(w.spec("alice", "nobody"), v1.AllocationSpec))
        ),
        (
            "POST",
            "/api/v1/allocations",
            msgspec.to_builtins(World.spec("alice", "nobody")),
        ),
        ALICE,
    ),
    (
        "dag with a cycle",
        lambda g, w: g.alloc.submit(_dag_message(w, cycle=True)),
        ("POST", "/api/v1/dags", "{dag_cycle}"),
        ALICE,
    ),
    (
        "get unknown dag",
        lambda g, w: g.alloc.get_dag(v1.GetDagRequest(id="nope")),
        ("GET", "/api/v1/dags/nope"),
        ALICE,
    ),
    (
        "list dags of a bad state",
        lambda g, w: g.alloc.list_dags(v1.ListDagsRequest(state="bogus")),
        ("GET", "/api/v1/dags", None, {"state": "bogus"}),
        ALICE,
    ),
    (
        "cancel unknown dag",
        lambda g, w: g.alloc.cancel_dag(v1.CancelDagRequest(id="nope")),
        ("DELETE", "/api/v1/dags/nope"),
        ALICE,
    ),
    (
        "get unknown node",
        lambda g, w: g.nodes.get_node(v1.GetNodeRequest(id="nx")),
        ("GET", "/api/v1/nodes/nx"),
        ALICE,
    ),
    (
        "drain unknown node",
        lambda g, w: g.nodes.drain_node(v1.NodeActionRequest(id="nx")),
        ("POST", "/api/v1/nodes/nx/drain"),
        ROOT,
    ),
    (
        "release unclaimed",
        lambda g, w: g.nodes.release_node_claim(v1.NodeActionRequest(id="n3")),
        ("POST", "/api/v1/nodes/n3/release"),
        ROOT,
    ),
    (
        "unknown tenant",
        lambda g, w: g.admin.get_tenant(v1.GetTenantRequest(name="x")),
        ("GET", "/api/v1/tenants/x"),
        ALICE,
    ),
    (
        "unknown vcluster",
        lambda g, w: g.admin.get_v_cluster(v1.GetVClusterRequest(name="x")),
        ("GET", "/api/v1/vclusters/x"),
        ALICE,
    ),
    (
        "tenant exists",
        lambda g, w: g.admin.create_tenant(v1.CreateTenantRequest(tenant=v1.Tenant(name="bio"))),
        ("POST", "/api/v1/tenants", {"name": "bio"}),
        ROOT,
    ),
    (
        "bad quota",
        lambda g, w: g.admin.update_tenant(
            v1.UpdateTenantRequest(
                tenant=v1.Tenant(name="bio", max_nodes=-1), update_mask=["max_nodes"]
            )
        ),
        ("PATCH", "/api/v1/tenants/bio", {"max_nodes": -1}),
        ROOT,
    ),
    (
        "another user's usage",
        lambda g, w: g.admin.get_user_usage(v1.GetUserUsageRequest(user="bob")),
        ("GET", "/api/v1/usage", None, {"user": "bob"}),
        ALICE,
    ),
    (
        "unknown tenant usage",
        lambda g, w: g.admin.get_tenant_usage(v1.GetTenantUsageRequest(tenant="x")),
        ("GET", "/api/v1/tenants/x/usage"),
        ALICE,
    ),
    (
        "the audit log read by a user",
        lambda g, w: g.admin.query_audit(v1.QueryAuditRequest()),
        ("GET", "/api/v1/admin/audit"),
        ALICE,
    ),
    (
        "an audit page token the server never gave",
        lambda g, w: g.admin.query_audit(v1.QueryAuditRequest(page_token="x")),
        ("GET", "/api/v1/admin/audit", None, {"page_token": "x"}),
        ROOT,
    ),
]


@pytest.mark.parametrize(
    ("name", "grpc_call", "rest_call", "who"), ERROR_CASES, ids=[c[0] for c in ERROR_CASES]
)
async def test_errors_are_the_same(
    served: Any, name: str, grpc_call: Any, rest_call: tuple[Any, ...], who: dict[str, str]
) -> None:
    _api, w, rest, channel = served
    gstatus, gerr = await grpc_error(grpc_call(Grpc(channel, who), w))
    method, path, *rest_args = rest_call
    body = rest_args[0] if rest_args else None
    bodies = {
        "{spec_nine}": _spec_body(w, nodes=9),
        "{spec_eleven}": _spec_body(w, nodes=11),
        "{spec_h100_test_only}": _spec_body(w, constraints={"gpu_type": "H100"}, test_only=True),
        "{dag_cycle}": _dag_body(w, cycle=True),
    }
    body = bodies.get(body, body) if isinstance(body, str) else body
    stored = len(_api.quorum.state.allocations)
    query = rest_args[1] if len(rest_args) > 1 else {}
    rstatus, data = await rest.call(method, path.format(**vars(w)), who, body, **query)
    rerr = data["error"]
    assert gerr == rerr, name
    assert rstatus == rest_status_of(rerr) and rstatus >= 400
    assert gstatus == grpc_status_of(gerr)
    assert len(_api.quorum.state.allocations) == stored, "a refused request stored something"


async def test_grpc_errors_rebuild_the_typed_error(served: Any) -> None:
    _api, _w, _rest, channel = served
    with pytest.raises(grpclib.GRPCError) as e:
        await Grpc(channel, ALICE).alloc.get(v1.GetAllocationRequest(id="nope"))
    err = LatticeError.from_dict(msgspec.json.decode(e.value.message or "{}"))
    assert err.code == "not_found" and err.hint == "List your allocations with `lattice status`."


# --------------------------------------------------------------------------- admission


async def test_test_only_and_the_queue_give_the_same_answers(served: Any) -> None:
    api, w, rest, channel = served
    g = Grpc(channel, ALICE)
    stored = len(api.quorum.state.allocations)
    res = await g.alloc.submit(v1.SubmitRequest(allocation=_spec_message(w), test_only=True))
    status, data = await rest.call(
        "POST", "/api/v1/allocations", ALICE, _spec_body(w, test_only=True)
    )
    assert status == 200 and data["test_only"] is True
    est = data["estimate"]
    assert (
        res.estimate.estimate_basis == est["estimate_basis"] and res.estimate.nodes == est["nodes"]
    )
    assert len(api.quorum.state.allocations) == stored  # nothing stored either way
    got = await g.admin.get_v_cluster_queue(v1.GetVClusterQueueRequest(name="batch"))
    status, data = await rest.call("GET", "/api/v1/vclusters/batch/queue", ALICE)
    assert status == 200 and got.total == data["total"] >= 1
    assert [e.allocation.id for e in got.entries] == [
        e["allocation"]["id"] for e in data["entries"]
    ]
    assert [e.position for e in got.entries] == [e["position"] for e in data["entries"]]
    assert all(e.allocation.spec.user == "alice" for e in got.entries)  # the listing rule


async def test_the_end_time_window_is_the_same_on_both_transports(served: Any) -> None:
    """ListAllocations' ended_since/ended_until and REST's since/until (lattice history)."""
    _api, w, rest, channel = served
    g = Grpc(channel, ALICE)
    done = from_message(await g.alloc.get(v1.GetAllocationRequest(id=w.alice_done)), Allocation)
    assert done.finished_at is not None
    for since, until, expect in [
        (done.finished_at, 0.0, True),
        (done.finished_at + 1, 0.0, False),
        (1.0, done.finished_at, False),  # until is exclusive
        (1.0, done.finished_at + 1, True),
    ]:
        query: dict[str, Any] = {"state": "Completed", "since": since}
        if until:
            query["until"] = until
        got, data = await both(
            rest,
            g.alloc.list(
                v1.ListAllocationsRequest(state="Completed", ended_since=since, ended_until=until)
            ),
            "GET",
            "/api/v1/allocations",
            ALICE,
            **query,
        )
        grpc_ids = [a.id for a in got.allocations]
        rest_ids = [a["id"] for a in data["allocations"]]
        assert grpc_ids == rest_ids and (w.alice_done in rest_ids) == expect, (since, until)
