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
from rm_replay.model import CompleteEvent, SubmitEvent, TraceError
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
