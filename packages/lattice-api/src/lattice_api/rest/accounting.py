"""REST routes of AccountingService (see lattice_api.ops.accounting):

* ``GET /api/v1/accounts/balance?tenant=&project=``
* ``POST /api/v1/accounts/topup`` ``{tenant, amount}`` (system admins)
* ``POST /api/v1/accounts/transfer`` ``{tenant, project, amount}``
* ``GET /api/v1/accounts/transactions?tenant=&project=&allocation=&kind=&user=&since=&until=&limit=&before_id=``
* ``GET /api/v1/accounts/costs?by=project|user|vcluster|day|tenant&tenant=&project=&since=&until=``
* ``GET /api/v1/accounts/allocations?ids=a,b``: what each (visible) allocation cost
* ``GET|POST /api/v1/admin/prices``
* ``GET /api/v1/admin/accounting/status``, ``POST /api/v1/admin/accounting/reconcile``
  ``{since, until}``
"""

from __future__ import annotations

from aiohttp import web

from lattice_api.http import json_response, read_body, who
from lattice_api.operations import Operations

_TX_FILTERS = ("tenant", "project", "allocation", "kind", "user", "since", "until", "limit")


def add_routes(router: web.UrlDispatcher, ops: Operations) -> None:
    acct = ops.accounting

    async def balance(request: web.Request) -> web.Response:
        q = request.query
        return json_response(
            await acct.balance(who(request), q.get("tenant") or None, q.get("project") or None)
        )

    async def topup(request: web.Request) -> web.Response:
        b = await read_body(request)
        return json_response(
            await acct.topup(who(request), str(b.get("tenant") or ""), b.get("amount"))
        )

    async def transfer(request: web.Request) -> web.Response:
        b = await read_body(request)
        return json_response(
            await acct.transfer(
                who(request),
                str(b.get("tenant") or "") or None,
                str(b.get("project") or ""),
                b.get("amount"),
            )
        )

    async def transactions(request: web.Request) -> web.Response:
        q = request.query
        filters = {k: q[k] for k in _TX_FILTERS if q.get(k)}
        if q.get("before_id"):
            filters["before_id"] = q["before_id"]
        return json_response(await acct.transactions(who(request), **filters))

    async def costs(request: web.Request) -> web.Response:
        q = request.query
        return json_response(
            await acct.costs(
                who(request),
                q.get("by") or "project",
                tenant=q.get("tenant") or None,
                project=q.get("project") or None,
                since=q.get("since") or None,
                until=q.get("until") or None,
            )
        )

    async def allocation_costs(request: web.Request) -> web.Response:
        ids = [i for i in request.query.get("ids", "").split(",") if i.strip()]
        return json_response(await acct.costs_of(who(request), ids))

    async def list_prices(request: web.Request) -> web.Response:
        return json_response(
            await acct.list_prices(who(request), request.query.get("vcluster") or None)
        )

    async def set_price(request: web.Request) -> web.Response:
        return json_response(await acct.set_price(who(request), await read_body(request)))

    async def status(request: web.Request) -> web.Response:
        return json_response(await acct.status(who(request)))

    async def reconcile(request: web.Request) -> web.Response:
        b = await read_body(request)
        return json_response(await acct.reconcile(who(request), b.get("since"), b.get("until")))

    router.add_get("/api/v1/accounts/balance", balance)
    router.add_post("/api/v1/accounts/topup", topup)
    router.add_post("/api/v1/accounts/transfer", transfer)
    router.add_get("/api/v1/accounts/transactions", transactions)
    router.add_get("/api/v1/accounts/costs", costs)
    router.add_get("/api/v1/accounts/allocations", allocation_costs)
    router.add_get("/api/v1/admin/prices", list_prices)
    router.add_post("/api/v1/admin/prices", set_price)
    router.add_get("/api/v1/admin/accounting/status", status)
    router.add_post("/api/v1/admin/accounting/reconcile", reconcile)
