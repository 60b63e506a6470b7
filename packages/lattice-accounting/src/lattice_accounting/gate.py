"""The reservation gate: a submission's estimate reserved before it is proposed.

lattice-server calls ``POST /v1/reservations`` (:mod:`lattice_accounting.api`) with the
estimate inputs and the submission's ``request_id`` (the reservation key) BEFORE it
proposes the submission to the quorum. Insufficient funds refuse the submission with the
numbers (:func:`rejection`); a tenant without an account in the ledger is not gated.
The consumer later binds the key to the allocation id(s) it produced.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from lattice_common.errors import FailedPrecondition, ValidationError

from lattice_accounting.money import fmt
from lattice_accounting.prices import Estimate, Facts, Price, estimate

# the spec tag that carries the reservation key to every allocation of a submission
# (task-group members and DAG members lose ``spec.request_id``; tags stay)
RESERVATION_TAG = "accounting.reservation"
KEY_PREFIX = "rq-"


def reservation_key(request_id: str) -> str:
    """The ledger key of a submission's reservation: ``rq-<request_id>`` (hashed when
    too long for the 64-character key)."""
    if not request_id:
        raise ValidationError("a reserved submission needs a request_id")
    key = KEY_PREFIX + request_id
    if len(key) <= 64:
        return key
    return KEY_PREFIX + hashlib.sha256(request_id.encode()).hexdigest()[:48]


def is_request_key(key: str) -> bool:
    return key.startswith(KEY_PREFIX)


@dataclass(frozen=True, slots=True)
class Line:
    """One kind of allocation in a submission: ``count`` alike (a task group's tasks)."""

    vcluster: str
    nodes: int
    walltime_seconds: float  # 0 = none (ranged/unbounded: one charging period ahead)
    count: int = 1
    gpus_per_node: int = 0
    gpu_type: str = ""

    def facts(self, tenant: str) -> Facts:
        return Facts(
            vcluster=self.vcluster,
            tenant=tenant,
            nodes=self.nodes,
            walltime_s=self.walltime_seconds if self.walltime_seconds > 0 else None,
            gpus_per_node=self.gpus_per_node,
            gpu_type=self.gpu_type,
        )


@dataclass(frozen=True, slots=True)
class GateRequest:
    """A submission's estimate inputs: one line per kind of allocation it creates."""

    request_id: str
    tenant: str
    project: str
    lines: tuple[Line, ...]
    user: str = ""

    @property
    def vcluster(self) -> str:
        return self.lines[0].vcluster if self.lines else ""

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GateRequest:
        try:
            raw = d.get("lines") or [d]
            lines = tuple(
                Line(
                    vcluster=str(x["vcluster"]),
                    nodes=int(x.get("nodes") or 1),
                    walltime_seconds=float(x.get("walltime_seconds") or 0),
                    count=int(x.get("count") or 1),
                    gpus_per_node=int(x.get("gpus_per_node") or 0),
                    gpu_type=str(x.get("gpu_type") or ""),
                )
                for x in raw
            )
            req = cls(
                request_id=str(d["request_id"]),
                tenant=str(d["tenant"]),
                project=str(d.get("project") or "default"),
                lines=lines,
                user=str(d.get("user") or ""),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValidationError(
                f"malformed reservation request: {e}",
                hint="Send request_id, tenant, project and lines of vcluster, nodes, "
                "walltime_seconds, count.",
            ) from None
        if not lines or any(x.nodes < 1 or x.count < 1 for x in lines):
            raise ValidationError("a reservation needs at least one node and one allocation")
        return req


def estimate_for(
    req: GateRequest, prices: list[Price], at: datetime, *, ahead_s: float
) -> Estimate:
    """The whole submission's estimate: each line's, times its count, summed; the
    explanation reads ``3 allocations x 1 node x 1h x 2.00/node-hour = 6.00``."""
    parts: list[tuple[Decimal, str, tuple[int, ...]]] = []
    for line in req.lines:
        one = estimate(line.facts(req.tenant), prices, at, charging_period_s=ahead_s)
        text = terms(one.explanation)
        if line.count > 1:
            text = f"{line.count} allocations x " + (f"({text})" if " + " in text else text)
        parts.append((one.amount * line.count, text, one.price_ids))
    total = sum((p[0] for p in parts), Decimal(0))
    if len(parts) == 1:
        text = parts[0][1]
    else:
        text = " + ".join(f"({p[1]})" if " + " in p[1] else p[1] for p in parts)
    if len(parts) == 1 and req.lines[0].count == 1:
        return estimate(req.lines[0].facts(req.tenant), prices, at, charging_period_s=ahead_s)
    return Estimate(total, f"{text} = {fmt(total)}", tuple(i for p in parts for i in p[2]))


def terms(explanation: str) -> str:
    """``4 nodes x 2h x 5.00/node-hour = 40.00`` -> ``4 nodes x 2h x 5.00/node-hour``."""
    head, sep, _ = explanation.rpartition(" = ")
    return head if sep else explanation


def rejection(project: str, available: Decimal, est: Estimate) -> FailedPrecondition:
    """The refusal a user sees (spec: the accounting issue's wording)."""
    return FailedPrecondition(
        f'allocation rejected: project "{project}" has {fmt(available)} available, '
        f"the estimate is {fmt(est.amount)} ({terms(est.explanation)})",
        details={"Project": project, "Available": fmt(available), "Estimate": fmt(est.amount)},
        hint=f"Top up the tenant (`lattice account topup`), transfer funds to the project "
        f"(`lattice account transfer --project {project.partition('/')[2] or 'default'}`), "
        "or ask for fewer nodes or a shorter walltime.",
    )


__all__ = [
    "KEY_PREFIX",
    "RESERVATION_TAG",
    "GateRequest",
    "Line",
    "estimate_for",
    "is_request_key",
    "rejection",
    "reservation_key",
    "terms",
]
