"""The job charger's cases as a pure function (the draft's "Periodic charging" diagram).

Given what an allocation has cost so far (``total``), what was already charged for it,
what its reservation still holds and what its project has available, :func:`settle`
says where the money comes from and goes to:

=========================  ====================================================
case                       what happens
=========================  ====================================================
unfinished_uncharged       charge the first cost (fixed costs + first running
unfinished_partially       time, or the running time since the last charge):
                           from the reservation, then from the project; when
                           both cannot cover it, drain them and terminate
finished_uncharged         charge the full cost (finished_partially: the final
finished_partially         running time), same order; then release what is left
                           of the reservation to the project
finished_overcharged       refund the extra previously charged (system ->
                           project) and release the reservation
=========================  ====================================================

The arithmetic works on any exact number type: ``Decimal`` amounts, or the integer
micro-units the bulk charge pass uses. Charges never make an account negative: what cannot be paid is reported as
``exhausted`` (the job is terminated) and simply not charged.
"""

from __future__ import annotations

from decimal import Decimal
from typing import NamedTuple

from lattice_accounting.money import ZERO

UNFINISHED_UNCHARGED = "unfinished_uncharged"
UNFINISHED_PARTIALLY = "unfinished_partially_charged"
FINISHED_UNCHARGED = "finished_uncharged"
FINISHED_PARTIALLY = "finished_partially_charged"
FINISHED_OVERCHARGED = "finished_overcharged"
CASES = (
    UNFINISHED_UNCHARGED,
    UNFINISHED_PARTIALLY,
    FINISHED_UNCHARGED,
    FINISHED_PARTIALLY,
    FINISHED_OVERCHARGED,
)


class Settlement(NamedTuple):
    # a NamedTuple, not a dataclass: the charge pass makes 100,000 of them per pass
    case: str
    from_reservation: Decimal = ZERO  # reservation account -> system
    from_project: Decimal = ZERO  # project account -> system
    refund: Decimal = ZERO  # system -> project
    release: Decimal = ZERO  # reservation account -> project
    exhausted: bool = False  # the cost could not be covered: terminate the job

    @property
    def charged(self) -> Decimal:
        return self.from_reservation + self.from_project


def case_of(charged: Decimal, total: Decimal, finished: bool) -> str:
    if finished and charged > total:
        return FINISHED_OVERCHARGED
    if charged == 0:
        return FINISHED_UNCHARGED if finished else UNFINISHED_UNCHARGED
    return FINISHED_PARTIALLY if finished else UNFINISHED_PARTIALLY


def settle(
    *, held: Decimal, available: Decimal, charged: Decimal, total: Decimal, finished: bool
) -> Settlement:
    """Where ``total - charged`` comes from, given ``held`` in the allocation's
    reservation and ``available`` in its project (both >= 0)."""
    case = case_of(charged, total, finished)
    if case == FINISHED_OVERCHARGED:
        return Settlement(case, refund=charged - total, release=held)
    due = max(total - charged, 0)  # an unfinished job charged ahead waits for its cost
    from_res = min(due, held)
    from_proj = min(due - from_res, available)
    exhausted = from_res + from_proj < due
    release = held - from_res if finished else ZERO
    return Settlement(case, from_res, from_proj, ZERO, release, exhausted)
