"""The quota feedback loop: Waldur's budgets read for f7, and Waldur's PUT of a tenant's
quotas on the real Lattice API with a service token scoped to quota updates."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import jwt
import pytest
from lattice_accounting.waldur.client import WaldurClient, WaldurRejected, WaldurUnreachable
from lattice_accounting.waldur.quota import (
    BudgetOverride,
    budget_from_quotas,
    merge_fractions,
    remaining_budget,
)
from lattice_common import commands as c
from lattice_common.errors import QuotaExceeded
from lattice_common.types import AllocationSpec, AllocationState
from lattice_test_harness.fake_waldur import FakeWaldur
from lattice_test_harness.local_api import LocalApi, serve_local_api
from pydantic import SecretStr

# module-level tokens are minted at collection; a whole suite (run in any order, on any
# number of workers) must finish before they expire
TOKEN_LIFETIME_S = 6 * 3600

pytestmark = pytest.mark.timeout(120)

TOKEN = "waldur-token-quota-0123456789"
SECRET = "waldur-quota-test-hmac-secret-long-enough!"


@pytest.fixture
async def waldur() -> AsyncIterator[FakeWaldur]:
    async with FakeWaldur(token=TOKEN) as w:
        yield w


# --- Waldur's budgets for the cost function -------------------------------------------


def test_budget_from_waldur_quotas() -> None:
    b = budget_from_quotas(
        "physics",
        [
            {"name": "gpu_hours", "limit": 1000, "usage": 900},
            {"name": "node_hours", "limit": 5000, "usage": 1000},
            {"name": "storage", "limit": 1, "usage": 1},
        ],
        now=10.0,
    )
    assert b.remaining_budget == 100.0
    assert b.fraction_used == 0.9  # the worse of 0.9 and 0.2
    unlimited = budget_from_quotas("t", {"gpu_hours": {"limit": -1, "usage": 5}}, now=0.0)
    assert unlimited.fraction_used is None and unlimited.remaining_budget is None
    zero = budget_from_quotas("t", [{"name": "gpu_hours", "limit": 0, "usage": 0}], now=0.0)
    assert zero.fraction_used == 1.0  # a zero budget is used up, as in the ledger
    with pytest.raises(ValueError):
        budget_from_quotas("t", "nonsense", now=0.0)


async def test_remaining_budget_overrides_the_ledger_while_waldur_answers(
    waldur: FakeWaldur,
) -> None:
    waldur.set_quotas("physics", {"gpu_hours": (1000, 950)})
    waldur.set_quotas("chemistry", {"node_hours": (200, 50)})
    async with WaldurClient(waldur.api_url, SecretStr(TOKEN)) as client:
        b = await remaining_budget(client, "physics")
        assert b.remaining_budget == 50.0 and b.fraction_used == 0.95
        with pytest.raises(WaldurRejected):  # Waldur does not know this customer
            await remaining_budget(client, "biology")

        override = BudgetOverride(client, max_age_seconds=60)
        await override.refresh(["physics", "chemistry", "biology"], now=1000.0)
        assert override.fractions(now=1010.0) == {"physics": 0.95, "chemistry": 0.25}
        internal = {"physics": 0.10, "biology": 0.40}
        assert merge_fractions(override.fractions(now=1010.0), internal) == {
            "physics": 0.95,
            "chemistry": 0.25,
            "biology": 0.40,
        }
        # Waldur goes down: its numbers age out and the internal ledger takes over
        await waldur.down()
        with pytest.raises(WaldurUnreachable):
            await remaining_budget(client, "physics")
        await override.refresh(["physics"], now=1100.0)
        assert "cannot reach Waldur" in override.last_error
        assert merge_fractions(override.fractions(now=1100.0), internal) == internal
        await waldur.up()
        await override.refresh(["physics"], now=1200.0)
        assert override.fractions(now=1200.0) == {"physics": 0.95}


# --- Waldur -> Lattice: PUT /api/v1/tenants/{id} --------------------------------------


def bearer(sub: str, **claims: Any) -> str:
    return jwt.encode(
        {"sub": sub, "exp": int(time.time()) + TOKEN_LIFETIME_S, **claims},
        SECRET,
        algorithm="HS256",
    )


WALDUR_SERVICE = bearer("waldur", scope="quota:update")
ADMIN = bearer("root", scope="admin")
USER = bearer("alice")


@pytest.fixture
async def api() -> AsyncIterator[LocalApi]:
    async with serve_local_api(hmac_secret=SECRET) as api:
        api.add_tenant("physics", max_nodes=3, isolation="standard")
        api.add_vcluster("hpc")
        for i in range(4):
            api.add_node(f"n{i}")
        yield api


async def call(api: LocalApi, method: str, path: str, token: str, body: Any = None) -> Any:
    async with (
        aiohttp.ClientSession() as s,
        s.request(
            method, api.rest_url + path, json=body, headers={"Authorization": f"Bearer {token}"}
        ) as r,
    ):
        return r.status, await r.json()


def spec(nodes: int) -> AllocationSpec:
    return AllocationSpec(
        entrypoint="true", tenant="physics", vcluster="hpc", nodes=nodes, walltime_seconds=600
    )


async def test_waldur_lowers_max_nodes_new_work_is_blocked_running_work_finishes(
    api: LocalApi, waldur: FakeWaldur
) -> None:
    running = api.submit(spec(2))
    api.start(running.id, ["n0", "n1"])
    status, body = await waldur.update_tenant(
        api.rest_url, "physics", {"max_nodes": 1, "gpu_hours_budget": 500}, WALDUR_SERVICE
    )
    assert status == 200, body
    assert body["max_nodes"] == 1 and body["gpu_hours_budget"] == 500
    t = api.quorum.state.tenants["physics"]
    assert t.max_nodes == 1 and t.gpu_hours_budget == 500  # committed through the quorum
    # the running allocation is not preempted
    assert api.quorum.state.allocations[running.id].state == AllocationState.RUNNING
    # new work is held to the new hard quota (2 in use + 1 > 1)
    pending = api.submit(spec(1))
    with pytest.raises(QuotaExceeded) as e:
        api.start(pending.id, ["n2"])
    assert "max_nodes" in e.value.message and "limit: 1" in e.value.message
    # the running one ends; Waldur raises the quota again; the pending one may start
    api.set_state(running.id, AllocationState.COMPLETED, exit_code=0)
    status, _ = await waldur.update_tenant(
        api.rest_url, "physics", {"max_nodes": 4}, WALDUR_SERVICE
    )
    assert status == 200
    assert api.start(pending.id, ["n2"]).state in (
        AllocationState.RUNNING,
        AllocationState.STAGING,
    )


async def test_the_service_token_may_change_quotas_only(api: LocalApi) -> None:
    before = api.quorum.state.tenants["physics"]
    for body in (
        {"isolation": "strict"},
        {"max_nodes": 10, "fair_share_target": 0.9},
        {"max_preemption_class": 9},
        {"name": "other", "max_nodes": 1},
    ):
        status, out = await call(api, "PUT", "/api/v1/tenants/physics", WALDUR_SERVICE, body)
        assert status == 403, (body, out)
        assert out["error"]["code"] == "permission_denied"
        assert "may change quotas only" in out["error"]["message"] and out["error"]["hint"]
    assert api.quorum.state.tenants["physics"] == before  # nothing changed
    # bad values are refused and change nothing
    for body in ({}, {"max_nodes": -1}, {"gpu_hours_budget": "lots"}):
        status, out = await call(api, "PUT", "/api/v1/tenants/physics", WALDUR_SERVICE, body)
        assert status == 400, (body, out)
    assert api.quorum.state.tenants["physics"] == before
    # nor anything else of the API
    for method, path, body in (
        ("PATCH", "/api/v1/tenants/physics", {"max_nodes": 1}),
        ("GET", "/api/v1/tenants", None),
        ("GET", "/api/v1/tenants/physics", None),
        ("POST", "/api/v1/tenants", {"name": "x"}),
        ("GET", "/api/v1/allocations", None),
        ("POST", "/api/v1/allocations", {"entrypoint": "true"}),
        ("GET", "/api/v1/nodes", None),
        ("POST", "/api/v1/nodes/n0/drain", {}),
        ("PATCH", "/api/v1/vclusters/hpc", {"backfill_depth": 1}),
    ):
        status, out = await call(api, method, path, WALDUR_SERVICE, body)
        assert status == 403, (method, path, out)
    # an unknown tenant is a clear 404
    status, out = await call(api, "PUT", "/api/v1/tenants/nobody", WALDUR_SERVICE, {"max_nodes": 1})
    assert status == 404 and out["error"]["hint"]


async def test_put_is_the_admins_update_and_no_one_elses(api: LocalApi) -> None:
    status, out = await call(api, "PUT", "/api/v1/tenants/physics", USER, {"max_nodes": 99})
    assert status == 403 and "tenant.quota" in out["error"]["message"]
    status, out = await call(
        api, "PUT", "/api/v1/tenants/physics", ADMIN, {"max_nodes": 7, "fair_share_target": 0.2}
    )
    assert status == 200 and out["max_nodes"] == 7 and out["fair_share_target"] == 0.2
    # no token at all
    async with (
        aiohttp.ClientSession() as s,
        s.put(api.rest_url + "/api/v1/tenants/physics", json={"max_nodes": 1}) as r,
    ):
        assert r.status == 401
    assert api.quorum.state.tenants["physics"].max_nodes == 7


def test_hard_quota_rejection_names_current_requested_and_limit() -> None:
    # the quorum's rule the PUT relies on (spec: Hard Quota Reduction)
    from lattice_quorum.local import LocalQuorum
    from lattice_test_harness import builders as b

    q = LocalQuorum()
    q.apply(c.CreateTenant(tenant=b.tenant("physics", max_nodes=1), now=1.0))
    q.apply(c.CreateVCluster(vcluster=b.vcluster("hpc"), now=1.0))
    q.apply(c.RegisterNode(node_id="n0", now=1.0))
    q.apply(c.RegisterNode(node_id="n1", now=1.0))
    res = q.apply(c.SubmitAllocation(spec=b.spec(tenant="physics", vcluster="hpc", nodes=2)))
    assert res.allocation is not None
    out = q.apply(c.AssignNodes(allocation_id=res.allocation.id, node_ids=["n0", "n1"], now=2.0))
    assert out.error is not None and out.error["code"] == "quota_exceeded"
    assert "(current: 0, requested: 2, limit: 1)" in out.error["message"]
