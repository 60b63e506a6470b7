"""The accounting service's decisions: what the charger charges (pure, to the cent), the
gate's key and refusal text, how a submission's reservation is bound and split, and the
service loop over a real SQLite ledger fed with quorum deltas (funds exhausted ->
cancel proposed; the watchdog's releases; the books always balance)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lattice_accounting.binding import ServiceLedger, shares
from lattice_accounting.charging import OpenReservation, due
from lattice_accounting.gate import (
    RESERVATION_TAG,
    GateRequest,
    estimate_for,
    rejection,
    reservation_key,
    terms,
)
from lattice_accounting.prices import Price
from lattice_accounting.service import FUNDS_EXHAUSTED, AccountingService
from lattice_common import commands as c
from lattice_common.errors import FailedPrecondition
from lattice_common.types import Allocation, AllocationSpec, AllocationState, LifecycleType
from lattice_common.watch import StateDelta

T0 = datetime(2026, 3, 1, tzinfo=UTC)
PRICE = Price("default", "node_hour", Decimal("5.00"), T0 - timedelta(days=1))


def spec(nodes: int = 4, walltime: int = 7200, **kw: Any) -> AllocationSpec:
    return AllocationSpec(
        entrypoint="x", tenant="physics", vcluster="default", nodes=nodes,
        walltime_seconds=walltime, **kw,
    )  # fmt: skip


def alloc(
    aid: str, state: AllocationState, s: AllocationSpec | None = None, **kw: Any
) -> Allocation:
    nodes = [f"n{i}" for i in range((s or spec()).nodes)]
    return Allocation(id=aid, spec=s or spec(), state=state, assigned_nodes=nodes, **kw)


def opened(aid: str, **kw: Any) -> OpenReservation:
    base: dict[str, Any] = {"held": Decimal(40), "charged": Decimal(0), "created_at": T0}
    return OpenReservation(aid, "physics", "default", **(base | kw))


# --------------------------------------------------------------------------- charging


def test_a_running_allocation_is_charged_from_its_start_then_from_the_last_charge() -> None:
    a = alloc("a", AllocationState.RUNNING, started_at=T0.timestamp())
    d = due(a, opened("a"), {}, [PRICE], T0 + timedelta(minutes=30))
    assert d is not None and d.amount == Decimal("10.00") and not d.final
    r = opened("a", charged=Decimal(10), last_charged_at=T0 + timedelta(minutes=30))
    d = due(a, r, {}, [PRICE], T0 + timedelta(minutes=45))
    assert d is not None and d.amount == Decimal("5.00")
    assert d.up_to == T0 + timedelta(minutes=45)


def test_an_ended_single_run_is_settled_at_its_exact_runtime() -> None:
    a = alloc(
        "a", AllocationState.COMPLETED, started_at=T0.timestamp(),
        finished_at=(T0 + timedelta(minutes=61)).timestamp(),
    )  # fmt: skip
    # charged ahead up to 01:30, from a started_at that Running then moved
    r = opened("a", charged=Decimal("15.50"), last_charged_at=T0 + timedelta(minutes=90))
    d = due(a, r, {}, [PRICE], T0 + timedelta(hours=2))
    assert d is not None and d.final
    assert d.total == Decimal("20.333333")  # 4 nodes x 61 min x 5.00/h


def test_an_ended_run_after_a_pause_adds_only_the_last_stretch() -> None:
    a = alloc(
        "a", AllocationState.COMPLETED, started_at=(T0 + timedelta(hours=1)).timestamp(),
        finished_at=(T0 + timedelta(hours=1, minutes=15)).timestamp(), requeue_count=1,
    )  # fmt: skip
    r = opened("a", charged=Decimal(10), last_charged_at=T0 + timedelta(minutes=40))
    d = due(a, r, {}, [PRICE], T0 + timedelta(hours=2))
    assert d is not None and d.final and d.total == Decimal("15.00")  # the gap is free


def test_a_suspended_allocation_is_charged_up_to_its_pause_then_not_at_all() -> None:
    a = alloc("a", AllocationState.SUSPENDED)
    r = opened("a", charged=Decimal(10), last_charged_at=T0 + timedelta(minutes=30))
    paused = T0 + timedelta(minutes=36)
    d = due(a, r, {}, [PRICE], T0 + timedelta(hours=1), paused_at=paused)
    assert d is not None and d.amount == Decimal("2.00") and d.up_to == paused
    r = opened("a", charged=Decimal(12), last_charged_at=paused)
    d = due(a, r, {}, [PRICE], T0 + timedelta(hours=1), paused_at=paused)
    assert d is not None and d.amount == 0 and d.up_to == T0 + timedelta(hours=1)


def test_nodes_that_stopped_reporting_stop_the_charge() -> None:
    a = alloc("a", AllocationState.RUNNING, started_at=T0.timestamp())
    silent = T0 + timedelta(minutes=6)
    d = due(a, opened("a"), {}, [PRICE], T0 + timedelta(hours=1), alive_until=silent)
    assert d is not None and d.amount == Decimal("2.00") and d.up_to == silent


def test_a_pending_allocation_owes_nothing() -> None:
    assert due(alloc("a", AllocationState.PENDING), opened("a"), {}, [PRICE], T0) is None


@given(
    total=st.decimals(min_value=0, max_value=10**6, places=6),
    weights=st.lists(st.decimals(min_value=0, max_value=10**4, places=6), min_size=1, max_size=20),
)
def test_shares_always_sum_to_the_reservation(total: Decimal, weights: list[Decimal]) -> None:
    parts = shares(total, weights)
    assert len(parts) == len(weights)
    assert sum(parts, Decimal(0)) == total
    assert all(p >= 0 for p in parts)


# --------------------------------------------------------------------------- the gate


def test_the_refusal_says_the_numbers() -> None:
    req = GateRequest.from_json(
        {"request_id": "r", "tenant": "physics", "vcluster": "default", "nodes": 4,
         "walltime_seconds": 7200},
    )  # fmt: skip
    est = estimate_for(req, [PRICE], T0, ahead_s=3600)
    assert terms(est.explanation) == "4 nodes x 2h x 5.00/node-hour"
    err = rejection("physics/default", Decimal("12.5"), est)
    assert isinstance(err, FailedPrecondition)
    assert err.message == (
        'allocation rejected: project "physics/default" has 12.50 available, the estimate is '
        "40.00 (4 nodes x 2h x 5.00/node-hour)"
    )
    assert "transfer" in err.hint and "fewer nodes" in err.hint


def test_reservation_keys_fit_the_ledger() -> None:
    assert reservation_key("abc") == "rq-abc"
    long = reservation_key("x" * 128)
    assert long.startswith("rq-") and len(long) <= 64 and long == reservation_key("x" * 128)


# --------------------------------------------------------------------------- the service


class FakeQuorum:
    """Records proposals (the service's only write to the quorum)."""

    def __init__(self) -> None:
        self.proposed: list[c.Command] = []

    async def propose(self, cmd: c.Command) -> c.CommandResult:
        self.proposed.append(cmd)
        return c.CommandResult(revision=0)

    def watch(self) -> Any:
        raise NotImplementedError


@pytest.fixture
async def service(tmp_path: Path) -> Any:
    ledger = await ServiceLedger.open(f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}")
    now = [T0]
    svc = AccountingService(
        ledger, FakeQuorum(), clock=lambda: now[0], exhausted_grace=60, orphan_grace=120,
        start_timeout=3600, reserve_ahead=3600,
    )  # fmt: skip
    await ledger.add_price(PRICE)
    await ledger.open_tenant("physics")
    await ledger.topup("physics", "100")
    await ledger.transfer("physics", "default", "60")
    yield svc, now
    await ledger.close()


async def test_a_task_group_reservation_is_split_over_its_tasks(service: Any) -> None:
    svc, _ = service
    req = GateRequest.from_json(
        {"request_id": "tg", "tenant": "physics", "lines": [
            {"vcluster": "default", "nodes": 1, "walltime_seconds": 3600, "count": 3}]},
    )  # fmt: skip
    got = await svc.reserve(req)
    assert got["gated"] and Decimal(got["amount"]) == Decimal(15)
    s = spec(nodes=1, walltime=3600, tags={RESERVATION_TAG: got["key"]})
    tasks = [alloc(f"t{i}", AllocationState.PENDING, s) for i in range(3)]
    await svc.apply(StateDelta(revision=1, snapshot=True, allocations=tasks))
    held = [(await svc.ledger.reservation(f"t{i}")).held for i in range(3)]
    assert held == [Decimal(5)] * 3
    assert (await svc.ledger.reservation(got["key"])).state == "bound"
    assert await svc.ledger.verify() == []


async def test_funds_running_out_cancel_the_allocation_after_the_grace(service: Any) -> None:
    svc, now = service
    s = spec(nodes=4, walltime=0, lifecycle=LifecycleType.UNBOUNDED)
    a = alloc("svc", AllocationState.RUNNING, s, started_at=T0.timestamp())
    await svc.apply(StateDelta(revision=1, snapshot=True, allocations=[a]))
    for minutes in (1, 120, 200, 260):
        now[0] = T0 + timedelta(minutes=minutes)
        await svc.charge_pass()
    assert svc.quorum.proposed == [
        c.CancelAllocation(
            allocation_id="svc", reason=FUNDS_EXHAUSTED, requested_by="lattice-accounting",
            now=svc.quorum.proposed[0].now,
        )
    ]  # fmt: skip
    b = await svc.ledger.balance("physics/default")
    assert b.available == 0 and b.reserved == 0 and b.spent == Decimal(60)
    assert await svc.ledger.verify() == []


async def test_the_watchdog_releases_orphans_and_unstarted_reservations(service: Any) -> None:
    svc, now = service
    await svc.apply(StateDelta(revision=1, snapshot=True))
    orphan = await svc.reserve(
        GateRequest.from_json({"request_id": "lost", "tenant": "physics",
                               "vcluster": "default", "nodes": 1, "walltime_seconds": 3600})
    )  # fmt: skip
    waiting = await svc.reserve(
        GateRequest.from_json({"request_id": "w", "tenant": "physics",
                               "vcluster": "default", "nodes": 1, "walltime_seconds": 3600})
    )  # fmt: skip
    s = spec(nodes=1, walltime=3600, tags={RESERVATION_TAG: waiting["key"]})
    await svc.apply(StateDelta(revision=2, allocations=[alloc("w1", AllocationState.PENDING, s)]))
    assert (await svc.ledger.balance("physics/default")).reserved == Decimal(10)
    now[0] = datetime.now(UTC) + timedelta(minutes=5)  # past the orphan grace
    await svc.charge_pass()
    assert (await svc.ledger.reservation(orphan["key"])).state == "cancelled"
    assert (await svc.ledger.reservation("w1")).held == 5
    now[0] = datetime.now(UTC) + timedelta(hours=2)  # past the start timeout
    await svc.charge_pass()
    r = await svc.ledger.reservation("w1")
    assert r.state == "reserved" and r.held == 0  # it stays queued, its money returned
    b = await svc.ledger.balance("physics/default")
    assert b.available == Decimal(60) and b.reserved == 0
    assert await svc.ledger.verify() == []


async def test_an_allocation_moved_to_the_history_store_is_settled_from_its_record(
    service: Any, tmp_path: Path
) -> None:
    """It ended and left the quorum (retention) while the service did not see its end:
    the history store's final record settles it at its exact runtime, not as charged."""
    from lattice_common.history import HistoryStore, sqlite_url

    svc, now = service
    svc.history = await HistoryStore.open(sqlite_url(str(tmp_path / "history.db")))
    got = await svc.reserve(
        GateRequest.from_json({"request_id": "h", "tenant": "physics",
                               "vcluster": "default", "nodes": 1, "walltime_seconds": 3600})
    )  # fmt: skip
    s = spec(nodes=1, walltime=3600, tags={RESERVATION_TAG: got["key"]})
    running = alloc("h1", AllocationState.RUNNING, s, started_at=T0.timestamp())
    await svc.apply(StateDelta(revision=1, snapshot=True, allocations=[running]))
    now[0] = T0 + timedelta(minutes=10)
    await svc.charge_pass()
    assert (await svc.ledger.reservation("h1")).charged == Decimal("0.833333")
    ended = alloc(
        "h1", AllocationState.COMPLETED, s, started_at=T0.timestamp(),
        finished_at=(T0 + timedelta(minutes=30)).timestamp(), exit_code=0,
    )  # fmt: skip
    await svc.history.append([ended], revision=5)
    await svc.apply(StateDelta(revision=6, removed_allocations=["h1"]))
    assert "h1" not in svc.mirror.allocations
    now[0] = T0 + timedelta(hours=2)
    await svc.charge_pass()
    r = await svc.ledger.reservation("h1")
    assert r.state == "finalized" and r.charged == Decimal("2.5")  # 30 min x 5.00/node-hour
    assert await svc.ledger.verify() == []
    await svc.history.close()
