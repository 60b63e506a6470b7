"""AccountingService operations (``proto/lattice/v1/accounting.proto``) and the
reservation gate of the submit paths.

The ledger lives in lattice-accounting; these operations check who may ask (the
permission table first, then :func:`check_tenant` / :func:`check_project` here) and
call its INTERNAL API through :class:`~lattice_api.accounting_client.AccountingClient`.
With ``accounting.enabled: false`` there is no client: the gate does nothing and every
accounting call answers FailedPrecondition.

Who may do what:

* top-ups, prices, status, reconcile: system admins;
* transfers tenant -> project: system admins, and tenant admins of that tenant;
* a tenant's balance, transactions and costs: system admins, operators and read-only
  admins (everything), tenant admins (their tenant);
* a project's balance: also the users of its tenant; users list their own
  transactions; prices are readable by anyone authenticated (to estimate).

The gate (:meth:`AccountingOps.hold`): a submission gets a ``request_id`` if it had
none, its estimate is reserved under it BEFORE the proposal, every allocation it
creates carries the key in the ``accounting.reservation`` tag (the accounting consumer
binds the reservation to their ids), and a failed proposal releases it.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
from lattice_common.errors import (
    FailedPrecondition,
    LatticeError,
    NotFound,
    PermissionDenied,
    ValidationError,
)
from lattice_common.history import HistoryStore
from lattice_common.types import AllocationSpec, LifecycleType
from lattice_quorum import queries
from lattice_quorum.quorum import Quorum

from lattice_api import access
from lattice_api.accounting_client import AccountingClient
from lattice_api.auth import Identity, Role

RESERVATION_TAG = "accounting.reservation"
KEY_PREFIX = "rq-"
_EVERYTHING = frozenset({Role.SYSTEM_ADMIN, Role.OPERATOR, Role.READ_ONLY})
COST_BREAKDOWNS = ("tenant", "project", "user", "vcluster", "day")


def check_tenant(who: Identity, tenant: str) -> None:
    """A tenant's books: the roles that read everything, or its own tenant admin."""
    if who.role in _EVERYTHING:
        return
    if who.role == Role.TENANT_ADMIN and who.tenant == tenant:
        return
    raise PermissionDenied(
        f"{who.user} ({who.role.value}) may not read the accounts of tenant {tenant}",
        hint="Tenant admins read their own tenant's accounts; ask a system admin otherwise.",
    )


def check_project(who: Identity, tenant: str) -> None:
    """A project's balance: also every user of its tenant."""
    if who.role in _EVERYTHING or (who.tenant and who.tenant == tenant):
        return
    check_tenant(who, tenant)


def _line(spec: AllocationSpec, count: int = 1) -> dict[str, Any]:
    bounded = spec.lifecycle == LifecycleType.BOUNDED and spec.walltime_seconds > 0
    return {
        "vcluster": spec.vcluster,
        "nodes": max(spec.nodes, 1),
        "walltime_seconds": spec.walltime_seconds if bounded else 0,
        "count": count,
        # GPU-hours are estimated from what the spec asks for (charged from what the
        # nodes it got have)
        "gpus_per_node": spec.constraints.gpu_count,
        "gpu_type": spec.constraints.gpu_type,
    }


class Held:
    """The specs to propose (tagged with the reservation key when one was made)."""

    def __init__(self, specs: list[AllocationSpec], key: str | None, request_id: str) -> None:
        self.specs = specs
        self.key = key
        self.request_id = request_id


