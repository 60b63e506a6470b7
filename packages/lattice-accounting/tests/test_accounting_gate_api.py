"""The reservation gate on every submit path, through the real API servers (REST and
gRPC over a LocalQuorum) and the real accounting service (its internal HTTP API, its
consumer following the quorum's stream, a SQLite ledger), in one process.

* a task group, a DAG and a session reserve their whole estimate before they are
  stored, and the consumer splits it over the allocations they made;
* an underfunded task group is refused with the numbers and nothing is stored;
* a wrong service token is refused by the internal API; the service gone makes
  submissions fail with 503 and a hint, and nothing is stored;
* a tenant without an account is not gated.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from lattice_accounting.api import build_app
from lattice_accounting.binding import ServiceLedger
from lattice_accounting.gate import RESERVATION_TAG
from lattice_accounting.prices import Price
from lattice_accounting.service import AccountingService
from lattice_api.settings import ApiSettings
from lattice_cli.devcluster import free_port
from lattice_common.watch import decode_delta
from lattice_test_harness.local_api import serve_local_api

pytestmark = pytest.mark.timeout(60)

TOKEN = "s3cret-accounting-token"


class LocalLink:
    """The service's view of a LocalQuorum: its watch stream and proposals."""

    def __init__(self, quorum: Any) -> None:
        self.q = quorum

    async def watch(self) -> AsyncIterator[Any]:
        sub = self.q.subscribe()
        try:
            while True:
                raw = await sub.get()
                yield decode_delta(self.q.snapshot_delta() if raw is None else raw)
        finally:
            self.q.unsubscribe(sub)

    async def propose(self, cmd: Any) -> Any:
        return await self.q.propose(cmd)


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    ledger = await ServiceLedger.open(f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}")
    await ledger.add_price(
        Price("batch", "node_hour", Decimal("2.00"), datetime.now(UTC) - timedelta(days=1))
    )
    port = free_port()
    settings = ApiSettings(
        accounting_url=f"http://127.0.0.1:{port}", accounting_token=TOKEN, accounting_timeout=2
    )
    async with serve_local_api(settings=settings) as api:
        api.add_tenant("physics")
        api.add_tenant("bio")
        api.add_vcluster("batch")
        for n in ("n1", "n2"):
            api.add_node(n)
        svc = AccountingService(ledger, LocalLink(api.quorum), charge_interval=3600)
        runner = web.AppRunner(build_app(svc, TOKEN))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        follow = asyncio.create_task(svc.follow(retry=0.1))
        async with aiohttp.ClientSession(headers={"x-lattice-user": "alice"}) as http:
            yield {"api": api, "svc": svc, "ledger": ledger, "http": http, "runner": runner}
        follow.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follow
        await runner.cleanup()
    await ledger.close()


async def call(w: dict[str, Any], method: str, path: str, body: Any = None) -> tuple[int, Any]:
    async with w["http"].request(method, w["api"].rest_url + path, json=body) as r:
        return r.status, await r.json()


async def fund(w: dict[str, Any], amount: str) -> None:
    await call(w, "POST", "/api/v1/accounts/topup", {"tenant": "physics", "amount": amount})
    await call(
        w, "POST", "/api/v1/accounts/transfer",
        {"tenant": "physics", "project": "default", "amount": amount},
    )  # fmt: skip


async def bound(w: dict[str, Any], ids: list[str]) -> list[Decimal]:
    async def all_bound() -> list[Any]:
        while True:
            got = [await w["ledger"].reservation(i) for i in ids]
            if all(g is not None for g in got):
                return got
            await asyncio.sleep(0.05)

    got = await asyncio.wait_for(all_bound(), 10)
    return [g.held for g in got]


JOB = {"tenant": "physics", "vcluster": "batch", "walltime": "1h", "entrypoint": "x"}


async def test_task_groups_dags_and_sessions_reserve_first(world: dict[str, Any]) -> None:
    w = world
    await fund(w, "100")
    status, tg = await call(w, "POST", "/api/v1/allocations", {**JOB, "task_group": "0-2"})
    assert status in (200, 201), tg
    ids = tg["allocation_ids"]
    tasks = [w["api"].quorum.state.allocations[i] for i in ids]
    assert all(t.spec.tags[RESERVATION_TAG].startswith("rq-") for t in tasks)
    assert await bound(w, ids) == [Decimal(2)] * 3  # 3 tasks x 1 node x 1h x 2.00
    dag = {
        "name": "d", "tenant": "physics", "vcluster": "batch",
        "allocations": [
            {"id": "a", "entrypoint": "x", "walltime": "1h", "nodes": 2},
            {"id": "b", "entrypoint": "x", "walltime": "30m",
             "depends_on": [{"ref": "a", "condition": "success"}]},
        ],
    }  # fmt: skip
    status, got = await call(w, "POST", "/api/v1/dags", dag)
    assert status in (200, 201), got
    held = await bound(w, got["allocation_ids"])
    assert sorted(held) == [Decimal(1), Decimal(4)]  # split by each member's estimate
    status, sess = await call(
        w, "POST", "/api/v1/sessions", {"tenant": "physics", "vcluster": "batch", "walltime": "1h"}
    )
    assert status in (200, 201), sess
    b = await w["ledger"].balance("physics/default")
    assert b.reserved == Decimal(6 + 5 + 2) and b.available == Decimal(100 - 13)
    assert await w["ledger"].verify() == []


async def test_an_underfunded_task_group_is_refused_and_nothing_stored(
    world: dict[str, Any],
) -> None:
    w = world
    await fund(w, "5")
    before = len(w["api"].quorum.state.allocations)
    status, err = await call(w, "POST", "/api/v1/allocations", {**JOB, "task_group": "0-2"})
    assert status == 412, err
    assert err["error"]["message"] == (
        'allocation rejected: project "physics/default" has 5.00 available, the estimate is '
        "6.00 (3 allocations x 1 node x 1h x 2.00/node-hour)"
    )
    assert "transfer" in err["error"]["hint"]
    assert len(w["api"].quorum.state.allocations) == before
    b = await w["ledger"].balance("physics/default")
    assert b.available == Decimal(5) and b.reserved == 0


async def test_a_tenant_without_an_account_is_not_gated(world: dict[str, Any]) -> None:
    w = world
    status, a = await call(w, "POST", "/api/v1/allocations", {**JOB, "tenant": "bio"})
    assert status in (200, 201), a
    assert RESERVATION_TAG not in a["spec"]["tags"]


async def test_the_internal_api_needs_the_token_and_a_dead_service_refuses_submits(
    world: dict[str, Any],
) -> None:
    w = world
    url = w["svc"] and f"http://127.0.0.1:{w['runner'].addresses[0][1]}/v1/status"
    async with aiohttp.ClientSession() as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            async with s.get(url, headers=headers) as r:
                assert r.status == 401
                assert "service token" in (await r.json())["error"]["message"]
        async with s.get(url, headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            assert r.status == 200
    await fund(w, "10")
    await w["runner"].cleanup()  # the service goes away
    before = len(w["api"].quorum.state.allocations)
    status, err = await call(w, "POST", "/api/v1/allocations", JOB)
    assert status == 503, err
    assert err["error"]["message"] == "the accounting service is unreachable"
    assert "lattice-accounting" in err["error"]["hint"]
    assert len(w["api"].quorum.state.allocations) == before
