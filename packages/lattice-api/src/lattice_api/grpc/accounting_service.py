"""gRPC adapter of AccountingService (lattice_api.ops.accounting): money as decimal
text, times as ISO 8601 text; the operations' errors map to gRPC statuses as
everywhere (their hint intact)."""

from __future__ import annotations

import json
from typing import Any

from lattice_common.proto.lattice import v1

from lattice_api.grpc.context import who
from lattice_api.ops.accounting import AccountingOps


def _balance(d: dict[str, Any]) -> v1.Balance:
    return v1.Balance(
        account=str(d.get("account") or ""),
        tenant=str(d.get("tenant") or ""),
        project=str(d.get("project") or ""),
        available=str(d.get("available") or "0.00"),
        reserved=str(d.get("reserved") or "0.00"),
        spent=str(d.get("spent") or "0.00"),
        allocated=str(d.get("allocated") or "0.00"),
    )


def _price(d: dict[str, Any]) -> v1.Price:
    return v1.Price(
        id=int(d.get("id") or 0),
        vcluster=d["vcluster"],
        resource=d["resource"],
        gpu_type=d.get("gpu_type") or "",
        tenant=d.get("tenant") or "",
        rate=d["rate"],
        multiplier=d["multiplier"],
        fixed_cost=d["fixed_cost"],
        valid_from=d["valid_from"],
        valid_until=d.get("valid_until") or "",
    )


class AccountingService(v1.AccountingServiceBase):
    def __init__(self, ops: AccountingOps) -> None:
        self.ops = ops

    async def get_balance(self, message: v1.GetBalanceRequest) -> v1.Balance:
        d = await self.ops.balance(who(), message.tenant or None, message.project or None)
        return _balance(d)

    async def top_up(self, message: v1.TopUpRequest) -> v1.Balance:
        d = await self.ops.topup(who(), message.tenant, message.amount)
        return _balance({**d, "account": f"tenant:{message.tenant}", "tenant": message.tenant})

    async def transfer(self, message: v1.TransferRequest) -> v1.Balance:
        d = await self.ops.transfer(who(), message.tenant or None, message.project, message.amount)
        return _balance({**d, "project": message.project, "tenant": message.tenant})

    async def list_transactions(
        self, message: v1.ListTransactionsRequest
    ) -> v1.ListTransactionsResponse:
        filters = {
            "tenant": message.tenant,
            "project": message.project,
            "allocation": message.allocation_id,
            "kind": message.kind,
            "user": message.user,
            "since": message.since,
            "until": message.until,
            "limit": message.limit or None,
            "before_id": message.before_id or None,
        }
        d = await self.ops.transactions(who(), **{k: v for k, v in filters.items() if v})
        return v1.ListTransactionsResponse(
            transactions=[
                v1.Transaction(
                    id=t["id"],
                    at=t["at"],
                    kind=t["kind"],
                    amount=t["amount"],
                    allocation_id=t.get("allocation_id") or "",
                    tenant=t.get("tenant") or "",
                    project=t.get("project") or "",
                    user=t.get("user") or "",
                    vcluster=t.get("vcluster") or "",
                    who=t.get("who") or "",
                    legs=[
                        v1.TransactionLeg(account=g["account"], amount=g["amount"])
                        for g in t["legs"]
                    ],
                    properties_json=json.dumps(t.get("properties") or {}),
                )
                for t in d.get("transactions", [])
            ],
            next_before_id=int(d.get("next_before_id") or 0),
        )

    async def get_costs(self, message: v1.GetCostsRequest) -> v1.GetCostsResponse:
        d = await self.ops.costs(
            who(),
            message.by or "project",
            tenant=message.tenant or None,
            project=message.project or None,
            since=message.since or None,
            until=message.until or None,
        )
        return v1.GetCostsResponse(
            by=d.get("by", message.by),
            costs=[v1.CostLine(key=c["key"], amount=c["amount"]) for c in d.get("costs", [])],
        )

    async def set_price(self, message: v1.SetPriceRequest) -> v1.Price:
        p = message.price or v1.Price()
        body = {
            "vcluster": p.vcluster,
            "resource": p.resource,
            "rate": p.rate or None,
            "multiplier": p.multiplier or None,
            "fixed_cost": p.fixed_cost or None,
            "gpu_type": p.gpu_type,
            "tenant": p.tenant,
            "valid_from": p.valid_from,
            "valid_until": p.valid_until,
        }
        return _price(await self.ops.set_price(who(), body))

    async def list_prices(self, message: v1.ListPricesRequest) -> v1.ListPricesResponse:
        d = await self.ops.list_prices(who(), message.vcluster or None)
        return v1.ListPricesResponse(prices=[_price(p) for p in d.get("prices", [])])

    async def get_accounting_status(
        self, message: v1.GetAccountingStatusRequest
    ) -> v1.AccountingStatus:
        return v1.AccountingStatus(status_json=json.dumps(await self.ops.status(who())))

    async def reconcile(self, message: v1.ReconcileRequest) -> v1.ReconcileResponse:
        d = await self.ops.reconcile(who(), message.since, message.until)
        return v1.ReconcileResponse(result_json=json.dumps(d))
