"""The scheduler's start-time estimate against RM-Replay's replay of the same snapshot.

Property: on a small snapshot (one vCluster, one dragonfly group, one tenant; 1-6
identical nodes, some held by running 1-node allocations with known walltimes, a queue
of 1-6 bounded allocations), the estimate ``lattice_scheduler.estimate.estimate_starts``
gives the top of the queue (``decide.queue_order(...)[0]``, the first allocation in
the solver's order) is never later than the time at which RM-Replay's engine,
replaying that snapshot with every allocation running exactly its full walltime and
nothing new arriving, starts it.

How the snapshot is mapped onto the engine (which replays submissions and has no
notion of a snapshot):

* the inventory is one node class of ``n`` nodes (``rmr_helpers.inventory``);
* each running allocation is a submission with ``runtime = walltime``; before the
  replay runs, it arrives and is assigned its node through the engine's own
  ``_arrive`` / ``_assign`` (the quorum's ``AssignNodes`` checks included) at its
  real start time, ``NOW + remaining - walltime``: so it holds its node with the
  right ``started_at`` and its end event is at ``NOW + remaining``, the expected end
  the estimate uses. It is then left out of the arrival events;
* each pending allocation is a submission with its original submit time (before
  ``NOW``) and preemption class, ``runtime = walltime``; it *arrives* at ``NOW`` (the
  snapshot's time; ``_SnapshotReplay`` moves only the arrival event, the
  allocation keeps its submit time for scoring and ordering), so the replay's first
  cycle is at ``NOW`` on exactly the snapshot's state;
* the snapshot the estimate sees is a ``StateMirror`` copied from the engine's own
  state at that point (nodes with their owners, the engine's allocations, tenants and
  vClusters with their weights), so both sides score and order the same input.

The estimate follows the scheduler where a naive one would not (these were found by
this test and are kept as explicit examples):

1. preemption: a decision's preemptions free the victim's nodes after its checkpoint
   (``estimate.PREEMPTION_RELEASE_SECONDS``, RM-Replay's default ``checkpoint_seconds``)
   and the victim goes back to the queue, held back until its preemptor has started;
   the freed nodes go to the best-scored pending allocation, not necessarily the
   preemptor;
2. a full cluster: the cycle skips the solver and makes no reservation, so the
   estimate asks the solver for the reservation such a cycle would have made (the
   earliest time enough nodes come free), a lower bound however the queue order
   changes between two expected ends.

The estimate being *earlier* than the replay is allowed: as time passes another
allocation can overtake the top and take its reservation.
"""

from __future__ import annotations

import msgspec
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from lattice_common.types import NEVER_PREEMPTED_CLASS, AllocationState
from lattice_common.watch import StateMirror
from lattice_scheduler.decide import decide_vcluster, queue_order
from lattice_scheduler.estimate import estimate_starts
from rm_replay.engine import _ARRIVAL, DEFAULT_VCLUSTER, Replay
from rm_replay.policies import Placement
from rmr_helpers import T0, inventory, submit

NOW = T0 + 86_400.0  # the snapshot's time (a day into the trace's epoch)
VC = DEFAULT_VCLUSTER
MIN = 60.0


class _SnapshotReplay(Replay):
    """The engine, with arrivals no earlier than the snapshot's time (their submit
    times are left as they are)."""

    def _push(self, t: float, kind: int, aid: str, gen: int = 0) -> None:
        super()._push(max(t, NOW) if kind == _ARRIVAL else t, kind, aid, gen)


