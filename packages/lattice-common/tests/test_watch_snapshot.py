"""A snapshot of the mirror's allocations stays as it was taken while deltas apply,
and large deltas decode the same with the collector paused."""

from __future__ import annotations

import gc

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_common.types import AllocationState
from lattice_common.watch import (
    GC_PAUSE_BYTES,
    StateDelta,
    StateMirror,
    decode_delta,
    encode_delta,
)
from lattice_test_harness import builders as b

IDS = [f"a{i}" for i in range(8)]
STATES = [AllocationState.PENDING, AllocationState.RUNNING, AllocationState.COMPLETED]

upsert = st.tuples(st.just("upsert"), st.sampled_from(IDS), st.sampled_from(STATES))
remove = st.tuples(st.just("remove"), st.sampled_from(IDS), st.none())
own = st.tuples(st.just("own"), st.sampled_from(IDS), st.sampled_from(STATES))
resync = st.tuples(st.just("resync"), st.none(), st.none())


def alloc(aid: str, state: AllocationState):
    return b.allocation(id=aid, state=state)


@settings(max_examples=200, deadline=None)
@given(
    start=st.dictionaries(st.sampled_from(IDS), st.sampled_from(STATES)),
    ops=st.lists(st.one_of(upsert, remove, own, resync), max_size=25),
)
def test_a_snapshot_reads_the_allocations_as_taken_plus_its_own_writes(start, ops) -> None:
    m = StateMirror()
    m.apply(
        StateDelta(revision=1, snapshot=True, allocations=[alloc(i, s) for i, s in start.items()])
    )
    snap = m.snapshot_allocations()
    expect = dict(m.allocations)
    rev = 1
    for op, aid, state in ops:
        rev += 1
        if op == "upsert":
            m.apply(StateDelta(revision=rev, allocations=[alloc(aid, state)]))
        elif op == "remove":
            m.apply(StateDelta(revision=rev, removed_allocations=[aid]))
        elif op == "own":
            snap[aid] = expect[aid] = alloc(aid, state)
        else:  # the stream reconnected: a new snapshot replaces the mirror
            m.apply(StateDelta(revision=rev, snapshot=True, allocations=[alloc("z", STATES[0])]))
        assert dict(snap.items()) == expect
        assert len(snap) == len(expect) and sorted(snap) == sorted(expect)
        for i in [*IDS, "z"]:
            assert (i in snap) == (i in expect)
            assert snap.get(i) == expect.get(i)
    # the mirror itself followed every delta; the snapshot's own writes never reached it
    assert all(m.allocations[k] is not snap[k] for k in m.allocations if k in snap._own)


def test_a_dropped_snapshot_costs_the_mirror_nothing() -> None:
    m = StateMirror()
    m.apply(StateDelta(revision=1, snapshot=True, allocations=[alloc("a0", STATES[0])]))
    snap = m.snapshot_allocations()
    assert len(m._snapshots) == 1
    del snap
    gc.collect()
    assert len(m._snapshots) == 0
    m.apply(StateDelta(revision=2, allocations=[alloc("a0", STATES[1])]))
    assert m.allocations["a0"].state == STATES[1]


def test_a_large_delta_decodes_as_a_small_one_and_leaves_the_collector_on() -> None:
    batch = [alloc(f"n{i}", STATES[i % 3]) for i in range(400)]
    raw = encode_delta(StateDelta(revision=7, allocations=batch))
    assert len(raw) >= GC_PAUSE_BYTES
    assert gc.isenabled()
    d = decode_delta(raw)
    assert gc.isenabled()
    assert msgspec.msgpack.encode(d) == raw
    assert (
        decode_delta(encode_delta(StateDelta(revision=7, allocations=batch[:1]))).allocations
        == (batch[:1])
    )
