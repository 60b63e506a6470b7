"""Prices, the submission estimate and the charge of an interval (pure functions).

A price is keyed by (vCluster, resource, GPU type, tenant): ``node_hour`` (per node and
hour), ``gpu_hour`` (per GPU and hour, by GPU type) and ``allocation`` (a fixed cost per
allocation). Every price has a ``rate``, a ``multiplier`` (the platform's margin) and a
``fixed_cost`` charged once per allocation, and is valid in ``[valid_from,
valid_until)`` (``None``: open-ended). A per-tenant price overrides the general one
(``tenant=""``). Two prices for the same key may not overlap in time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal

from lattice_common.errors import AlreadyExists, ValidationError

from lattice_accounting.money import ZERO, fmt, quantize

NODE_HOUR = "node_hour"
GPU_HOUR = "gpu_hour"
ALLOCATION = "allocation"
RESOURCES = (NODE_HOUR, GPU_HOUR, ALLOCATION)
HOUR = Decimal(3600)


@dataclass(frozen=True, slots=True)
class Price:
    vcluster: str
    resource: str
    rate: Decimal
    valid_from: datetime
    valid_until: datetime | None = None
    gpu_type: str = ""
    tenant: str = ""
    multiplier: Decimal = Decimal(1)
    fixed_cost: Decimal = ZERO
    id: int | None = None

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.vcluster, self.resource, self.gpu_type, self.tenant)

    @property
    def effective_rate(self) -> Decimal:
        return self.rate * self.multiplier

    def valid_at(self, at: datetime) -> bool:
        return self.valid_from <= at and (self.valid_until is None or at < self.valid_until)

    def describe(self) -> str:
        until = self.valid_until.isoformat() if self.valid_until else "open-ended"
        who = f" for tenant {self.tenant}" if self.tenant else ""
        gpu = f" ({self.gpu_type})" if self.gpu_type else ""
        ident = f"#{self.id} " if self.id is not None else ""
        return (
            f"price {ident}{self.resource}{gpu} on vCluster {self.vcluster}{who}, "
            f"{self.valid_from.isoformat()} to {until}"
        )


def check_price(p: Price) -> None:
    if p.resource not in RESOURCES:
        raise ValidationError(
            "unknown price resource",
            details={"Resource": p.resource, "Known": ", ".join(RESOURCES)},
            hint="Use node_hour, gpu_hour (with a GPU type) or allocation.",
        )
    if p.resource == GPU_HOUR and not p.gpu_type:
        raise ValidationError(
            "a gpu_hour price needs a GPU type",
            hint="Give the GPU type the price applies to, e.g. gpu_type='a100'.",
        )
    for name in ("rate", "multiplier", "fixed_cost"):
        v = getattr(p, name)
        if not isinstance(v, Decimal) or not v.is_finite() or v < 0:
            raise ValidationError(
                f"price {name} must be a non-negative decimal",
                details={name: str(v)},
                hint="Prices are Decimal amounts >= 0.",
            )
    if p.valid_until is not None and p.valid_until <= p.valid_from:
        raise ValidationError(
            "price validity window is empty",
            details={
                "Valid from": p.valid_from.isoformat(),
                "Valid until": p.valid_until.isoformat(),
            },
            hint="valid_until must be after valid_from (or omitted for an open-ended price).",
        )


def overlaps(a: Price, b: Price) -> bool:
    if a.key != b.key:
        return False
    a_end_after_b_start = a.valid_until is None or a.valid_until > b.valid_from
    b_end_after_a_start = b.valid_until is None or b.valid_until > a.valid_from
    return a_end_after_b_start and b_end_after_a_start


def check_no_overlap(new: Price, existing: Iterable[Price]) -> None:
    """Refuse a price whose validity window overlaps one for the same key."""
    for old in existing:
        if overlaps(new, old):
            raise AlreadyExists(
                f"the new price overlaps the existing {old.describe()}",
                details={"Existing price": old.id, "New": new.describe()},
                hint="End the existing price first (set its valid_until to the new "
                "price's valid_from) or start the new one when it ends.",
            )


def price_for(
    prices: Iterable[Price],
    *,
    vcluster: str,
    resource: str,
    at: datetime,
    tenant: str = "",
    gpu_type: str = "",
) -> Price | None:
    """The price valid at ``at``: the tenant's own first, else the general one."""
    general = None
    for p in prices:
        if (p.vcluster, p.resource, p.gpu_type) != (vcluster, resource, gpu_type):
            continue
        if not p.valid_at(at):
            continue
        if tenant and p.tenant == tenant:
            return p
        if p.tenant == "":
            general = p
    return general


