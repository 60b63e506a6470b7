"""Singleton (mutex) dependencies: at most one allocation per user and mutex name runs."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_common.types import Allocation, AllocationState, Dependency
from lattice_common.watch import StateMirror
from lattice_scheduler import reasons
from lattice_scheduler.decide import queue
from lattice_scheduler.placement import limit_mutexes, limit_task_groups, mutex_keys
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


_kinds = st.sampled_from(["plain", "plain", "mutex", "group", "after"])


@settings(max_examples=150, deadline=None)
@given(
    pending=st.lists(st.tuples(_kinds, st.integers(0, 3), st.integers(0, 5)), max_size=12),
    running=st.lists(st.tuples(_kinds, st.integers(0, 3)), max_size=4),
)
def test_the_cycles_queue_is_both_limits_applied_in_full(
    pending: list[tuple[str, int, int]], running: list[tuple[str, int]]
) -> None:
    """queue() skips a limit that nothing in the queue asks for (most queues ask for
    neither); what it returns is what applying both in full returns, order included."""

    def make(kind: str, n: int, at: float, state: AllocationState) -> Allocation:
        a = b.allocation(vcluster="v", name=f"j{n}", submitted_at=at, state=state)
        if kind == "mutex":
            a.spec.depends_on = [Dependency(f"m{n}", "singleton")]
        elif kind == "after":  # a dependency that is no mutex
            a.spec.depends_on = [Dependency(f"x{n}", "afterok")]
        elif kind == "group":
            a.task_group_id, a.task_group_concurrency, a.task_index = f"g{n % 2}", 1, n
        return a

    queued = [make(k, n, float(at), AllocationState.PENDING) for k, n, at in pending]
    holding = [make(k, n, 0.0, AllocationState.RUNNING) for k, n in running]
    m = StateMirror()
    m.allocations = {a.id: a for a in [*queued, *holding]}
    m.pending = {a.id: None for a in queued}
    m.holding = {a.id: None for a in holding}
    free, _, held = queue(m, "v", ())
    full, limited = limit_task_groups(queued, holding)
    full, waiting = limit_mutexes(full, holding)
    assert [a.id for a in free] == [a.id for a in full]
    assert sorted(held, key=lambda p: p.allocation_id) == sorted(
        [*limited, *waiting], key=lambda p: p.allocation_id
    )
