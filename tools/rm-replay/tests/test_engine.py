"""The replay engine: event semantics, the real scheduler in the loop, preemption."""

from __future__ import annotations

import random

import msgspec
import pytest
from lattice_common.types import (
    Allocation,
    AllocationSpec,
    AllocationState,
    Constraints,
    CostWeights,
    Node,
    NodeCapabilities,
    NodeState,
    Tenant,
    VCluster,
)
from lattice_common.watch import StateMirror
from lattice_scheduler import cost
from lattice_scheduler.solver import solve
from lattice_scheduler.topology import TopologyModel
from rm_replay.engine import Replay, simulate
from rm_replay.model import CancelEvent, CompleteEvent, SubmitEvent, TraceError
from rm_replay.policies import lattice_decide, lattice_queue_order
from rmr_helpers import T0, H, inventory, submit


def by_id(result):
    return {j.id: j for j in result.jobs}


# --------------------------------------------------------------------------- lifecycle


def test_arrival_start_end() -> None:
    r = simulate([submit("a", 10, nodes=2, walltime=H, runtime=1800)], inventory(4, gpus=4))
    (a,) = r.jobs
    assert (a.start, a.end, a.state) == (T0 + 10, T0 + 10 + 1800, "completed")
    assert (a.nodes, a.gpus_per_node, a.node_seconds, a.gpu_seconds) == (2, 4, 3600.0, 14400.0)
    assert (a.preempted_count, a.backfilled, a.walltime, a.runtime) == (0, False, H, 1800.0)
    assert r.makespan == 1800.0 and r.start_time == T0 + 10
    assert r.policy == "lattice" and r.inventory_summary["nodes"] == 4


def test_walltime_kill_and_failure() -> None:
    r = simulate(
        [
            submit("over", 0, walltime=H, runtime=2 * H),
            submit("bad", 0, walltime=H, runtime=60, exit=3),
            submit("exact", 0, walltime=H, runtime=H),
        ],
        inventory(4),
    )
    j = by_id(r)
    assert (j["over"].end, j["over"].state) == (T0 + H, "walltime_exceeded")
    assert (j["bad"].end, j["bad"].state, j["bad"].exit) == (T0 + 60, "failed", 3)
    assert (j["exact"].end, j["exact"].state) == (T0 + H, "completed")


def test_complete_events_give_the_actual_runtime() -> None:
    events = [
        SubmitEvent(t=T0, id="a", tenant="t", walltime=2 * H),
        SubmitEvent(t=T0, id="b", tenant="t", walltime=2 * H),
        CompleteEvent(t=T0 + 99999, id="a", duration=600, exit=1),
    ]
    j = by_id(simulate(events, inventory(2)))
    assert (j["a"].runtime, j["a"].end, j["a"].state) == (600.0, T0 + 600, "failed")
    assert (j["b"].runtime, j["b"].end) == (2 * H, T0 + 2 * H)  # no outcome: its walltime


def test_a_job_without_any_runtime_is_an_input_error() -> None:
    with pytest.raises(TraceError, match="no runtime"):
        simulate([SubmitEvent(t=T0, id="a", tenant="t")], inventory(1))


def test_queueing_and_cycles_on_completion() -> None:
    # one node: b waits for a; a's completion pokes a cycle at once
    r = simulate([submit("a", 0, runtime=100), submit("b", 1, runtime=100)], inventory(1))
    j = by_id(r)
    assert (j["b"].start, j["b"].end) == (T0 + 100, T0 + 200)


def test_without_schedule_on_arrival_work_waits_for_the_interval() -> None:
    r = simulate(
        [submit("a", 0, runtime=10), submit("b", 45, runtime=10)],
        inventory(2),
        schedule_on_arrival=False,
        cycle_interval=30,
    )
    j = by_id(r)
    assert j["a"].start == T0  # the timer starts with the replay
    # a's end at 10 pokes a cycle, which restarts the timer (as the live loop's
    # wait_for does): the next interval cycles are at 40 and 70
    assert j["b"].start == T0 + 70


