"""Tenant and user usage (GetTenantUsage / GetUserUsage, /api/v1/tenants/{id}/usage,
/api/v1/usage) against a real single-member QuorumMember, over REST and gRPC; and a
real local cluster (``cluster`` mark) where short jobs run and the CLI reads usage."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpclib
import jwt
import pytest
from aiohttp.test_utils import TestClient, TestServer
from grpclib.client import Channel
from grpclib.const import Status
from lattice_api.auth import Authenticator, Identity, Role
from lattice_api.grpc.server import build_grpc_server
from lattice_api.logs import LogProxy
from lattice_api.node_monitor import NodeMonitor
from lattice_api.operations import Operations
from lattice_api.ops.usage import UsageOps, parse_days, window_from_range
from lattice_api.rest.app import build_rest_app
from lattice_cli.devcluster import free_port
from lattice_common import commands as c
from lattice_common.agents import AgentChannels
from lattice_common.errors import NotFound, PermissionDenied, ValidationError
from lattice_common.proto.lattice import v1
from lattice_common.types import AllocationState, NodeCapabilities
from lattice_quorum.member import QuorumMember
from lattice_test_harness import builders as b

pytestmark = pytest.mark.timeout(120)

H = 3600.0
DAY = 86400.0
SECRET = "usage-test-secret-that-is-long-enough!"
AGENT_TOKEN = "agent-token-usage-0123456789"
ADMIN = Identity("root", Role.SYSTEM_ADMIN)


# --------------------------------------------------------------------------- validation


def test_parse_days() -> None:
    assert parse_days(None) is None and parse_days("") is None and parse_days(" ") is None
    assert parse_days("90") == 90 and isinstance(parse_days("90"), int)
    assert parse_days(7.5) == 7.5 and parse_days("1") == 1 and parse_days(3650) == 3650
    for bad in ("0", "3651", "-1", "abc", "nan", "inf", True, [], "1e9"):
        with pytest.raises(ValidationError) as e:
            parse_days(bad)
        assert "days" in e.value.message and "3650" in e.value.hint


def test_window_from_range() -> None:
    now = 1_000_000_000.0
    assert window_from_range(0, 0, now, 90) == (90, now)
    assert window_from_range(0, now - H, now, 90) == (90, now - H)
    assert window_from_range(now - DAY, 0, now, 90) == (1.0, now)
    assert window_from_range(now - 2 * DAY, now - DAY, now, 90) == (1.0, now - DAY)
    assert window_from_range(now - DAY, now + DAY, now, 90) == (1.0, now)  # never past now
    with pytest.raises(ValidationError):
        window_from_range(now, now - 1, now, 90)
    with pytest.raises(ValidationError):
        window_from_range(now - 4000 * DAY, 0, now, 90)


def test_period_days_default_and_override() -> None:
    assert UsageOps(None).period_days == 90  # type: ignore[arg-type]
    assert UsageOps(None, budget_period_days=30).period_days == 30  # type: ignore[arg-type]
    assert isinstance(UsageOps(None, budget_period_days=30.0).period_days, int)  # type: ignore[arg-type]


def ops_for(m: QuorumMember, **kw: Any) -> Operations:
    return Operations(m, monitor=NodeMonitor(m), logs=LogProxy(m, AgentChannels()), **kw)


# --------------------------------------------------------------------------- a real member


@contextlib.asynccontextmanager
async def seeded_member(tmp_path: Path) -> AsyncIterator[tuple[QuorumMember, float]]:
    """physics: alice ran 2 nodes x 4 GPUs for 2 h (done 1 h ago); bob runs 1 CPU node
    since 30 min. bio: alice ran 1 CPU node for 1 h (done 1 h ago) and 1 day, 200 days
    ago. A pending allocation counts for nothing."""
    m = QuorumMember(
        node_id=1, bind=f"127.0.0.1:{free_port()}", peers={}, data_dir=tmp_path, bootstrap=True
    )
    m.attach_loop(asyncio.get_running_loop())
    try:
        deadline = time.monotonic() + 15
        while not (m.is_leader and m.caught_up):
            assert time.monotonic() < deadline, "no leadership"
            await asyncio.sleep(0.02)
        t = time.time()

        async def ok(cmd: c.Command) -> c.CommandResult:
            res = await m.propose(cmd)
            assert res.error is None, res.error
            return res

        await ok(
            c.CreateTenant(
                tenant=b.tenant(
                    "physics",
                    gpu_hours_budget=100.0,
                    node_hours_budget=10.0,
                    max_nodes=10,
                    fair_share_target=0.5,
                ),
                now=t,
            )
        )
        await ok(c.CreateTenant(tenant=b.tenant("bio"), now=t))
        await ok(c.CreateVCluster(vcluster=b.vcluster("v"), now=t))
        for nid, gpus in (("g1", 4), ("g2", 4), ("c1", 0), ("c2", 0)):
            await ok(
                c.RegisterNode(node_id=nid, capabilities=NodeCapabilities(gpu_count=gpus), now=t)
            )

        async def run(
            tenant: str, user: str, nodes: list[str], start: float, end: float | None
        ) -> str:
            spec = b.spec("true", tenant=tenant, vcluster="v", user=user, nodes=len(nodes))
            aid = (await ok(c.SubmitAllocation(spec=spec, now=start))).allocation.id
            await ok(c.AssignNodes(allocation_id=aid, node_ids=nodes, now=start))
            if end is not None:
                await ok(
                    c.UpdateAllocationState(
                        allocation_id=aid,
                        state=AllocationState.COMPLETED,
                        exit_code=0,
                        finished_at=end,
                        now=end,
                    )
                )
            return aid

        await run("physics", "alice", ["g1", "g2"], t - 3 * H, t - H)
        await run("physics", "bob", ["c1"], t - 0.5 * H, None)
        await run("bio", "alice", ["c2"], t - 200 * DAY, t - 199 * DAY)
        await run("bio", "alice", ["c2"], t - 2 * H, t - H)
        await ok(c.SubmitAllocation(spec=b.spec("true", tenant="physics", user="alice"), now=t))
        yield m, t
    finally:
        m.close()


async def test_tenant_usage_from_the_quorum(tmp_path: Path) -> None:
    async with seeded_member(tmp_path) as (m, t):
        u = UsageOps(m)
        d = u.tenant_usage(ADMIN, "physics", None, now=t)
        assert d["tenant"] == "physics" and d["days"] == 90 and d["budget_period_days"] == 90
        assert d["until"] == t and d["since"] == pytest.approx(t - 90 * DAY)
        assert d["node_hours"] == pytest.approx(4.5)  # 2 h x 2 nodes + 0.5 h x 1 node
        assert d["gpu_hours"] == pytest.approx(16.0)  # 2 h x 8 GPUs; c1 has none
        assert d["allocations"] == 2 and d["running_allocations"] == 1
        assert d["nodes_in_use"] == 1 and d["max_nodes"] == 10
        assert d["max_concurrent_allocations"] is None
        assert d["node_hours_budget"] == 10.0 and d["gpu_hours_budget"] == 100.0
        assert d["node_hours_used"] == pytest.approx(4.5)
        assert d["gpu_hours_used"] == pytest.approx(16.0)
        assert d["node_budget_fraction"] == pytest.approx(0.45)
        assert d["gpu_budget_fraction"] == pytest.approx(0.16)
        assert d["budget_fraction_used"] == pytest.approx(0.45)  # the worse of the two
        assert d["node_hours_remaining"] == pytest.approx(5.5)
        assert d["gpu_hours_remaining"] == pytest.approx(84.0)
        assert d["fair_share_target"] == 0.5
        assert d["fair_share_usage"] == pytest.approx(4.5 / 5.5)
        assert d["budget_source"] == "internal"
        assert [(u["user"], round(u["node_hours"], 6)) for u in d["users"]] == [
            ("alice", 4.0),
            ("bob", 0.5),
        ]
        json.dumps(d)  # JSON-able as is

        # a shorter window: usage shrinks, the budget is still judged over the period
        short = u.tenant_usage(ADMIN, "physics", 1, now=t + 0.5 * DAY)
        assert short["days"] == 1
        assert short["node_hours"] == pytest.approx(4.0 + 12.5)
        assert short["node_hours_used"] == pytest.approx(4.0 + 12.5)
        assert short["budget_fraction_used"] == pytest.approx(1.65)
        assert short["node_hours_remaining"] == 0.0

        bio = u.tenant_usage(ADMIN, "bio", "365", now=t)
        assert bio["node_hours"] == pytest.approx(25.0) and bio["allocations"] == 2
        assert bio["budget_fraction_used"] is None and bio["node_hours_remaining"] is None

        with pytest.raises(NotFound) as e:
            u.tenant_usage(ADMIN, "nobody", None)
        assert "admin tenant list" in e.value.hint
        with pytest.raises(ValidationError):
            u.tenant_usage(ADMIN, "physics", 0)


async def test_user_usage_from_the_quorum(tmp_path: Path) -> None:
    async with seeded_member(tmp_path) as (m, t):
        u = UsageOps(m)
        alice = Identity("alice", Role.USER)
        d = u.user_usage(alice, None, None, now=t)  # the caller's own
        assert d["user"] == "alice" and d["tenant"] == "" and d["days"] == 90
        assert d["node_hours"] == pytest.approx(5.0) and d["gpu_hours"] == pytest.approx(16.0)
        assert d["allocations"] == 2 and d["running_allocations"] == 0
        assert [(x["tenant"], round(x["node_hours"], 6)) for x in d["tenants"]] == [
            ("bio", 1.0),
            ("physics", 4.0),
        ]
        year = u.user_usage(alice, "alice", 365, now=t)
        assert year["node_hours"] == pytest.approx(29.0) and year["allocations"] == 3
        only = u.user_usage(alice, "alice", 90, tenant="bio", now=t)
        assert only["tenant"] == "bio" and only["node_hours"] == pytest.approx(1.0)
        nobody = u.user_usage(ADMIN, "carol", 90, now=t)
        assert nobody["node_hours"] == 0.0 and nobody["tenants"] == []

        # others' usage needs permission (an object-level check in the operation);
        # agents see none (the permission table: test_rest_routes, test_grpc_admin_service)
        with pytest.raises(PermissionDenied):
            u.user_usage(alice, "bob", None)
        bob = u.user_usage(Identity("op", Role.OPERATOR), "bob", None, now=t)
        assert bob["node_hours"] == pytest.approx(0.5) and bob["running_allocations"] == 1
        with pytest.raises(NotFound):
            u.user_usage(alice, None, None, tenant="nobody")


async def test_rest_routes(tmp_path: Path) -> None:
    async with seeded_member(tmp_path) as (m, _t):
        auth = Authenticator(hmac_secret=SECRET, agent_token=AGENT_TOKEN)
        app = build_rest_app(ops_for(m), auth)

        def bearer(sub: str, **claims: Any) -> dict[str, str]:
            tok = jwt.encode({"sub": sub, "exp": int(time.time()) + 600, **claims}, SECRET)
            return {"authorization": f"Bearer {tok}"}

        async with TestClient(TestServer(app)) as client:
            r = await client.get("/api/v1/tenants/physics/usage?days=90", headers=bearer("alice"))
            assert r.status == 200
            d = await r.json()
            assert d["tenant"] == "physics" and d["node_hours"] == pytest.approx(4.5, abs=0.01)
            assert d["budget_fraction_used"] == pytest.approx(0.45, abs=0.01)

            r = await client.get("/api/v1/usage", headers=bearer("alice"))
            assert r.status == 200
            d = await r.json()
            assert d["user"] == "alice" and d["node_hours"] == pytest.approx(5.0)

            r = await client.get(
                "/api/v1/usage?user=alice&days=365&tenant=bio", headers=bearer("alice")
            )
            d = await r.json()
            assert (d["tenant"], d["days"], d["node_hours"]) == ("bio", 365, pytest.approx(25.0))

            r = await client.get("/api/v1/usage?user=bob", headers=bearer("alice"))
            assert r.status == 403
            assert (await r.json())["error"]["code"] == "permission_denied"
            r = await client.get("/api/v1/usage?user=bob", headers=bearer("root", scope="admin"))
            assert r.status == 200 and (await r.json())["user"] == "bob"

            r = await client.get("/api/v1/tenants/physics/usage?days=0", headers=bearer("alice"))
            assert r.status == 400
            err = (await r.json())["error"]
            assert err["code"] == "invalid_argument" and "3650" in err["hint"]
            r = await client.get("/api/v1/usage?days=lots", headers=bearer("alice"))
            assert r.status == 400
            r = await client.get("/api/v1/tenants/nobody/usage", headers=bearer("alice"))
            assert r.status == 404
            agent = {"authorization": f"Bearer {AGENT_TOKEN}"}
            r = await client.get("/api/v1/tenants/physics/usage", headers=agent)
            assert r.status == 403
            r = await client.get("/api/v1/usage", headers=agent)
            assert r.status == 403
            r = await client.get("/api/v1/usage")
            assert r.status == 401


async def test_grpc_admin_service(tmp_path: Path) -> None:
    async with seeded_member(tmp_path) as (m, t):
        server = build_grpc_server(ops_for(m), Authenticator(agent_token=AGENT_TOKEN))
        port = free_port()
        await server.start("127.0.0.1", port)
        channel = Channel("127.0.0.1", port)
        try:
            stub = v1.AdminServiceStub(channel, timeout=10, metadata={"x-lattice-user": "alice"})
            tu = await stub.get_tenant_usage(v1.GetTenantUsageRequest(tenant="physics"))
            assert tu.tenant == "physics"
            assert tu.node_hours == pytest.approx(4.5, abs=0.01)
            assert tu.gpu_hours == pytest.approx(16.0)
            assert (tu.node_hours_budget, tu.gpu_hours_budget) == (10.0, 100.0)
            assert (tu.nodes_in_use, tu.running_allocations, tu.max_nodes) == (1, 1, 10)
            assert tu.max_concurrent_allocations is None
            assert tu.fair_share_target == 0.5 and 0.8 < tu.fair_share_usage < 0.83

            # since/until select the window: the first hour of alice's physics run only
            win = await stub.get_tenant_usage(
                v1.GetTenantUsageRequest(tenant="physics", since=t - 4 * H, until=t - 2 * H)
            )
            assert win.node_hours == pytest.approx(2.0) and win.gpu_hours == pytest.approx(8.0)
            assert win.running_allocations == 1  # "now", not in the window

            uu = await stub.get_user_usage(v1.GetUserUsageRequest())  # the caller
            assert (uu.user, uu.tenant, uu.allocations) == ("alice", "", 2)
            assert uu.node_hours == pytest.approx(5.0)
            bio = await stub.get_user_usage(
                v1.GetUserUsageRequest(user="alice", tenant="bio", since=t - 365 * DAY)
            )
            assert (bio.tenant, bio.allocations) == ("bio", 2)
            assert bio.node_hours == pytest.approx(25.0)

            with pytest.raises(grpclib.GRPCError) as e:
                await stub.get_tenant_usage(
                    v1.GetTenantUsageRequest(tenant="physics", since=t, until=t - H)
                )
            assert e.value.status == Status.INVALID_ARGUMENT
            with pytest.raises(grpclib.GRPCError) as e:
                await stub.get_tenant_usage(v1.GetTenantUsageRequest(tenant="nobody"))
            assert e.value.status == Status.NOT_FOUND
            assert json.loads(e.value.message)["code"] == "not_found"
            with pytest.raises(grpclib.GRPCError) as e:
                await stub.get_tenant_usage(v1.GetTenantUsageRequest())
            assert e.value.status == Status.INVALID_ARGUMENT

            agent = v1.AdminServiceStub(
                channel, timeout=10, metadata={"authorization": f"Bearer {AGENT_TOKEN}"}
            )
            for call in (
                agent.get_tenant_usage(v1.GetTenantUsageRequest(tenant="physics")),
                agent.get_user_usage(v1.GetUserUsageRequest()),
            ):
                with pytest.raises(grpclib.GRPCError) as e:
                    await call
                assert e.value.status == Status.PERMISSION_DENIED
        finally:
            channel.close()
            server.close()
            await server.wait_closed()


# --------------------------------------------------------------------------- a real cluster


@pytest.mark.cluster
def test_usage_on_a_real_cluster(lattice_cluster: Any) -> None:
    h = lattice_cluster
    tenant = h.cluster.tenant
    ids = [h.submit("sleep 0.3", name=f"usage-{i}")["id"] for i in range(2)]
    for aid in ids:
        assert h.wait_state(aid, "Completed", timeout=30)["started_at"] is not None

    t = h.request("GET", f"/api/v1/tenants/{tenant}/usage?days=90")
    assert t["tenant"] == tenant and t["days"] == 90
    assert t["node_hours"] > 0 and t["allocations"] >= 2
    assert t["node_hours"] < 1.0  # two sub-second jobs (and whatever else ran briefly)
    assert any(u["user"] == h.user and u["node_hours"] > 0 for u in t["users"])

    u = h.request("GET", f"/api/v1/usage?user={h.user}&days=90")
    assert u["user"] == h.user and u["node_hours"] > 0 and u["allocations"] >= 2
    mine = h.request("GET", "/api/v1/usage")
    assert mine["user"] == h.user and mine["node_hours"] == pytest.approx(u["node_hours"], rel=0.5)

    proc = h.cli("usage", "--tenant", tenant, "-o", "json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["tenant"] == tenant and data["node_hours"] > 0

    proc = h.cli("usage")
    assert proc.returncode == 0, proc.stderr
    assert "User:" in proc.stdout and h.user in proc.stdout and "Node-hours" in proc.stdout

    proc = h.cli("usage", "--tenant", tenant, "--days", "0")
    assert proc.returncode == 2 and proc.stderr.startswith("Error: --days must be between")
    assert "Hint:" in proc.stderr
    proc = h.cli("usage", "--tenant", "no-such-tenant")
    assert proc.returncode == 1 and "not found" in proc.stderr and "Traceback" not in proc.stderr
