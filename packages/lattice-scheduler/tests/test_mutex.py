"""Singleton (mutex) dependencies: at most one allocation per user and mutex name runs."""

from __future__ import annotations

from lattice_common.types import AllocationState, Dependency
from lattice_scheduler import reasons
from lattice_scheduler.placement import limit_mutexes, mutex_keys
from lattice_test_harness import builders as b


def job(
    name: str, user: str = "alice", *, at: float = 0.0, running: bool = False, mutex: bool = True
):
    a = b.allocation(
        user=user,
        name=name,
        submitted_at=at,
        state=AllocationState.RUNNING if running else AllocationState.PENDING,
    )
    if mutex:
        a.spec.depends_on = [Dependency(name, "mutex")]
    return a


def test_one_runs_the_next_waits_with_a_reason() -> None:
    running = job("nightly", running=True)
    waiting = job("nightly", at=5.0)
    free, held = limit_mutexes([waiting], [running])
    assert free == []
    assert held[0].allocation_id == waiting.id and held[0].reason == reasons.MUTEX
    assert held[0].text == "waiting for its singleton mutex: another job named 'nightly' runs"


def test_only_the_earliest_of_several_pending_starts_per_cycle() -> None:
    first, second = job("sweep", at=1.0), job("sweep", at=2.0)
    free, held = limit_mutexes([second, first], [])
    assert [a.id for a in free] == [first.id] and [p.allocation_id for p in held] == [second.id]


def test_mutexes_are_per_user_and_per_name() -> None:
    running = job("sweep", "alice", running=True)
    others = [job("sweep", "bob", at=1.0), job("other", "alice", at=2.0), job("x", mutex=False)]
    free, held = limit_mutexes(others, [running])
    assert len(free) == 3 and held == []
    assert mutex_keys(running) == ("alice/sweep",)