def test_impossible_jobs_stay_unfinished_and_the_replay_ends() -> None:
    r = simulate([submit("huge", 0, nodes=9), submit("ok", 0)], inventory(4))
    j = by_id(r)
    assert (j["huge"].state, j["huge"].start, j["huge"].end) == ("unfinished", None, None)
    assert j["ok"].state == "completed"


def test_max_time_leaves_work_unfinished() -> None:
    r = simulate(
        [submit("a", 0, walltime=10 * H), submit("b", 0, walltime=10 * H), submit("late", 5 * H)],
        inventory(1),
        max_time=T0 + 2 * H,
    )
    j = by_id(r)
    assert set(j) == {"a", "b"}  # "late" never arrived
    assert (j["a"].state, j["a"].start, j["a"].end) == ("unfinished", T0, None)
    assert j["a"].node_seconds == 2 * H
    assert (j["b"].state, j["b"].start) == ("unfinished", None)
    assert r.end_time == T0 + 2 * H


def test_utilization_samples() -> None:
    r = simulate(
        [
            submit("a", 0, nodes=3, runtime=250, tenant="x"),
            submit("b", 100, runtime=500, tenant="y"),
        ],
        inventory(4, gpus=2),
        sample_interval=100,
    )
    got = [
        (s.t - T0, s.busy_nodes, s.busy_gpus, s.per_tenant_busy_nodes, s.pending) for s in r.samples
    ]
    assert got == [
        (0, 3, 6, {"x": 3}, 0),
        (100, 4, 8, {"x": 3, "y": 1}, 0),
        (200, 4, 8, {"x": 3, "y": 1}, 0),
        (300, 1, 2, {"y": 1}, 0),
        (400, 1, 2, {"y": 1}, 0),
        (500, 1, 2, {"y": 1}, 0),
        (600, 0, 0, {}, 0),
    ]
    assert {s.total_nodes for s in r.samples} == {4} and {s.total_gpus for s in r.samples} == {8}


def test_tenants_vclusters_and_weights_reach_the_mirror() -> None:
    inv = inventory(
        2,
        tenants={"a": {"fair_share_target": 0.5, "max_nodes": 1}},
        vclusters={"ml": {"scheduler_type": "interactive-fifo", "backfill_depth": 2}},
    )
    rp = Replay(
        [
            submit("1", 0, tenant="a", vcluster="ml"),
            submit("2", 0, tenant="b"),
            submit("3", 0, tenant="c"),
        ],
        inv,
        weights_by_vcluster={"hpc": CostWeights(priority=1.0)},
    )
    m = rp.m
    assert rp.default_vcluster == "hpc"  # the only vCluster the weights name
    assert {n: t.fair_share_target for n, t in m.tenants.items()} == {
        "a": 0.5,
        "b": 0.25,
        "c": 0.25,
    }
    assert m.tenants["a"].max_nodes == 1
    assert m.vclusters["hpc"].weights.priority == 1.0
    assert (m.vclusters["ml"].scheduler_type, m.vclusters["ml"].backfill_depth) == (
        "interactive-fifo",
        2,
    )
    assert rp.jobs["2"].alloc.spec.vcluster == "hpc"
    r = rp.run()
    assert r.fair_share_targets == {"a": 0.5, "b": 0.25, "c": 0.25}
    assert r.sim_config["vclusters"]["hpc"]["weights"]["priority"] == 1.0


def test_hard_quota_holds_work_back() -> None:
    inv = inventory(4, tenants={"a": {"max_nodes": 2}})
    j = by_id(
        simulate([submit("1", 0, nodes=2, tenant="a"), submit("2", 0, nodes=2, tenant="a")], inv)
    )
    assert {j["1"].start, j["2"].start} == {T0, T0 + H}


# --------------------------------------------------------------------------- the real solver


