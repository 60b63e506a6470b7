"""The heap keeper: a large long-lived state leaves the full collections' walk as soon
as one is slow, while garbage made afterwards is still collected and dropped records are
still freed."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
from lattice_common.heap import GC_PAUSE, HeapKeeper
from lattice_common.types import Allocation
from lattice_test_harness import builders as b


def _keeper(freeze_after_s: float) -> Iterator[HeapKeeper]:
    # a keeper this process may run is set aside: only the one under test acts
    others = [cb for cb in gc.callbacks if isinstance(getattr(cb, "__self__", None), HeapKeeper)]
    for cb in others:
        gc.callbacks.remove(cb)
    gc.unfreeze()
    gc.collect()
    k = HeapKeeper(freeze_after_s=freeze_after_s)
    gc.callbacks.append(k._on_gc)
    try:
        yield k
    finally:
        gc.callbacks.remove(k._on_gc)
        gc.callbacks.extend(others)
        gc.unfreeze()
        gc.collect()


@pytest.fixture
def heap() -> Iterator[HeapKeeper]:
    # every full collection counts as slow: the policy acts on each one
    yield from _keeper(0.0)


@pytest.fixture
def patient_heap() -> Iterator[HeapKeeper]:
    yield from _keeper(3600.0)


def state(n: int) -> dict[str, Allocation]:
    return {f"a{i}": b.allocation(id=f"a{i}") for i in range(n)}


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_after_a_slow_full_collection_the_next_walks_only_what_is_new(
    heap: HeapKeeper,
) -> None:
    records = state(20_000)
    gc.collect()
    assert heap.full_collections >= 1 and heap.longest_full_s > 0
    frozen = gc.get_freeze_count()
    assert frozen >= 20_000 * 3  # each record, its spec and constraints at least
    # what the next full collection walks: only what was made since
    assert len(gc.get_objects(generation=2)) < 1_000
    more = state(5_000)
    gc.collect(1)
    assert 5_000 <= len(gc.get_objects(generation=2)) < frozen
    assert len(records) == 20_000 and len(more) == 5_000


def test_a_quick_full_collection_freezes_nothing(patient_heap: HeapKeeper) -> None:
    records = state(20_000)
    gc.collect()
    assert patient_heap.full_collections >= 1
    assert gc.get_freeze_count() == 0
    assert len(gc.get_objects(generation=2)) >= 20_000
    assert len(records) == 20_000


def test_garbage_made_after_a_freeze_is_still_collected(heap: HeapKeeper) -> None:
    records = state(20_000)
    gc.collect()
    assert gc.get_freeze_count() > 0
    c = Cycle()
    ref = weakref.ref(c)
    del c
    gc.collect()
    assert ref() is None
    assert len(records) == 20_000


def test_frozen_records_dropped_are_freed_at_once(patient_heap: HeapKeeper) -> None:
    records = state(20_000)
    patient_heap.freeze()  # as after a Raft dump is loaded
    frozen = gc.get_freeze_count()
    records.clear()
    # reference counts free them, no collection needed
    assert gc.get_freeze_count() < frozen - 20_000


def test_every_collection_is_observed_by_generation(patient_heap: HeapKeeper) -> None:
    total, full = GC_PAUSE.labels("2")._sum.get(), patient_heap.full_collections
    young = GC_PAUSE.labels("0")._sum.get()
    gc.collect()
    gc.collect(0)
    assert patient_heap.full_collections == full + 1
    assert GC_PAUSE.labels("2")._sum.get() > total
    assert GC_PAUSE.labels("0")._sum.get() > young
