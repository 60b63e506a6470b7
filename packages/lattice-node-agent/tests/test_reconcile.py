"""reconcile(): the agent's pure decision of what to start, stop and forget.

Examples for each case, then a property: executing the actions against a model of the
runtime (as Agent.apply_desired does) and reconciling again asks for no further
Start/Stop, also after processes exit on their own (convergence, no restart loops).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_agent.reconcile import Action, Forget, Start, Stop, reconcile
from lattice_common.types import Allocation, AllocationReport, AllocationState
from lattice_test_harness import builders as b

NODE = "n1"


def alloc(aid: str, nodes: list[str], requeue_count: int = 0) -> Allocation:
    a = b.allocation(id=aid, state=AllocationState.RUNNING)
    a.assigned_nodes = list(nodes)
    a.requeue_count = requeue_count
    return a


def running(aid: str) -> AllocationReport:
    return AllocationReport(allocation_id=aid, phase="running", pid=100)


def exited(aid: str, code: int = 0) -> AllocationReport:
    return AllocationReport(allocation_id=aid, phase="exited", exit_code=code)


def test_starts_desired_allocation_on_its_head_node_only() -> None:
    a = alloc("a1", [NODE, "n2", "n3"])
    assert reconcile(NODE, [a], [], {}) == [Start(a)]
    assert reconcile("n2", [a], [], {}) == []
    assert reconcile("n3", [a], [], {}) == []
    assert reconcile("n9", [a], [], {}) == []


def test_allocation_without_nodes_is_not_started() -> None:
    assert reconcile(NODE, [alloc("a1", [])], [], {}) == []


def test_running_and_desired_is_left_alone() -> None:
    a = alloc("a1", [NODE])
    assert reconcile(NODE, [a], [running("a1")], {"a1": 0}) == []


def test_stops_running_allocation_no_longer_desired() -> None:
    assert reconcile(NODE, [], [running("a1")], {"a1": 0}) == [Stop("a1", "cancelled")]


def test_stops_running_allocation_whose_head_moved_elsewhere() -> None:
    a = alloc("a1", ["n2", NODE])
    assert reconcile(NODE, [a], [running("a1")], {"a1": 0}) == [Stop("a1", "cancelled")]


def test_forgets_exited_allocation_no_longer_desired() -> None:
    assert reconcile(NODE, [], [exited("a1", 1)], {"a1": 0}) == [Forget("a1")]


def test_exited_but_still_desired_is_not_restarted() -> None:
    """The exit is reported to the quorum, which ends the allocation; no restart here."""
    a = alloc("a1", [NODE])
    assert reconcile(NODE, [a], [exited("a1")], {"a1": 0}) == []
    # also when the agent lost its attempt bookkeeping (e.g. after a restart)
    assert reconcile(NODE, [a], [exited("a1")], {}) == []


def test_requeued_allocation_restarts_while_running() -> None:
    a = alloc("a1", [NODE], requeue_count=1)
    assert reconcile(NODE, [a], [running("a1")], {"a1": 0}) == [Stop("a1", "requeued"), Start(a)]


def test_requeued_allocation_restarts_after_exit() -> None:
    a = alloc("a1", [NODE], requeue_count=2)
    assert reconcile(NODE, [a], [exited("a1", 137)], {"a1": 1}) == [Forget("a1"), Start(a)]


def test_mixed() -> None:
    keep = alloc("keep", [NODE])
    new = alloc("new", [NODE, "n2"])
    other_head = alloc("other", ["n2", NODE])
    actions = reconcile(
        NODE,
        [keep, new, other_head],
        [running("keep"), running("gone"), exited("old")],
        {"keep": 0, "gone": 0, "old": 0},
    )
    assert sorted(actions, key=repr) == sorted(
        [Stop("gone", "cancelled"), Forget("old"), Start(new)], key=repr
    )


# --- convergence property ------------------------------------------------------------


class Runtime:
    """What Agent.apply_desired does with each action, against an in-memory runtime."""

    def __init__(self, phases: dict[str, str], attempts: dict[str, int]) -> None:
        self.phases = dict(phases)
        self.attempts = dict(attempts)
        self.started: list[tuple[str, int]] = []

    def reports(self) -> list[AllocationReport]:
        return [
            running(aid) if phase == "running" else exited(aid)
            for aid, phase in self.phases.items()
        ]

    def execute(self, actions: list[Action]) -> None:
        for act in actions:
            if isinstance(act, Stop):
                assert act.allocation_id in self.phases, "stop of something not running"
                assert self.phases[act.allocation_id] == "running"
                del self.phases[act.allocation_id]
                self.attempts.pop(act.allocation_id, None)
            elif isinstance(act, Forget):
                assert self.phases.get(act.allocation_id) == "exited"
                del self.phases[act.allocation_id]
                self.attempts.pop(act.allocation_id, None)
            else:
                a = act.allocation
                assert a.id not in self.phases, "double start"
                self.phases[a.id] = "running"
                self.attempts[a.id] = a.requeue_count
                self.started.append((a.id, a.requeue_count))


IDS = [f"a{i}" for i in range(8)]
NODES = [NODE, "n2", "n3"]


@st.composite
def scenario(draw: st.DrawFn) -> tuple[list[Allocation], Runtime, list[str]]:
    desired_ids = draw(st.lists(st.sampled_from(IDS), unique=True, max_size=6))
    desired = [
        alloc(
            aid,
            draw(st.lists(st.sampled_from(NODES), unique=True, max_size=3)),
            requeue_count=draw(st.integers(0, 3)),
        )
        for aid in desired_ids
    ]
    phases = draw(
        st.dictionaries(st.sampled_from(IDS), st.sampled_from(["running", "exited"]), max_size=6)
    )
    attempts = draw(st.dictionaries(st.sampled_from(IDS), st.integers(0, 3), max_size=6))
    exits = draw(st.lists(st.sampled_from(IDS), unique=True, max_size=4))
    return desired, Runtime(phases, attempts), exits


@settings(max_examples=300, deadline=None)
@given(s=scenario())
def test_reconcile_converges(s: tuple[list[Allocation], Runtime, list[str]]) -> None:
    desired, rt, exits = s
    mine = {a.id: a for a in desired if a.assigned_nodes and a.assigned_nodes[0] == NODE}

    rt.execute(reconcile(NODE, desired, rt.reports(), rt.attempts))

    # Exactly the allocations headed here are present, each at its current attempt.
    assert set(rt.phases) == set(mine)
    for aid, a in mine.items():
        assert rt.attempts.get(aid, a.requeue_count) == a.requeue_count
    # Nothing is started twice, nothing not headed here is started.
    assert len(rt.started) == len(set(rt.started))
    assert {aid for aid, _ in rt.started} <= set(mine)

    # Reconciling again: nothing more to do.
    assert reconcile(NODE, desired, rt.reports(), rt.attempts) == []

    # Processes exit on their own: still no Start/Stop (no restart loop).
    for aid in exits:
        if aid in rt.phases:
            rt.phases[aid] = "exited"
    again = reconcile(NODE, desired, rt.reports(), rt.attempts)
    assert not [x for x in again if isinstance(x, (Start, Stop))]
    rt.execute(again)
    assert reconcile(NODE, desired, rt.reports(), rt.attempts) == []

    # Once nothing is desired any more, one pass clears the runtime.
    rt.execute(reconcile(NODE, [], rt.reports(), rt.attempts))
    assert rt.phases == {}
    assert reconcile(NODE, [], rt.reports(), rt.attempts) == []


def test_checkpointing_allocation_is_stopped_but_kept_for_its_report() -> None:
    a = alloc("a", ["n1"])
    a.state = AllocationState.CHECKPOINTING
    assert reconcile("n1", [a], [running("a")], {"a": 0}) == [Stop("a", "preempted", keep=True)]
    # once it has exited it is neither restarted nor forgotten while still desired
    assert reconcile("n1", [a], [exited("a", 143)], {"a": 0}) == []