def _mirror(seed: int) -> StateMirror:
    """A snapshot: 24 nodes in 3 groups with 2 conformance fingerprints and two GPU
    types, some held by running allocations, a queue of mixed requests."""
    rng = random.Random(seed)
    m = StateMirror()
    for i in range(24):
        gpu = "GH200" if i % 3 else "A100"
        m.nodes[f"x{i:02d}"] = Node(
            id=f"x{i:02d}",
            state=NodeState.READY,
            group=i // 8,
            conformance_group="c1" if rng.random() < 0.8 else "c2",
            capabilities=NodeCapabilities(gpu_type=gpu, gpu_count=4, memory_gb=512),
        )
    for t in ("a", "b", "c"):
        m.tenants[t] = Tenant(name=t, fair_share_target=1 / 3)
    m.vclusters["hpc"] = VCluster(name="hpc", weights=CostWeights(), backfill_depth=3)
    now = 1_000_000.0
    ids = sorted(m.nodes)
    rng.shuffle(ids)
    for k in range(4):
        held = ids[k * 3 : k * 3 + 3]
        a = Allocation(
            id=f"r{k}",
            spec=AllocationSpec(
                entrypoint="x",
                tenant="abc"[k % 3],
                vcluster="hpc",
                nodes=3,
                walltime_seconds=3600 * (k + 1),
            ),
            state=AllocationState.RUNNING,
            assigned_nodes=held,
            submitted_at=now - 5000,
            started_at=now - 1000,
        )
        for n in held:
            m.nodes[n].owner = a.id
        m.allocations[a.id] = a
        m.holding[a.id] = None
    for k in range(12):
        a = Allocation(
            id=f"p{k:02d}",
            spec=AllocationSpec(
                entrypoint="x",
                tenant=rng.choice("abc"),
                vcluster="hpc",
                nodes=rng.choice([1, 2, 4, 8, 12]),
                walltime_seconds=rng.choice([600, 3600, 7200]),
                preemption_class=rng.choice([3, 5, 5, 7]),
                constraints=Constraints(gpu_type=rng.choice(["", "GH200", "A100"])),
            ),
            submitted_at=now - rng.uniform(0, 7200),
        )
        m.allocations[a.id] = a
        m.pending[a.id] = None
    return m


@pytest.mark.parametrize("seed", range(8))
def test_the_decision_is_the_real_solvers(seed: int) -> None:
    m = _mirror(seed)
    now = 1_000_000.0
    decision = lattice_decide(m, "hpc", now)
    ctx = cost.build_context(m, now, vcluster="hpc")
    direct = solve(
        [m.allocations[i] for i in m.pending],
        m.nodes,
        [m.allocations[i] for i in m.holding],
        score=lambda a: cost.score(a, ctx, m.vclusters["hpc"].weights),
        now=now,
        backfill_depth=3,
        vcluster="hpc",
        tenants=m.tenants,
    )
    got = [
        (p.allocation_id, p.node_ids, p.backfilled, p.groups_spanned) for p in decision.placements
    ]
    want = [(p.allocation_id, p.node_ids, p.backfilled, p.groups_spanned) for p in direct.proposals]
    assert got == want and got
    assert decision.reservations == direct.reservations
    assert {w.allocation_id: w.reason for w in decision.waiting} == direct.reasons
    # the same with a prebuilt topology model (as the engine passes it)
    again = lattice_decide(m, "hpc", now, topology=TopologyModel.from_nodes(m.nodes))
    assert again.placements == decision.placements
    # the queue order the engine compares is the solver's: with room for everything,
    # proposals come out in that order
    for n in m.nodes.values():
        n.owner = ""
    roomy = lattice_decide(m, "hpc", now)
    small = [p.allocation_id for p in roomy.placements]
    assert [i for i in lattice_queue_order(m, "hpc", now) if i in small] == small


def test_the_engine_calls_the_solver(monkeypatch: pytest.MonkeyPatch) -> None:
    import lattice_scheduler.decide as decide

    calls: list[int] = []
    real = decide.solve

    def counting(pending, *args, **kw):
        calls.append(len(list(pending)) if not isinstance(pending, list) else len(pending))
        return real(pending, *args, **kw)

    monkeypatch.setattr(decide, "solve", counting)
    simulate([submit("a", 0), submit("b", 0)], inventory(2))
    assert calls == [2]


