"""Terminal allocations leaving the state (RemoveAllocations, lattice_quorum.retention):
only after their retention, task groups and DAGs only whole, identical on every member
(the same log applied to two states gives byte-identical states), and the watch delta
tells mirrors which ids went."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_common import commands as c
from lattice_common.types import AllocationState
from lattice_common.watch import StateMirror, decode_delta
from lattice_quorum import retention
from lattice_quorum.quorum import encode_changes, encode_snapshot
from lattice_quorum.state import Changes, GlobalState, apply
from lattice_test_harness import builders as b
from test_dags import member, submit_dag
from test_state import assign, ok, submit, world

DONE = AllocationState.COMPLETED
HOUR = 3600.0


def finish(s: GlobalState, aid: str, now: float) -> None:
    assign(s, aid, ["n0000"], now=now - 1)
    ok(s, c.UpdateAllocationState(allocation_id=aid, state=DONE, exit_code=0, now=now))


def remove(s: GlobalState, ids: list[str], now: float, keep: float = HOUR) -> Changes:
    ch = Changes()
    res = apply(s, c.RemoveAllocations(ids=ids, retention_seconds=keep, now=now), ch)
    assert res.error is None, res.error
    return ch


def test_an_allocation_leaves_only_after_its_retention() -> None:
    s = world()
    old, recent, pending = submit(s), submit(s), submit(s)
    finish(s, old, 100.0)
    finish(s, recent, 100.0 + HOUR)
    # before the retention: nothing goes, whatever the proposer listed
    assert retention.expired(s, 100.0 + HOUR - 1, HOUR, 10) == []
    remove(s, [old, recent, pending], 100.0 + HOUR - 1)
    assert {old, recent, pending} <= set(s.allocations)
    # at the retention: the old one; the recent and the pending one stay
    now = 100.0 + HOUR
    assert retention.expired(s, now, HOUR, 10) == [old]
    rev = s.revision
    ch = remove(s, [old, recent, pending], now)
    assert old not in s.allocations and {recent, pending} <= set(s.allocations)
    assert ch.removed_allocations == {old} and s.revision == rev + 1
    # the delta names it and a mirror drops it
    m = StateMirror()
    m.apply(decode_delta(encode_snapshot(s)))
    m.allocations[old] = s.allocations[recent]  # as it was before
    m.apply(decode_delta(encode_changes(s, ch)))
    assert old not in m.allocations


def test_a_task_group_leaves_only_whole() -> None:
    s = world()
    res = ok(s, c.SubmitTaskGroup(spec=b.spec(tenant="t", vcluster="v"), start=0, end=2, now=10))
    gid = res.task_group_id
    ids = list(s.task_groups[gid])
    finish(s, ids[0], 100.0)
    finish(s, ids[1], 100.0)
    late = 100.0 + 10 * HOUR
    assert retention.expired(s, late, HOUR, 10) == []  # one task still pending
    remove(s, ids, late)
    assert set(ids) <= set(s.allocations)
    finish(s, ids[2], late)
    assert retention.expired(s, late + HOUR - 1, HOUR, 10) == []  # the last ended recently
    assert sorted(retention.expired(s, late + HOUR, HOUR, 1)) == sorted(ids)  # whole, over limit
    remove(s, ids, late + HOUR)
    assert not set(ids) & set(s.allocations) and gid not in s.task_groups


def test_a_dag_leaves_only_whole_and_with_its_record() -> None:
    s = world()
    ids = submit_dag(s, member("a"), member("b", ("a", "success")), request_id="rq-1")
    dag_id = s.allocations[ids["a"]].dag_id
    finish(s, ids["a"], 100.0)
    late = 100.0 + 10 * HOUR
    remove(s, [ids["a"]], late)  # b still held: the DAG runs
    assert ids["a"] in s.allocations
    finish(s, ids["b"], late)
    assert s.dags[dag_id].state != "Running"
    remove(s, [ids["a"], ids["b"]], late + HOUR)
    assert dag_id not in s.dags and "rq-1" not in s.request_ids
    assert not set(ids.values()) & set(s.allocations)
    # the same request id is a new submission now (its idempotency key went with it)
    again = submit_dag(s, member("a"), request_id="rq-1")
    assert again["a"] not in ids.values()


def test_idempotency_keys_of_removed_allocations_go_with_them() -> None:
    s = world()
    aid = submit(s, request_id="rq-x")
    finish(s, aid, 100.0)
    remove(s, [aid], 100.0 + HOUR)
    assert "rq-x" not in s.request_ids


@settings(max_examples=30, deadline=None)
@given(
    ends=st.lists(st.one_of(st.none(), st.floats(0, 10 * HOUR)), min_size=1, max_size=12),
    now=st.floats(HOUR, 12 * HOUR),
    limit=st.integers(1, 5),
)
def test_removal_is_deterministic_on_every_member(
    ends: list[float | None], now: float, limit: int
) -> None:
    """Two members applying the same log reach byte-identical states, and nothing that
    is not terminal and past its retention ever leaves."""
    log: list[c.Command] = []
    s = world()
    for end in ends:
        aid = submit(s)
        if end is not None:
            finish(s, aid, 100.0 + end)
    ids = retention.expired(s, now, HOUR, limit)
    log.append(
        c.RemoveAllocations(ids=ids + list(s.allocations)[:2], retention_seconds=HOUR, now=now)
    )
    before = {k: msgspec.structs.replace(a) for k, a in s.allocations.items()}
    t = msgspec.msgpack.Decoder(GlobalState).decode(msgspec.msgpack.encode(s))
    for cmd in log:
        apply(s, cmd)
        apply(t, cmd)
    assert msgspec.msgpack.encode(s) == msgspec.msgpack.encode(t)
    for k, a in before.items():
        if k not in s.allocations:
            assert a.terminal and a.finished_at is not None and now - a.finished_at >= HOUR


def test_a_budgeted_tenant_keeps_its_allocations_for_the_budget_period() -> None:
    """The scheduler's budget penalty reads the period's usage from the state."""
    s = world(tenants={"t": {"node_hours_budget": 100.0}, "free": {}})
    kept, moved = submit(s), submit(s, tenant="free")
    finish(s, kept, 100.0)
    finish(s, moved, 100.0)
    period = 10 * HOUR

    def sweep(now: float) -> None:
        ids = retention.expired(s, now, HOUR, 10, budgeted_seconds=period)
        res = apply(
            s,
            c.RemoveAllocations(
                ids=[kept, moved], retention_seconds=HOUR, budgeted_retention_seconds=period,
                now=now,
            ),
        )  # fmt: skip
        assert res.error is None and sorted(res.removed_ids or []) == sorted(ids)

    sweep(100.0 + 2 * HOUR)
    assert kept in s.allocations and moved not in s.allocations
    sweep(100.0 + period)
    assert kept not in s.allocations
