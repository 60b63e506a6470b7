"""Events from the quorum's real state changes (a LocalQuorum applying real commands and
streaming real deltas), restarts with the durable cursor, and reconcile."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lattice_accounting.waldur.buffer import EventBuffer
from lattice_accounting.waldur.client import WaldurClient
from lattice_accounting.waldur.events import (
    AccountingEvent,
    EventDeriver,
    EventType,
    allocation_events,
    decode_event,
    encode_event,
    reconcile_events,
)
from lattice_accounting.waldur.feed import AccountingFeed, reconcile
from lattice_accounting.waldur.pusher import WaldurPusher
from lattice_common import commands as c
from lattice_common.types import AllocationState as A
from lattice_common.types import NodeCapabilities, SchedulerType
from lattice_common.watch import StateDelta, decode_delta
from lattice_quorum.local import LocalQuorum
from lattice_test_harness import builders as b
from lattice_test_harness.fake_waldur import FakeWaldur
from pydantic import SecretStr

TOKEN = "waldur-token-events-0123456789"


def ok(q: LocalQuorum, cmd: c.Command) -> c.CommandResult:
    res = q.apply(cmd)
    assert res.error is None, res.error
    return res


def world() -> LocalQuorum:
    q = LocalQuorum()
    ok(q, c.CreateTenant(tenant=b.tenant("physics"), now=1.0))
    ok(q, c.CreateVCluster(vcluster=b.vcluster("hpc"), now=1.0))
    ok(
        q,
        c.CreateVCluster(
            vcluster=b.vcluster("secure", scheduler_type=SchedulerType.SENSITIVE_RESERVATION),
            now=1.0,
        ),
    )
    for i in range(4):
        caps = NodeCapabilities(cpu_cores=64, memory_gb=256, gpu_type="H100", gpu_count=4)
        ok(q, c.RegisterNode(node_id=f"n{i}", capabilities=caps, now=2.0))
    return q


def submit(q: LocalQuorum, now: float, **kw: Any) -> str:
    kw.setdefault("tenant", "physics")
    kw.setdefault("vcluster", "hpc")
    res = ok(q, c.SubmitAllocation(spec=b.spec(project="sim", user="alice", **kw), now=now))
    assert res.allocation is not None
    return res.allocation.id


def run_to_end(q: LocalQuorum, nodes: list[str], start: float, end: float, **kw: Any) -> str:
    aid = submit(q, start - 5, nodes=len(nodes), **kw)
    # nodes taken at start - 1 (Running at once: no image to stage); the end reports
    # when the process really started
    ok(q, c.AssignNodes(allocation_id=aid, node_ids=nodes, now=start - 1))
    ok(
        q,
        c.UpdateAllocationState(
            allocation_id=aid,
            state=A.COMPLETED,
            exit_code=0,
            started_at=start,
            finished_at=end,
            now=end,
        ),
    )
    return aid


async def collect(q: LocalQuorum, deriver: EventDeriver) -> list[AccountingEvent]:
    """Everything the deriver makes of the messages queued so far."""
    out: list[AccountingEvent] = []
    sub = q.subscribe()
    await asyncio.sleep(0)
    while not sub.empty():
        raw = sub.get_nowait()
        assert raw is not None
        out += deriver.apply(decode_delta(raw), now=99_999.0)
    q.unsubscribe(sub)
    return out


async def stream(q: LocalQuorum, deriver: EventDeriver, actions: Any) -> list[AccountingEvent]:
    """Subscribe, do ``actions(q)``, then derive from the snapshot and every delta."""
    sub = q.subscribe()
    actions(q)
    await asyncio.sleep(0.05)
    out: list[AccountingEvent] = []
    while not sub.empty():
        raw = sub.get_nowait()
        assert raw is not None
        out += deriver.apply(decode_delta(raw), now=99_999.0)
    q.unsubscribe(sub)
    return out


async def test_a_run_gives_started_then_completed_with_its_usage() -> None:
    q = world()
    events = await stream(
        q, EventDeriver(), lambda q: run_to_end(q, ["n0", "n1"], 1000.0, 1000.0 + 1800)
    )
    assert [e.type for e in events] == [
        EventType.ALLOCATION_STARTED,
        EventType.ALLOCATION_COMPLETED,
    ]
    s, d = events
    assert (s.tenant, s.project, s.user, s.vcluster) == ("physics", "sim", "alice", "hpc")
    assert s.nodes == ("n0", "n1") and s.gpus == 8 and s.gpu_type == "H100"
    assert s.started_at == 999.0 and s.estimated_duration_seconds == 3600
    assert d.started_at == 1000.0 and d.ended_at == 2800.0
    assert d.duration_seconds == 1800 and d.node_hours == 1.0 and d.gpu_hours == 4.0
    assert d.exit_status == 0 and d.state == "Completed"
    assert s.event_id != d.event_id and s.allocation_id == d.allocation_id


async def test_cancelled_before_it_ran_bills_nothing() -> None:
    q = world()

    def act(q: LocalQuorum) -> None:
        aid = submit(q, 10.0)
        ok(q, c.CancelAllocation(allocation_id=aid, now=20.0))

    events = await stream(q, EventDeriver(), act)
    assert [e.type for e in events] == [EventType.ALLOCATION_COMPLETED]
    assert events[0].gpu_hours == 0.0 and events[0].state == "Cancelled"


async def test_sensitive_claim_and_release_are_billed_to_the_claiming_user() -> None:
    q = world()
    deriver = EventDeriver()
    aid = ""

    def act(q: LocalQuorum) -> None:
        nonlocal aid
        aid = run_to_end(q, ["n2"], 500.0, 900.0, vcluster="secure")

    events = await stream(q, deriver, act)
    claimed = [e for e in events if e.type == EventType.NODE_CLAIMED]
    assert len(claimed) == 1
    assert claimed[0].user == "alice" and claimed[0].nodes == ("n2",)
    assert claimed[0].tenant == "physics"

    def release(q: LocalQuorum) -> None:
        ok(q, c.ReleaseNodeClaim(node_id="n2", user="alice", now=4000.0))

    events = await stream(q, deriver, release)
    released = [e for e in events if e.type == EventType.NODE_RELEASED]
    assert len(released) == 1
    r = released[0]
    assert r.user == "alice" and r.tenant == "physics" and r.nodes == ("n2",)
    assert r.started_at == claimed[0].started_at and r.node_hours is not None


async def test_restart_regenerates_what_changed_after_the_cursor_with_the_same_ids() -> None:
    q = world()
    live = EventDeriver()
    first = await stream(q, live, lambda q: run_to_end(q, ["n0"], 100.0, 200.0))
    cursor = live.revision
    second = await stream(q, live, lambda q: run_to_end(q, ["n1"], 300.0, 400.0))
    # a restart from the cursor: the snapshot brings back the second run only
    again = await collect(q, EventDeriver(since_revision=cursor))
    assert [e.event_id for e in again] == [e.event_id for e in second]
    # without a cursor, everything, still with the same ids
    everything = await collect(q, EventDeriver())
    assert {e.event_id for e in everything} == {e.event_id for e in first + second}


def test_reconcile_regenerates_the_live_event_ids() -> None:
    q = world()
    deriver = EventDeriver()
    live: list[AccountingEvent] = []
    sub_events: list[AccountingEvent] = []

    async def go() -> None:
        nonlocal live
        live = await stream(
            q,
            deriver,
            lambda q: [
                run_to_end(q, ["n0"], 1000.0, 2000.0),
                run_to_end(q, ["n1", "n2"], 1500.0, 5000.0),
                run_to_end(q, ["n3"], 6000.0, 7000.0),
            ],
        )

    asyncio.run(go())
    allocations = list(q.state.allocations.values())
    nodes = dict(q.state.nodes)
    rec = reconcile_events(allocations, since=0.0, until=10_000.0, nodes=nodes)
    assert sorted(e.event_id for e in rec) == sorted(e.event_id for e in live + sub_events)
    by_id = {e.event_id: e for e in live}
    for e in rec:
        assert e.gpu_hours == by_id[e.event_id].gpu_hours
    # a range picks what started or ended in it, in time order
    part = reconcile_events(allocations, since=1200.0, until=5500.0, nodes=nodes)
    assert [(e.type.value, e.timestamp) for e in part] == [
        ("allocation.started", 1500.0),
        ("allocation.completed", 2000.0),
        ("allocation.completed", 5000.0),
    ]
    with pytest.raises(ValueError):
        reconcile_events(allocations, since=10.0, until=10.0)


async def test_reconcile_after_drops_fills_waldur_without_double_billing(tmp_path: Path) -> None:
    q = world()
    for i in range(3):
        run_to_end(q, [f"n{i}"], 1000.0 + i, 2000.0 + i)
    async with FakeWaldur(token=TOKEN) as waldur:
        buf = EventBuffer(tmp_path, memory_max=100, disk_max_bytes=1 << 20, disk_alert_events=10)
        pusher = WaldurPusher(WaldurClient(waldur.api_url, SecretStr(TOKEN)), buf)
        feed = AccountingFeed(pusher)
        await feed.run(_snapshot_only(q))
        assert await pusher.push_once() == 6
        before = list(waldur.backend_ids)
        # an admin reconciles an overlapping range: nothing is billed twice
        n = reconcile(
            pusher, q.state.allocations.values(), since=0.0, until=3000.0, nodes=q.state.nodes
        )
        assert n == 6
        await pusher.push_once()
        assert waldur.backend_ids == before and waldur.duplicates == 6 + 3  # orders, items
        assert len(waldur.invoice_items["physics"]) == 3
        # the cursor moved past everything pushed
        assert feed.cursor.value == q.state.revision
        await pusher.client.close()


async def _snapshot_only(q: LocalQuorum):  # type: ignore[no-untyped-def]
    sub = q.subscribe()
    raw = sub.get_nowait()
    q.unsubscribe(sub)
    assert raw is not None
    yield decode_delta(raw)


def test_requeued_allocation_gets_one_started_event_per_run() -> None:
    base = b.allocation(id="a1", tenant="physics")
    pending = base
    run1 = _with(base, state=A.RUNNING, started_at=10.0, assigned_nodes=["n0"])
    # as the quorum records a requeue: back to Pending, one more requeue counted
    requeued = _with(base, state=A.PENDING, started_at=None, requeue_count=1)
    run2 = _with(requeued, state=A.RUNNING, started_at=50.0, assigned_nodes=["n1"])
    steps = [pending, run1, run1, requeued, run2]
    ids = []
    prev = None
    for cur in steps:
        ids += [e.event_id for e in allocation_events(prev, cur, now=0.0)]
        prev = cur
    assert len(ids) == 2 and len(set(ids)) == 2


def _with(a: Any, **kw: Any) -> Any:
    import msgspec

    return msgspec.structs.replace(a, **kw)


@given(
    st.builds(
        AccountingEvent,
        event_id=st.text(min_size=1, max_size=40),
        type=st.sampled_from(list(EventType)),
        timestamp=st.floats(0, 2e9),
        tenant=st.text(max_size=20),
        nodes=st.lists(st.text(max_size=8), max_size=4).map(tuple),
        gpus=st.integers(0, 64),
        gpu_hours=st.none() | st.floats(0, 1e6),
    )
)
def test_events_survive_the_wal_encoding(e: AccountingEvent) -> None:
    assert decode_event(encode_event(e)) == e


def test_snapshot_delta_shape_is_what_the_deriver_reads() -> None:
    # the deriver consumes lattice_common.watch.StateDelta as the quorum streams it
    d = StateDelta(revision=5, snapshot=True)
    assert EventDeriver().apply(d, now=0.0) == []


@st.composite
def lifecycles(draw: st.DrawFn) -> list[Any]:
    """The records one allocation goes through, as the quorum writes them: runs (each
    possibly requeued or preempted back to Pending), then an end with the real start."""
    a = b.allocation(id="a1", tenant="physics", submitted_at=0.0)
    out = [a]
    t = 10.0
    for _ in range(draw(st.integers(0, 3))):
        t += draw(st.floats(1, 100))
        a = _with(a, state=A.STAGING, started_at=t, assigned_nodes=["n0"])
        out.append(a)
        t += draw(st.floats(0, 10))
        a = _with(a, state=A.RUNNING, started_at=t)
        out.append(a)
        if draw(st.booleans()):
            a = _with(a, state=A.CHECKPOINTING, checkpoint_hint_at=t + 1)
            out.append(a)
            a = _with(a, state=A.PENDING, started_at=None, preempted_count=a.preempted_count + 1)
        else:
            a = _with(a, state=A.PENDING, started_at=None, requeue_count=a.requeue_count + 1)
        out.append(a)
    t += draw(st.floats(1, 100))
    a = _with(a, state=A.RUNNING, started_at=t, assigned_nodes=["n0"])
    out.append(a)
    real_start = t + draw(st.floats(0, 5))
    end = real_start + draw(st.floats(0, 1000))
    state = draw(st.sampled_from([A.COMPLETED, A.FAILED, A.CANCELLED]))
    out.append(_with(a, state=state, started_at=real_start, finished_at=end))
    return out


@given(lifecycles())
def test_live_events_are_unique_and_reconcile_regenerates_the_last_run(records: list[Any]) -> None:
    live: list[AccountingEvent] = []
    prev = None
    for cur in records:
        live += allocation_events(prev, cur, now=1e9)
        prev = cur
    ids = [e.event_id for e in live]
    assert len(ids) == len(set(ids))  # no happening reported twice
    runs = sum(
        1 for p, c_ in itertools.pairwise(records) if c_.state == A.RUNNING and p.state != A.RUNNING
    )
    assert [e.type for e in live].count(EventType.ALLOCATION_STARTED) == runs
    assert [e.type for e in live].count(EventType.ALLOCATION_COMPLETED) == 1
    rec = reconcile_events([records[-1]], since=0.0, until=1e12)
    assert {e.event_id for e in rec} <= set(ids)  # the same ids: Waldur ignores repeats
    assert [e.type for e in rec] == [EventType.ALLOCATION_STARTED, EventType.ALLOCATION_COMPLETED]


async def test_a_hand_over_in_one_entry_gives_the_end_before_the_next_start() -> None:
    q = world()
    first = submit(q, 900.0)
    ok(q, c.AssignNodes(allocation_id=first, node_ids=["n0"], now=990.0))
    nxt = submit(q, 950.0)
    ok(q, c.SetNextAllocations(next={"n0": nxt}, now=991.0))

    def end_first(q: LocalQuorum) -> None:
        ok(
            q,
            c.UpdateAllocationState(
                allocation_id=first, state=A.COMPLETED, exit_code=0, finished_at=1000.0, now=1000.2
            ),
        )

    events = await stream(q, EventDeriver(), end_first)
    done = [(e.type, e.allocation_id) for e in events]
    # one entry ended the first and started the next on its node: in that order
    assert done[-2:] == [
        (EventType.ALLOCATION_COMPLETED, first),
        (EventType.ALLOCATION_STARTED, nxt),
    ]
    assert events[-1].timestamp >= events[-2].timestamp