def test_backfill_by_the_real_solver() -> None:
    # 4 nodes; "long" holds 3 until 10 h; "big" (4 nodes) is reserved for 10 h; "short"
    # (1 node, 1 h) backfills on the free node, "longer" (1 node, 20 h) may not
    r = simulate(
        [
            submit("long", 0, nodes=3, walltime=10 * H),
            submit("big", 10, nodes=4, walltime=H),
            submit("longer", 20, nodes=1, walltime=20 * H),
            submit("short", 30, nodes=1, walltime=H),
        ],
        inventory(4),
    )
    j = by_id(r)
    assert j["big"].start == T0 + 10 * H
    assert (j["short"].start, j["short"].backfilled) == (T0 + 30, True)
    assert j["longer"].start == T0 + 11 * H


# --------------------------------------------------------------------------- preemption


def _preemption_trace() -> list[SubmitEvent]:
    return [
        submit("low", 0, nodes=2, walltime=10 * H, runtime=4 * H, preemption_class=1),
        submit("high", H, nodes=2, walltime=H, preemption_class=8),
    ]


def test_preemption_checkpoint_and_requeue() -> None:
    r = simulate(
        _preemption_trace(), inventory(2), checkpoint_success_rate=1.0, checkpoint_seconds=60
    )
    j = by_id(r)
    high, low = j["high"], j["low"]
    assert high.start == T0 + H + 60  # the victim checkpoints for 60 s, then frees its nodes
    assert (low.preempted_count, low.checkpoints_attempted, low.checkpoints_succeeded) == (1, 1, 1)
    assert low.submit == T0 and low.start == T0  # original submit time, first start kept
    assert low.last_start == high.end == T0 + 2 * H + 60
    assert low.end == low.last_start + 3 * H  # one hour of work was kept
    assert low.node_seconds == 2 * (H + 60 + 3 * H)
    assert r.sim_config["preemptions"] == 1
    assert any(c.preempted for c in r.cycles)


def test_a_failed_checkpoint_loses_the_work() -> None:
    r = simulate(_preemption_trace(), inventory(2), checkpoint_success_rate=0.0)
    low = by_id(r)["low"]
    assert (low.checkpoints_attempted, low.checkpoints_succeeded) == (1, 0)
    assert low.end == low.last_start + 4 * H


def test_sensitive_work_is_never_preempted() -> None:
    trace = [
        submit(
            "claim", 0, nodes=2, walltime=10 * H, runtime=4 * H, sensitive=True, preemption_class=10
        ),
        submit("high", H, nodes=2, walltime=H, preemption_class=9),
    ]
    j = by_id(simulate(trace, inventory(2)))
    assert j["claim"].preempted_count == 0 and j["claim"].sensitive
    assert j["high"].start == T0 + 4 * H


def test_checkpoint_draws_depend_on_the_seed_only() -> None:
    trace = [
        # at most 3 victims per preemption (PreemptionPolicy.max_victims): 2 x 2 nodes
        *[
            submit(f"low{i}", 0, nodes=2, walltime=20 * H, runtime=8 * H, preemption_class=1)
            for i in range(2)
        ],
        *[submit(f"hi{i}", H * (1 + i), nodes=4, walltime=H, preemption_class=8) for i in range(6)],
    ]

    def outcome(seed: int) -> list[tuple[int, int]]:
        r = simulate(trace, inventory(4), checkpoint_success_rate=0.5, seed=seed)
        return [(j.checkpoints_attempted, j.checkpoints_succeeded) for j in r.jobs]

    assert outcome(3) == outcome(3)
    assert any(outcome(s) != outcome(3) for s in range(4, 12))
    assert sum(a for a, _ in outcome(3)) >= 6


# --------------------------------------------------------------------------- cancels


def _cancel(aid: str, t: float) -> CancelEvent:
    return CancelEvent(t=T0 + t, id=aid)


