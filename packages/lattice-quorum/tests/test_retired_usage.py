"""A budgeted tenant's allocations leave the state after the ordinary retention, and
the budget penalty reads the same before and after: the removal keeps each run in the
tenant's ledger totals (``Tenant.retired_usage``), which reach the scheduler's mirror in
the same watch delta that drops the allocations."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_common import commands as c
from lattice_common import ledger
from lattice_common.types import Allocation, AllocationState, NodeCapabilities
from lattice_common.watch import StateMirror, decode_delta
from lattice_quorum import retention
from lattice_quorum.quorum import encode_changes, encode_snapshot
from lattice_quorum.state import Changes, GlobalState, apply
from lattice_test_harness import builders as b
from test_state import assign, ok, register, submit, world

HOUR = 3600.0
DAY = 86400.0
PERIOD_DAYS = 90.0
T0 = 1_700_000_000.0  # a realistic epoch: runs cross UTC day boundaries


def run_for(s: GlobalState, aid: str, nodes: list[str], start: float, end: float) -> None:
    assign(s, aid, nodes, now=start)
    ok(
        s,
        c.UpdateAllocationState(
            allocation_id=aid, state=AllocationState.COMPLETED, exit_code=0, now=end
        ),
    )


def budgeted_world() -> GlobalState:
    s = world(
        nodes=0,
        tenants={"t": {"node_hours_budget": 500.0, "gpu_hours_budget": 900.0}, "free": {}},
    )
    for i in range(4):
        caps = NodeCapabilities(cpu_cores=64, memory_gb=256, gpu_count=4 if i < 2 else 0)
        register(s, f"n{i:04d}", capabilities=caps)
    return s


def fractions(m: StateMirror | GlobalState, now: float) -> dict[str, float]:
    """What the scheduler's cost function computes (cost.build_context)."""
    return ledger.budget_utilization(
        m.allocations.values(),
        m.tenants.values(),
        now=now,
        period_days=PERIOD_DAYS,
        node_gpus=ledger.node_gpu_counts(m.nodes.values()),
    )


def test_budget_penalty_is_the_same_before_and_after_removal() -> None:
    s = budgeted_world()
    ids = []
    # runs of the budgeted tenant over several days, one across midnight, one on GPU nodes
    for k, (nodes, start, hours) in enumerate(
        [
            (["n0000", "n0001"], T0, 5.0),
            (["n0002"], T0 + 1.7 * DAY, 30.0),
            (["n0000"], T0 + 3 * DAY, 0.5),
        ]
    ):
        aid = submit(s, now=T0 - 100 + k, nodes=len(nodes))
        run_for(s, aid, nodes, start, start + hours * HOUR)
        ids.append(aid)
    other = submit(s, now=T0 - 50, tenant="free")
    run_for(s, other, ["n0003"], T0, T0 + HOUR)
    mirror = StateMirror()
    mirror.apply(decode_delta(encode_snapshot(s)))

    now = T0 + 10 * DAY
    before = fractions(s, now)
    assert before["t"] > 0 and "free" not in before
    # the ordinary retention (24 h) applies to the budgeted tenant too
    due = retention.expired(s, now, 24 * HOUR, 100)
    assert sorted(due) == sorted([*ids, other])
    ch = Changes()
    res = apply(
        s,
        c.RemoveAllocations(
            ids=due, retention_seconds=24 * HOUR, budget_period_seconds=PERIOD_DAYS * DAY, now=now
        ),
        ch,
    )
    assert res.error is None and sorted(res.removed_ids or []) == sorted(due)
    assert not set(due) & set(s.allocations)
    mirror.apply(decode_delta(encode_changes(s, ch)))
    assert not set(due) & set(mirror.allocations)
    after_state, after_mirror = fractions(s, now), fractions(mirror, now)
    assert after_state == after_mirror
    assert after_state["t"] == pytest.approx(before["t"], rel=1e-12)
    # ... and later on, as long as the window holds the runs whole
    later = now + 30 * DAY
    assert fractions(mirror, later)["t"] == pytest.approx(before["t"], rel=1e-12)
    # once the window has passed them, they count for nothing (and the days are dropped)
    gone = T0 + 3 * DAY + PERIOD_DAYS * DAY + 2 * DAY
    assert fractions(mirror, gone)["t"] == 0.0
    extra = submit(s, now=gone - 10)
    run_for(s, extra, ["n0003"], gone - 5, gone - 4)
    apply(
        s,
        c.RemoveAllocations(
            ids=[extra], retention_seconds=1, budget_period_seconds=PERIOD_DAYS * DAY, now=gone
        ),
    )
    assert min(s.tenants["t"].retired_usage) >= math.floor((gone - PERIOD_DAYS * DAY) / DAY)


