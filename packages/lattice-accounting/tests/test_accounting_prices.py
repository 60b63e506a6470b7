"""Prices: the submission estimate and its explanation, interval charges, tenant
overrides, and the refusal of overlapping validity windows (stored on both backends)."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal as D

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lattice_accounting.ledger import Ledger
from lattice_accounting.prices import (
    ALLOCATION,
    GPU_HOUR,
    NODE_HOUR,
    Facts,
    Price,
    charge_for,
    check_no_overlap,
    estimate,
    overlaps,
)
from lattice_common.errors import AlreadyExists, ValidationError
from ledger_backends import T0, db_url, ledger, row_counts  # noqa: F401 (fixtures)

PRICES = [
    Price("gpu", NODE_HOUR, D("5.00"), T0, id=1),
    Price("gpu", GPU_HOUR, D("2.00"), T0, gpu_type="a100", multiplier=D("1.5"), id=2),
    Price("gpu", ALLOCATION, D("0.50"), T0, id=3),
    Price("gpu", NODE_HOUR, D("4.00"), T0, tenant="physics", id=4),
]


def test_estimate_explains_walltime_nodes_and_rate() -> None:
    e = estimate(Facts("gpu", "acme", nodes=4, walltime_s=7200), PRICES, T0)
    assert e.amount == D("40.50")
    assert e.explanation == "4 nodes x 2h x 5.00/node-hour + 0.50 per allocation = 40.50"
    assert e.price_ids == (1, 3)


def test_estimate_with_gpus_and_a_tenant_override() -> None:
    e = estimate(
        Facts("gpu", "physics", nodes=2, walltime_s=5400, gpus_per_node=4, gpu_type="a100"),
        PRICES,
        T0 + timedelta(days=3),
    )
    # 2 x 1.5 x 4.00 + 8 x 1.5 x 3.00 + 0.50
    assert e.amount == D("48.50")
    assert "2 nodes x 1.5h x 4.00/node-hour" in e.explanation
    assert "8 gpus (a100) x 1.5h x 3.00/gpu-hour" in e.explanation


def test_unbounded_allocation_reserves_one_charging_period_ahead() -> None:
    e = estimate(Facts("gpu", "acme", 1, None), PRICES, T0, charging_period_s=1800)
    assert e.amount == D("3.00")
    assert e.explanation.endswith("(one charging period ahead: no walltime)")


def test_no_price_before_its_window() -> None:
    e = estimate(Facts("gpu", "acme", 1, 3600), PRICES, T0 - timedelta(seconds=1))
    assert e.amount == 0 and "no price" in e.explanation


def test_charge_for_an_interval_with_and_without_fixed_costs() -> None:
    start = T0 + timedelta(hours=1)
    interval = (start, start + timedelta(minutes=20))
    assert charge_for(interval, 3, 0, PRICES, vcluster="gpu") == D("5.00")
    assert charge_for(interval, 3, 0, PRICES, vcluster="gpu", include_fixed=True) == D("5.50")
    assert charge_for(interval, 1, 4, PRICES, vcluster="gpu", gpu_type="a100") == D("5.666667")
    assert charge_for((start, start), 3, 0, PRICES, vcluster="gpu") == 0


windows = st.tuples(st.integers(0, 50), st.one_of(st.none(), st.integers(1, 30)))


@given(a=windows, b=windows)
def test_overlap_is_symmetric_and_matches_interval_arithmetic(a, b) -> None:  # type: ignore[no-untyped-def]
    def price(w: tuple[int, int | None]) -> Price:
        start = T0 + timedelta(days=w[0])
        end = None if w[1] is None else start + timedelta(days=w[1])
        return Price("gpu", NODE_HOUR, D(1), start, end)

    pa, pb = price(a), price(b)
    end_a = float("inf") if a[1] is None else a[0] + a[1]
    end_b = float("inf") if b[1] is None else b[0] + b[1]
    assert overlaps(pa, pb) == overlaps(pb, pa) == (a[0] < end_b and b[0] < end_a)


def test_overlap_refusal_names_the_existing_price() -> None:
    new = Price("gpu", NODE_HOUR, D(6), T0 + timedelta(days=30))
    with pytest.raises(AlreadyExists) as e:
        check_no_overlap(new, PRICES)
    assert "#1" in e.value.message and e.value.hint
    # another tenant's override or GPU type is another key
    check_no_overlap(Price("gpu", NODE_HOUR, D(6), T0, tenant="chem"), PRICES)


async def test_stored_prices_refuse_overlaps_and_write_nothing(ledger: Ledger) -> None:  # noqa: F811
    first = await ledger.add_price(
        Price("gpu", NODE_HOUR, D("5.00"), T0, T0 + timedelta(days=30)), who="admin"
    )
    assert first.id is not None
    before = await row_counts(ledger)
    with pytest.raises(AlreadyExists) as e:
        await ledger.add_price(Price("gpu", NODE_HOUR, D("6.00"), T0 + timedelta(days=29)))
    assert f"#{first.id}" in e.value.message
    with pytest.raises(ValidationError):
        await ledger.add_price(Price("gpu", "tb_hour", D(1), T0))
    with pytest.raises(ValidationError):
        await ledger.add_price(Price("gpu", NODE_HOUR, D(-1), T0 + timedelta(days=90)))
    assert await row_counts(ledger) == before
    # back to back is fine: [from, until) windows
    nxt = await ledger.add_price(Price("gpu", NODE_HOUR, D("6.00"), T0 + timedelta(days=30)))
    stored = await ledger.prices("gpu")
    assert [(p.id, p.rate, p.valid_until) for p in stored] == [
        (first.id, D("5.00"), T0 + timedelta(days=30)),
        (nxt.id, D("6.00"), None),
    ]
    e2 = estimate(Facts("gpu", "acme", 1, 3600), stored, T0 + timedelta(days=31))
    assert e2.amount == D("6.00")