class AccountingOps:
    def __init__(self, quorum: Quorum, client: AccountingClient | None = None) -> None:
        self.quorum = quorum
        self.client = client
        # the history store (lattice_common.history): the cost column of allocations
        # that left the quorum's state; set by lattice-server (None: none)
        self.history: HistoryStore | None = None

    @property
    def enabled(self) -> bool:
        return self.client is not None

    def _client(self) -> AccountingClient:
        if self.client is None:
            raise FailedPrecondition(
                "accounting is not enabled on this cluster",
                hint="Set accounting.enabled: true and run lattice-accounting "
                "(`lattice dev up --accounting` for a local cluster).",
            )
        return self.client

    # --- the reservation gate --------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def hold(
        self,
        specs: Sequence[AllocationSpec],
        *,
        request_id: str = "",
        counts: Sequence[int] | None = None,
        set_request_id: bool = True,
    ) -> AsyncIterator[Held]:
        """Reserve the estimate of a submission creating ``specs`` (``counts[i]``
        allocations like ``specs[i]``) before the caller proposes it; release it when the
        body raises. ``set_request_id``: write the (generated) request id into the
        specs (single submissions; DAGs carry it on the command)."""
        specs = list(specs)
        if self.client is None or not specs:
            yield Held(specs, None, request_id)
            return
        rid = request_id or specs[0].request_id or f"acct-{uuid.uuid4().hex}"
        if set_request_id:
            specs = [msgspec.structs.replace(s, request_id=rid) for s in specs]
        first = specs[0]
        counts = list(counts) if counts is not None else [1] * len(specs)
        reply = await self.client.call(
            "POST",
            "/v1/reservations",
            body={
                "request_id": rid,
                "tenant": first.tenant,
                "project": first.project or "default",
                "user": first.user,
                "lines": [_line(s, n) for s, n in zip(specs, counts, strict=True)],
            },
        )
        if not reply.get("gated"):
            yield Held(specs, None, rid)
            return
        key = str(reply["key"])
        specs = [msgspec.structs.replace(s, tags={**s.tags, RESERVATION_TAG: key}) for s in specs]
        try:
            yield Held(specs, key, rid)
        except BaseException:
            # a retried request_id found the first attempt's reservation: not ours to free
            if not reply.get("existing"):
                with contextlib.suppress(LatticeError):
                    await self.client.call("DELETE", f"/v1/reservations/{key}")
            raise

    # --- balances and money ------------------------------------------------------------------

    def _known_tenant(self, tenant: str) -> str:
        tenant = (tenant or "").strip()
        if not tenant:
            raise ValidationError("no tenant given", hint="Give --tenant NAME.")
        names, _ = self.quorum.read(queries.tenant_and_vcluster_names)
        if tenant not in names:
            raise NotFound(
                f"tenant {tenant} not found",
                details={"Tenant": tenant},
                hint="`lattice admin tenant list` shows the tenants.",
            )
        return tenant

    async def balance(
        self, who: Identity, tenant: str | None = None, project: str | None = None
    ) -> dict[str, Any]:
        t = self._known_tenant(tenant or who.tenant)
        if project:
            check_project(who, t)
        else:
            check_tenant(who, t)
        return await self._client().call(
            "GET", "/v1/balance", params={"tenant": t, "project": project}
        )

    async def topup(self, who: Identity, tenant: str, amount: Any) -> dict[str, Any]:
        t = self._known_tenant(tenant)
        return await self._client().call(
            "POST", "/v1/topup", body={"tenant": t, "amount": _amount(amount), "who": who.user}
        )

    async def transfer(
        self, who: Identity, tenant: str | None, project: str, amount: Any
    ) -> dict[str, Any]:
        t = self._known_tenant(tenant or who.tenant)
        if who.role != Role.SYSTEM_ADMIN and not (
            who.role == Role.TENANT_ADMIN and who.tenant == t
        ):
            raise PermissionDenied(
                f"{who.user} ({who.role.value}) may not move funds of tenant {t}",
                hint="Tenant admins transfer their own tenant's funds to its projects.",
            )
        if not project:
            raise ValidationError("no project given", hint="Give --project NAME.")
        return await self._client().call(
            "POST",
            "/v1/transfer",
            body={"tenant": t, "project": project, "amount": _amount(amount), "who": who.user},
        )

    async def transactions(self, who: Identity, **filters: Any) -> dict[str, Any]:
        tenant = filters.get("tenant") or None
        if who.role in _EVERYTHING:
            pass
        elif who.role == Role.TENANT_ADMIN:
            tenant = tenant or who.tenant
            check_tenant(who, tenant)
        else:  # users: their own
            filters["user"] = who.user
            tenant = who.tenant or tenant
        filters["tenant"] = tenant
        return await self._client().call("GET", "/v1/transactions", params=filters)

    async def costs(
        self,
        who: Identity,
        by: str = "project",
        *,
        tenant: str | None = None,
        project: str | None = None,
        since: str | None = None,
        until: str | None = None,
    ) -> dict[str, Any]:
        if by not in COST_BREAKDOWNS:
            raise ValidationError(
                f"unknown cost breakdown {by!r}",
                details={"By": by, "Known": ", ".join(COST_BREAKDOWNS)},
                hint="Use --by project, user, vcluster or day (or tenant).",
            )
        if who.role not in _EVERYTHING:
            tenant = tenant or who.tenant
            check_tenant(who, tenant)
        return await self._client().call(
            "GET",
            "/v1/costs",
            params={"by": by, "tenant": tenant, "project": project, "since": since, "until": until},
        )

    async def allocation_costs(self, ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """What each (visible) allocation cost; {} when accounting is off or down."""
        if self.client is None or not ids:
            return {}
        try:
            reply = await self.client.call(
                "GET", "/v1/allocations/costs", params={"ids": ",".join(ids)}
            )
        except LatticeError:
            return {}
        return reply.get("costs") or {}

    async def costs_of(self, who: Identity, ids: Sequence[str]) -> dict[str, Any]:
        """``lattice history``'s cost column: what each of ``ids`` the caller may see
        cost (``{}`` when accounting is off or unreachable: history still shows)."""
        from lattice_api.ops.base import visible_allocation

        seen, moved = [], []
        for i in list(dict.fromkeys(ids))[:1000]:
            try:
                visible_allocation(self.quorum, who, i)
                seen.append(i)
            except NotFound:
                moved.append(i)  # perhaps in the history store now
            except LatticeError:
                continue
        if moved and self.history is not None:
            stored = await self.history.get_many(moved)
            seen += [i for i in moved if i in stored and access.can_read(who, stored[i])]
        return {"enabled": self.enabled, "costs": await self.allocation_costs(seen)}

    # --- prices and administration -------------------------------------------------------------

    async def set_price(self, who: Identity, body: dict[str, Any]) -> dict[str, Any]:
        fields = (
            "vcluster", "resource", "rate", "valid_from", "valid_until", "gpu_type", "tenant",
            "multiplier", "fixed_cost",
        )  # fmt: skip
        data = {k: body.get(k) for k in fields if body.get(k) not in (None, "")}
        for k in ("rate", "multiplier", "fixed_cost"):
            if k in data:
                data[k] = _amount(data[k], k, allow_zero=True)
        if data.get("tenant"):
            self._known_tenant(str(data["tenant"]))
        return await self._client().call("POST", "/v1/prices", body={**data, "who": who.user})

    async def list_prices(self, who: Identity, vcluster: str | None = None) -> dict[str, Any]:
        return await self._client().call("GET", "/v1/prices", params={"vcluster": vcluster})

    async def status(self, who: Identity) -> dict[str, Any]:
        return await self._client().call("GET", "/v1/status")

    async def reconcile(self, who: Identity, since: Any, until: Any) -> dict[str, Any]:
        return await self._client().call(
            "POST", "/v1/reconcile", body={"since": since, "until": until}
        )


def _amount(value: Any, what: str = "amount", *, allow_zero: bool = False) -> str:
    """An amount as the decimal text the ledger parses: refused here when it is not a
    number (floats from JSON are taken by their shortest text: 12.5 -> "12.5")."""
    from decimal import Decimal, InvalidOperation

    if value is None or isinstance(value, bool):
        raise ValidationError(f"{what} is missing", hint=f"Give {what} as a decimal, e.g. 12.50.")
    text = repr(value) if isinstance(value, float) else str(value).strip()
    try:
        d = Decimal(text)
    except InvalidOperation:
        raise ValidationError(
            f"{what} is not a number",
            details={what: text},
            hint=f"Give {what} as a decimal, e.g. 12.50.",
        ) from None
    if not d.is_finite() or d < 0 or (d == 0 and not allow_zero):
        raise ValidationError(
            f"{what} must be a positive decimal number",
            details={what: text},
            hint=f"Give {what} greater than 0, e.g. 12.50.",
        )
    return text


__all__ = ["RESERVATION_TAG", "AccountingOps", "Held", "check_project", "check_tenant"]