def snapshot(
    n_nodes: int,
    running: list[tuple[int, int, int] | None],
    pending: list[tuple[int, int, int, int]],
) -> tuple[_SnapshotReplay, StateMirror]:
    """The engine set up at ``NOW`` and the mirror the estimate sees.

    ``running[i]``: (remaining minutes, extra walltime minutes, class) of the 1-node
    allocation on node i, or None (idle). ``pending``: (nodes, walltime minutes, class,
    minutes waited) per queued allocation."""
    events = []
    held: dict[str, tuple[str, float]] = {}  # running id -> (node, start)
    for i, r in enumerate(running[:n_nodes]):
        if r is None:
            continue
        remaining, extra, cls = r
        walltime = (remaining + extra) * MIN
        start = NOW + remaining * MIN - walltime
        aid = f"r{i}"
        events.append(
            submit(aid, start - T0 - 600, walltime=walltime, preemption_class=cls)  # runtime=wall
        )
        held[aid] = (f"n-{i}", start)
    for j, (k, w, cls, waited) in enumerate(pending):
        events.append(
            submit(
                f"p{j}",
                NOW - waited * MIN - T0,
                nodes=min(k, n_nodes),
                walltime=w * MIN,
                preemption_class=cls,
            )
        )
    rp = _SnapshotReplay(events, inventory(n_nodes), default_vcluster=VC)
    for aid, (nid, start) in sorted(held.items(), key=lambda kv: kv[1][1]):
        rp._arrive(start, aid)
        assert rp._assign(start, Placement(allocation_id=aid, node_ids=(nid,), vcluster=VC))
    rp.arrival_order = [a for a in rp.arrival_order if a not in held]

    m = StateMirror()
    m.nodes = {nid: msgspec.structs.replace(n) for nid, n in rp.m.nodes.items()}
    m.tenants, m.vclusters = dict(rp.m.tenants), dict(rp.m.vclusters)
    allocs = [msgspec.structs.replace(rp.jobs[a].alloc) for a in held]
    allocs += [msgspec.structs.replace(rp.jobs[a].alloc) for a in rp.arrival_order]
    m.allocations = {a.id: a for a in allocs}
    m.pending = {a.id: None for a in allocs if a.state == AllocationState.PENDING}
    m.holding = {a.id: None for a in allocs if a.state == AllocationState.RUNNING}
    return rp, m


def check_top(
    n_nodes: int,
    running: list[tuple[int, int, int] | None],
    pending: list[tuple[int, int, int, int]],
) -> None:
    rp, m = snapshot(n_nodes, running, pending)
    top = queue_order(m, VC, NOW)[0]
    d = decide_vcluster(m, VC, NOW)
    est = estimate_starts(m, VC, NOW, d)
    assert top in est, (top, est)  # every running allocation is bounded
    result = rp.run()
    start = {j.id: j.start for j in result.jobs}[top]
    assert start is not None
    assert est[top].estimated_start <= start, (
        f"top {top}: estimated +{est[top].estimated_start - NOW:.0f} s "
        f"({est[top].estimate_basis}), replay starts it at +{start - NOW:.0f} s; "
        f"this cycle's preemptions {d.preemptions}, replay preemptions "
        f"{result.sim_config['preemptions']}"
    )


PENDING = st.lists(
    # (nodes, walltime minutes, preemption class, minutes waited)
    st.tuples(st.integers(1, 6), st.integers(1, 20), st.integers(0, 10), st.integers(0, 120)),
    min_size=1,
    max_size=6,
)


def running_with(classes: st.SearchStrategy[int]) -> st.SearchStrategy:
    # per node: idle, or (remaining minutes, walltime minutes beyond that, class)
    return st.lists(
        st.none() | st.tuples(st.integers(1, 20), st.integers(0, 20), classes),
        min_size=6,
        max_size=6,
    )


@settings(max_examples=50, deadline=None)
@example(  # (1) the top preempts the running allocation: it starts at +60 s
    n_nodes=5, running=[None, None, None, None, (5, 0, 0), None], pending=[(5, 1, 1, 0)]
)
@example(  # (1) p1 (class 1) preempts r0 (class 0), p0 (class 0, the top) takes the node
    n_nodes=1,
    running=[(5, 0, 0), None, None, None, None, None],
    pending=[(1, 1, 0, 7), (1, 1, 1, 0)],
)
@example(  # (2) nothing preemptible, nothing free; p0 overtakes p1 at +100 s and starts at
    # the +120 s cycle, so p1 starts at +300 s; p1's reservation is +180 s
    n_nodes=4,
    running=[(1, 0, 10), (1, 0, 10), (1, 0, 10), (3, 0, 10), None, None],
    pending=[(1, 3, 9, 0), (4, 1, 4, 40)],
)
@given(n_nodes=st.integers(1, 6), running=running_with(st.integers(0, 10)), pending=PENDING)
def test_the_top_of_the_queue_is_never_estimated_later_than_the_replay_starts_it(
    n_nodes, running, pending
) -> None:
    """The property as stated, running and pending allocations of any class (0-10)."""
    check_top(n_nodes, running, pending)


@settings(max_examples=50, deadline=None)
@given(
    n_nodes=st.integers(1, 6),
    running=running_with(st.just(NEVER_PREEMPTED_CLASS)),
    pending=PENDING,
)
def test_with_an_idle_node_and_nothing_preemptible_the_property_holds(
    n_nodes, running, pending
) -> None:
    """Where neither cause applies: no running allocation can be preempted (class 10;
    pending ones of any class) and some node is idle at the snapshot, so the solver runs
    and the top of the queue starts now or gets its reservation, the earliest time
    enough nodes come free; no decision in the replay can start it earlier."""
    assume(any(r is None for r in running[:n_nodes]))
    check_top(n_nodes, running, pending)