@dataclass(frozen=True, slots=True)
class Facts:
    """What the estimate needs from a submission."""

    vcluster: str
    tenant: str
    nodes: int
    walltime_s: float | None  # None: ranged/unbounded (a service, an open session)
    gpus_per_node: int = 0
    gpu_type: str = ""


@dataclass(frozen=True, slots=True)
class Estimate:
    amount: Decimal
    explanation: str
    price_ids: tuple[int, ...] = field(default_factory=tuple)


def _hours(seconds: float | Decimal) -> Decimal:
    return Decimal(str(seconds)) / HOUR


def _fmt_hours(h: Decimal) -> str:
    h = h.normalize()
    return f"{h:f}h" if h == h.to_integral_value() else f"{quantize(h).normalize():f}h"


def _lines(
    *,
    prices: Sequence[Price],
    vcluster: str,
    tenant: str,
    nodes: int,
    gpus: int,
    gpu_type: str,
    hours: Decimal,
    at: datetime,
    include_fixed: bool,
) -> tuple[Decimal, list[str], list[int]]:
    total = ZERO
    parts: list[str] = []
    ids: list[int] = []
    node = price_for(prices, vcluster=vcluster, resource=NODE_HOUR, at=at, tenant=tenant)
    gpu = (
        price_for(
            prices, vcluster=vcluster, resource=GPU_HOUR, at=at, tenant=tenant, gpu_type=gpu_type
        )
        if gpus and gpu_type
        else None
    )
    alloc = price_for(prices, vcluster=vcluster, resource=ALLOCATION, at=at, tenant=tenant)
    for p, count, unit in ((node, nodes, "node"), (gpu, gpus, "gpu")):
        if p is None or not count:
            continue
        if p.id is not None:
            ids.append(p.id)
        total += count * hours * p.effective_rate
        label = f"{unit}s" if count != 1 else unit
        if unit == "gpu" and gpu_type:
            label += f" ({gpu_type})"
        parts.append(f"{count} {label} x {_fmt_hours(hours)} x {fmt(p.effective_rate)}/{unit}-hour")
        if include_fixed and p.fixed_cost:
            total += p.fixed_cost
            parts.append(f"{fmt(p.fixed_cost)} fixed ({unit})")
    if alloc is not None and include_fixed:
        if alloc.id is not None:
            ids.append(alloc.id)
        fixed = alloc.rate * alloc.multiplier + alloc.fixed_cost
        if fixed:
            total += fixed
            parts.append(f"{fmt(fixed)} per allocation")
    return quantize(total), parts, ids


def estimate(
    facts: Facts, prices: Sequence[Price], at: datetime, *, charging_period_s: float = 3600.0
) -> Estimate:
    """The cost reserved at submission: walltime x nodes (and GPUs) x rates, plus fixed
    costs. A ranged or unbounded allocation reserves one charging period ahead."""
    hours = _hours(facts.walltime_s if facts.walltime_s is not None else charging_period_s)
    total, parts, ids = _lines(
        prices=prices,
        vcluster=facts.vcluster,
        tenant=facts.tenant,
        nodes=facts.nodes,
        gpus=facts.nodes * facts.gpus_per_node,
        gpu_type=facts.gpu_type,
        hours=hours,
        at=at,
        include_fixed=True,
    )
    if not parts:
        text = f"no price for vCluster {facts.vcluster}: 0.00"
    else:
        text = " + ".join(parts) + f" = {fmt(total)}"
        if facts.walltime_s is None:
            text += " (one charging period ahead: no walltime)"
    return Estimate(total, text, tuple(ids))


def charge_for(
    interval: tuple[datetime, datetime],
    nodes: int,
    gpus: int,
    prices: Sequence[Price],
    *,
    vcluster: str,
    tenant: str = "",
    gpu_type: str = "",
    include_fixed: bool = False,
) -> Decimal:
    """The cost of running ``nodes`` nodes and ``gpus`` GPUs over ``interval``, at the
    prices valid when it began; the fixed costs only when ``include_fixed`` (the first
    charge of an allocation)."""
    start, end = interval
    if end <= start:
        return ZERO
    hours = _hours(Decimal((end - start) / timedelta(microseconds=1)) / 1_000_000)
    total, _, _ = _lines(
        prices=prices,
        vcluster=vcluster,
        tenant=tenant,
        nodes=nodes,
        gpus=gpus,
        gpu_type=gpu_type,
        hours=hours,
        at=start,
        include_fixed=include_fixed,
    )
    return total