def test_a_cancel_while_pending_removes_the_job_and_the_next_one_starts() -> None:
    # one node: a runs 0-100; b and c wait; b is cancelled at 50 while still queued
    trace = [submit("a", 0, runtime=100), submit("b", 1, runtime=100), submit("c", 2, runtime=100)]
    before = by_id(simulate(trace, inventory(1)))
    assert (before["b"].start, before["c"].start) == (T0 + 100, T0 + 200)
    r = simulate([*trace, _cancel("b", 50)], inventory(1))
    j = by_id(r)
    b = j["b"]
    assert (b.state, b.start, b.last_start, b.end) == ("cancelled", None, None, T0 + 50)
    assert (b.node_seconds, b.gpu_seconds) == (0.0, 0.0)
    assert (j["c"].start, j["c"].end, j["c"].state) == (T0 + 100, T0 + 200, "completed")
    assert r.makespan == 200.0
    # the utilization samples count b as queued until its cancel, not after
    s = {
        x.t - T0: x
        for x in simulate([*trace, _cancel("b", 50)], inventory(1), sample_interval=40).samples
    }
    assert (s[40].pending, s[80].pending) == (2, 1)


def test_a_pending_cancel_lifts_the_reservation_it_held() -> None:
    # two nodes: a (1 node) runs 0-1000; b (2 nodes) waits with a reservation at 1000;
    # c (1 node, 2000 s) cannot backfill in front of it. Cancelling b lets c start at
    # the next interval cycle (a removed queue entry frees nothing, so no poke).
    trace = [
        submit("a", 0, walltime=1000, runtime=1000),
        submit("b", 1, nodes=2, walltime=1000, runtime=1000),
        submit("c", 2, walltime=2000, runtime=2000),
    ]
    j = by_id(simulate(trace, inventory(2)))
    assert (j["b"].start, j["c"].start) == (T0 + 1000, T0 + 2000)
    j = by_id(simulate([*trace, _cancel("b", 100)], inventory(2), cycle_interval=30))
    assert (j["b"].state, j["b"].start) == ("cancelled", None)
    assert T0 + 100 < j["c"].start <= T0 + 130
    assert j["c"].start == T0 + 122  # cycles at 2 (c's arrival), 32, 62, 92, 122
    assert j["c"].state == "completed" and not j["c"].backfilled


def test_a_cancel_of_a_job_the_replay_already_started_ends_it_then() -> None:
    # live, "a" never started before its cancel at 300; the replay starts it at once
    trace = [
        submit("a", 0, nodes=2, walltime=H, runtime=1000),
        _cancel("a", 300),
        submit("b", 10, nodes=2, runtime=100),
    ]
    r = simulate(trace, inventory(2, gpus=4))
    j = by_id(r)
    a = j["a"]
    assert (a.state, a.start, a.end, a.last_start) == ("cancelled", T0, T0 + 300, T0)
    assert (a.node_seconds, a.gpu_seconds) == (600.0, 2400.0)  # counted up to the cancel
    # its freed nodes poke the scheduler at once, as a completion does
    assert (j["b"].start, j["b"].end) == (T0 + 300, T0 + 400)
    assert r.makespan == 400.0 and r.end_time == T0 + 400  # a's old end (1000) is void


def test_a_cancel_after_the_job_ended_does_nothing() -> None:
    trace = [submit("a", 0, runtime=100, exit=2)]
    plain = simulate(trace, inventory(1))
    r = simulate([*trace, _cancel("a", 3000)], inventory(1))
    (a,) = r.jobs
    assert (a.state, a.end, a.exit) == ("failed", T0 + 100, 2)
    # and it does not stretch the replay to its time
    assert r.end_time == plain.end_time == T0 + 100
    assert msgspec.json.encode(r.samples) == msgspec.json.encode(plain.samples)


def test_a_job_ending_at_the_cancel_time_ends_on_its_own() -> None:
    # end before cancel at equal times
    (a,) = simulate([submit("a", 0, runtime=100), _cancel("a", 100)], inventory(1)).jobs
    assert (a.state, a.end) == ("completed", T0 + 100)


