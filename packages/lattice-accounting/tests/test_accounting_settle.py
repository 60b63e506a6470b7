"""The job charger's cases (pure): where each cent of a settlement comes from and goes."""

from __future__ import annotations

from decimal import Decimal as D

from hypothesis import given
from hypothesis import strategies as st
from lattice_accounting import settle as st_
from lattice_accounting.settle import settle


def test_unfinished_uncharged_takes_the_first_cost_from_the_reservation() -> None:
    s = settle(held=D("10.00"), available=D("50.00"), charged=D(0), total=D("3.25"), finished=False)
    assert s.case == st_.UNFINISHED_UNCHARGED
    assert (s.from_reservation, s.from_project, s.release, s.exhausted) == (
        D("3.25"), D(0), D(0), False,
    )  # fmt: skip


def test_unfinished_partially_charged_overflows_into_the_project_then_drains() -> None:
    s = settle(
        held=D("1.50"), available=D("2.00"), charged=D("8.50"), total=D("13.00"), finished=False
    )
    assert s.case == st_.UNFINISHED_PARTIALLY
    # 4.50 due: 1.50 from the reservation, 2.00 from the project, 1.00 cannot be paid
    assert (s.from_reservation, s.from_project, s.charged) == (D("1.50"), D("2.00"), D("3.50"))
    assert s.exhausted


def test_finished_uncharged_charges_everything_and_releases_the_rest() -> None:
    s = settle(held=D("20.00"), available=D(0), charged=D(0), total=D("12.34"), finished=True)
    assert s.case == st_.FINISHED_UNCHARGED
    assert (s.from_reservation, s.release, s.exhausted) == (D("12.34"), D("7.66"), False)


def test_finished_partially_charged_charges_the_final_time() -> None:
    s = settle(
        held=D("2.00"), available=D("5.00"), charged=D("8.00"), total=D("11.01"), finished=True
    )
    assert s.case == st_.FINISHED_PARTIALLY
    assert (s.from_reservation, s.from_project, s.release) == (D("2.00"), D("1.01"), D(0))


def test_finished_overcharged_refunds_the_extra_and_releases() -> None:
    s = settle(held=D("4.00"), available=D(0), charged=D("9.99"), total=D("9.49"), finished=True)
    assert s.case == st_.FINISHED_OVERCHARGED
    assert (s.refund, s.release, s.charged) == (D("0.50"), D("4.00"), D(0))


money = st.decimals(min_value=0, max_value=10_000, places=2)


@given(held=money, available=money, charged=money, total=money, finished=st.booleans())
def test_settle_never_overdraws_and_accounts_for_every_cent(
    held: D, available: D, charged: D, total: D, finished: bool
) -> None:
    s = settle(held=held, available=available, charged=charged, total=total, finished=finished)
    assert 0 <= s.from_reservation <= held
    assert 0 <= s.from_project <= available
    assert s.release >= 0 and s.refund >= 0
    assert s.from_reservation + s.release <= held
    if s.case == st_.FINISHED_OVERCHARGED:
        assert s.refund == charged - total and s.charged == 0
    else:
        due = max(total - charged, D(0))
        assert s.charged <= due
        assert s.exhausted == (s.charged < due)
        if finished:
            assert s.from_reservation + s.release == held  # nothing stays reserved