def test_the_same_log_gives_the_same_totals_on_every_member() -> None:
    import msgspec

    def build() -> GlobalState:
        s = budgeted_world()
        for k in range(5):
            aid = submit(s, now=T0 + k)
            run_for(s, aid, ["n0000"], T0 + k * 7 * HOUR, T0 + k * 7 * HOUR + 0.3 * k * HOUR)
        apply(
            s,
            c.RemoveAllocations(ids=list(s.allocations), retention_seconds=HOUR, now=T0 + 5 * DAY),
        )
        return s

    a, b2 = build(), build()
    assert a.tenants["t"].retired_usage
    assert msgspec.msgpack.encode(a) == msgspec.msgpack.encode(b2)


def _ended(k: int, start: float, hours: float, nodes: int) -> Allocation:
    return Allocation(
        id=f"a{k}",
        spec=b.spec(tenant="t", vcluster="v", nodes=nodes),
        state=AllocationState.COMPLETED,
        submitted_at=start,
        started_at=start,
        finished_at=start + hours * HOUR,
        assigned_nodes=[f"a{k}-n{i}" for i in range(nodes)],
    )


@settings(max_examples=200, deadline=None)
@given(
    runs=st.lists(
        st.tuples(
            st.floats(min_value=0, max_value=60 * DAY),  # start, after the window's first day
            st.floats(min_value=0, max_value=200),  # hours
            st.integers(min_value=1, max_value=8),  # nodes
            st.integers(min_value=0, max_value=8),  # GPUs per node
        ),
        max_size=20,
    ),
    after=st.floats(min_value=0, max_value=20 * DAY),
)
def test_retired_totals_equal_the_ledger_inside_the_window(
    runs: list[tuple[float, float, int, int]], after: float
) -> None:
    """Runs wholly inside the window count exactly what the per-record ledger counts
    (the pro rata share applies only to the day the window opens in)."""
    since = T0
    allocs = [_ended(k, since + DAY + s0, h, n) for k, (s0, h, n, _) in enumerate(runs)]
    gpus = {f"a{k}-n{i}": g for k, (_, _, n, g) in enumerate(runs) for i in range(n)}
    days: dict = {}
    for a in allocs:
        ledger.retire(days, a, gpus)
    now = since + 70 * DAY + after  # after every run's end
    window = (now - since) / DAY
    u = ledger.usage(allocs, now=now, window_days=window, node_gpus=gpus)
    node_h, gpu_h, n = ledger.retired_hours(days, now=now, period_days=window)
    assert node_h == pytest.approx(u.node_hours, rel=1e-9, abs=1e-9)
    assert gpu_h == pytest.approx(u.gpu_hours, rel=1e-9, abs=1e-9)
    assert n == u.allocations


def test_the_window_edge_counts_its_day_pro_rata() -> None:
    """A run on the day the window opens counts the share of that day inside it."""
    day0 = math.floor(T0 / DAY) * DAY
    a = _ended(0, day0, 24.0, 1)  # the whole day, one node
    days: dict = {}
    ledger.retire(days, a)
    now = day0 + 0.25 * DAY + PERIOD_DAYS * DAY  # the window opens a quarter into the day
    node_h, _, _ = ledger.retired_hours(days, now=now, period_days=PERIOD_DAYS)
    assert node_h == pytest.approx(18.0)
    assert ledger.usage([a], now=now, window_days=PERIOD_DAYS).node_hours == pytest.approx(18.0)


def test_an_allocation_that_never_ran_adds_nothing() -> None:
    s = budgeted_world()
    aid = submit(s, now=T0)
    ok(s, c.CancelAllocation(allocation_id=aid, now=T0 + 1))
    days: dict = {}
    ledger.retire(days, s.allocations[aid])
    assert days == {}
    apply(s, c.RemoveAllocations(ids=[aid], retention_seconds=1, now=T0 + 10))
    assert aid not in s.allocations and s.tenants["t"].retired_usage == {}