def test_a_cancel_at_the_submit_time_never_starts_it() -> None:
    # arrival before cancel at equal times, and the cycle after both
    r = simulate([submit("a", 0, runtime=100), _cancel("a", 0)], inventory(1))
    (a,) = r.jobs
    assert (a.state, a.start, a.end, a.node_seconds) == ("cancelled", None, T0, 0.0)
    assert r.cycles == [] and r.makespan == 0.0


def test_a_preempted_job_cancelled_while_requeued_leaves_the_queue() -> None:
    trace = [
        submit("low", 0, nodes=2, walltime=10 * H, runtime=4 * H, preemption_class=1),
        submit("high", H, nodes=2, walltime=H, preemption_class=8),
        _cancel("low", H + 1800),  # requeued after its checkpoint (H + 60), still waiting
    ]
    r = simulate(trace, inventory(2), checkpoint_success_rate=1.0, checkpoint_seconds=60)
    j = by_id(r)
    low = j["low"]
    assert (low.state, low.start, low.preempted_count) == ("cancelled", T0, 1)
    assert low.end == T0 + H + 60  # its last release of nodes: it never ran again
    assert low.node_seconds == 2 * (H + 60)
    assert r.makespan == 2 * H + 60  # high's end; low does not run after high


def test_a_victim_cancelled_during_its_checkpoint_frees_its_nodes_then() -> None:
    trace = [
        submit("low", 0, nodes=2, walltime=10 * H, runtime=4 * H, preemption_class=1),
        submit("high", H, nodes=2, walltime=H, preemption_class=8),
        _cancel("low", H + 30),
    ]
    j = by_id(simulate(trace, inventory(2), checkpoint_seconds=60))
    low = j["low"]
    assert (low.state, low.end, low.checkpoints_attempted) == ("cancelled", T0 + H + 30, 0)
    assert low.node_seconds == 2 * (H + 30)
    assert j["high"].start == T0 + H + 30  # not H + 60: the freed nodes poke a cycle


def test_an_allocation_with_only_a_cancel_and_no_walltime_runs_until_cancelled() -> None:
    # a captured unbounded allocation cancelled before it started: no runtime anywhere
    trace = [SubmitEvent(t=T0, id="a", tenant="t"), _cancel("a", 500)]
    (a,) = simulate(trace, inventory(1)).jobs
    assert (a.state, a.start, a.end, a.runtime) == ("cancelled", T0, T0 + 500, 500.0)
    # queued behind other work it is removed at 500 without ever running
    trace = [
        submit("x", 0, walltime=H),
        SubmitEvent(t=T0 + 1, id="a", tenant="t"),
        _cancel("a", 500),
    ]
    a = by_id(simulate(trace, inventory(1)))["a"]
    assert (a.state, a.start, a.end) == ("cancelled", None, T0 + 500)


def test_cancels_of_unknown_or_not_yet_submitted_jobs_are_input_errors() -> None:
    with pytest.raises(TraceError, match="never submits"):
        simulate([submit("a", 0), _cancel("b", 5)], inventory(1))
    with pytest.raises(TraceError, match="before its submission"):
        simulate([submit("a", 10), _cancel("a", 5)], inventory(1))


# --------------------------------------------------------------------------- skipping


def _random_trace(seed: int, n: int = 120) -> list[SubmitEvent]:
    rng = random.Random(seed)
    out = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(1 / 400)
        wall = rng.choice([0.5, 1, 2, 4, 8]) * H
        out.append(
            submit(
                f"j{i:03d}",
                round(t),
                nodes=rng.choice([1, 1, 2, 3, 4, 6, 8]),
                walltime=wall,
                runtime=round(wall * rng.uniform(0.2, 1.2)),
                tenant=rng.choice(["a", "b", "c"]),
                preemption_class=rng.choice([5, 5, 5, 2, 8]),
                gpu_type=rng.choice(["", "", "GH200"]),
                vcluster=rng.choice(["hpc", "hpc", "ml"]),
            )
        )
    return out


@pytest.mark.parametrize("policy", ["lattice", "easy", "fcfs"])
@pytest.mark.parametrize("seed", [1, 2])
def test_skipping_provably_idle_cycles_changes_nothing(policy: str, seed: int) -> None:
    inv = inventory(
        10,
        groups=2,
        extra=[
            {"name": "g", "count": 6, "gpu_type": "GH200", "gpus": 4, "groups": 1, "vcluster": "ml"}
        ],
    )
    trace = _random_trace(seed)
    fast = simulate(trace, inv, policy=policy, seed=seed)
    full = simulate(trace, inv, policy=policy, seed=seed, skip_unchanged_cycles=False)
    assert msgspec.json.encode(fast.jobs) == msgspec.json.encode(full.jobs)
    assert msgspec.json.encode(fast.samples) == msgspec.json.encode(full.samples)
    assert len(fast.cycles) < len(full.cycles)


def _with_cancels(trace: list[SubmitEvent], seed: int) -> list[SubmitEvent | CancelEvent]:
    """About a quarter of the jobs cancelled, from at once to a day after submission."""
    rng = random.Random(f"cancel:{seed}")
    out: list[SubmitEvent | CancelEvent] = list(trace)
    for ev in trace:
        if rng.random() < 0.25:
            delay = rng.choice([0, 60, 600, 1800, 3 * H, 8 * H, 24 * H])
            out.append(CancelEvent(t=ev.t + delay, id=ev.id))
    return out


@pytest.mark.parametrize("policy", ["lattice", "easy", "fcfs"])
@pytest.mark.parametrize("seed", [1, 2])
def test_skipping_idle_cycles_changes_nothing_with_cancels(policy: str, seed: int) -> None:
    inv = inventory(
        10,
        groups=2,
        extra=[
            {"name": "g", "count": 6, "gpu_type": "GH200", "gpus": 4, "groups": 1, "vcluster": "ml"}
        ],
    )
    trace = _with_cancels(_random_trace(seed), seed)
    fast = simulate(trace, inv, policy=policy, seed=seed)
    full = simulate(trace, inv, policy=policy, seed=seed, skip_unchanged_cycles=False)
    assert msgspec.json.encode(fast.jobs) == msgspec.json.encode(full.jobs)
    assert msgspec.json.encode(fast.samples) == msgspec.json.encode(full.samples)
    assert (fast.makespan, fast.end_time) == (full.makespan, full.end_time)
    # the trace exercises both kinds of cancel, and they change the schedule
    cancelled = [j for j in fast.jobs if j.state == "cancelled"]
    assert any(j.start is None for j in cancelled)
    if policy != "fcfs":  # strict FCFS starts so late that every cancel may find it queued
        assert any(j.start is not None for j in cancelled)
    plain = simulate(_random_trace(seed), inv, policy=policy, seed=seed)
    assert [j.start for j in plain.jobs] != [j.start for j in fast.jobs]


def test_bad_parameters() -> None:
    for kw in (
        {"cycle_interval": 0},
        {"sample_interval": -1},
        {"checkpoint_success_rate": 1.5},
        {"backfill_depth": -1},
        {"policy": "sjf"},
    ):
        with pytest.raises(ValueError):
            simulate([submit("a", 0)], inventory(1), **kw)


def test_assignments_pass_the_quorums_checks() -> None:
    """The engine applies ``lattice_common.assignment`` as the quorum does: a
    placement beyond a hard quota, outside the node range or on an owned node is
    rejected (counted), a valid one runs."""
    from rm_replay.policies import Placement

    trace = [submit("a", 0, nodes=2), submit("b", 0, nodes=1)]
    r = Replay(trace, inventory(4, tenants={"t": {"max_nodes": 2}}))
    ids = {j.ev.id: aid for aid, j in r.jobs.items()}
    for aid in ids.values():
        r._arrive(T0, aid)
    assert not r._assign(T0, Placement(allocation_id=ids["a"], node_ids=("n-0",)))  # range
    assert r._assign(T0, Placement(allocation_id=ids["a"], node_ids=("n-0", "n-1")))
    assert not r._assign(T0, Placement(allocation_id=ids["b"], node_ids=("n-1",)))  # owned
    assert not r._assign(T0, Placement(allocation_id=ids["b"], node_ids=("n-2",)))  # quota
    assert r.rejected == 3
