"""One HPC scheduling cycle without Raft: topology model + scoring + solve + backfill.

Synthetic clusters (seeded, so every run and every machine sees the same input):

* dragonfly groups of ~78 nodes (16 / 64 / 128 groups for 1,000 / 5,000 / 10,000
  nodes); each group mostly one node type (GH200, A100, MI300A, CPU, CPU with CXL),
  10% of other types mixed in; two or three conformance fingerprints per node type
  (85% the group's usual one, 12% drifted, 3% unknown); 1.5% Down, 1% Draining, 5%
  homed in another vCluster;
* about half of the Ready nodes held by running allocations (1-32 nodes, packed in a
  group) with walltimes of 1-24 h started at random times in the past (5% unbounded);
* a pending queue of mixed sizes (1 to 128 nodes), GPU types, features, memory (some
  needing CXL), ``require_conformance`` / ``require_unified_memory`` /
  ``prefer_same_numa`` flags, ``topology`` "", "tight" or "any", walltimes from 10 min
  to 24 h (5% unbounded), 20 tenants (some with hard quotas).

One cycle = ``TopologyModel.from_nodes`` + the scoring context + ``solve`` (which
scores every pending allocation, places, reserves and backfills with depth 10). The
score is ``lattice_scheduler.cost.score`` with ``cost.build_context`` when that module
is importable (``"score": "lattice_scheduler.cost.score"``), otherwise a stand-in of a
few float operations per allocation (``"score": "stand-in"``).

Estimated start times (``lattice_scheduler.estimate``), measured on the same input:

* ``estimate_overhead_ratio``: median cycle time with estimates on / median with them
  off, both measured in the same process, interleaved run by run. "On" is the same
  cycle plus ``estimate.from_decision`` on its decision (its proposals and
  reservations), which is what the live loop adds inside the cycle;
  ``estimate_from_decision_s`` is that addition's median alone;
* the forward simulation, which the live loop runs between cycles: the cluster as a
  ``StateMirror`` and the scheduler's own decision on it (``decide_vcluster``, timed
  once as ``decide_vcluster_s``); per measured run one ``Simulation`` is built
  (``simulation_setup_s``: median) and up to 3 of its steps are timed
  (``simulation_step_s``: median over all of them; ``simulation_steps_timed``);
* ``estimate_coverage_1s``: the fraction of the pending allocations that have an
  estimate (``now``, ``reservation`` or ``simulation``) after a fresh ``Simulation``
  ran for at most 1.0 s of wall time (``Simulation.run`` with a deadline, checked
  between steps), ``estimate_coverage_steps`` the steps it made;
  ``estimate_coverage_detail``: its wall time, whether it finished, how far ahead it
  simulated, the estimates per basis and the size of the decision it started from;
  ``peak_rss_with_simulation_mb``: peak RSS after all this (``peak_rss_mb`` is taken
  after the cycles, before the simulation).

Each size runs in its own subprocess (peak RSS of one size does not pollute the
next): one warm-up cycle, then ``--runs`` measured cycles on the same input (the
solver does not mutate it; ``median_s``, ``min_s``, ``max_s`` and the breakdown are
these cycles, without estimates), each paired with a cycle with estimates, then the
simulation measurements. Progress goes to stderr; the last line of stdout is one JSON
list with an object per size:
``{"pending", "nodes", "groups", "median_s", "min_s", "max_s", "peak_rss_mb", ...,
"estimate_overhead_ratio", "simulation_setup_s", "simulation_step_s",
"estimate_coverage_1s", "estimate_coverage_steps", ...}``.

    uv run python scripts/bench/scheduler_cycle.py [--runs N] [--quick] [--profile DIR]

Goals on the 2-core dev machines: median < 0.5 s, 1.5 s, 3 s (the specification's
targets are 5 s, 15 s, 30 s).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import log, median, r
from lattice_common.types import (
    Allocation,
    AllocationSpec,
    AllocationState,
    Constraints,
    CostWeights,
    LifecycleType,
    Node,
    NodeCapabilities,
    NodeState,
    Tenant,
    VCluster,
)
from lattice_common.watch import StateMirror
from lattice_scheduler import estimate
from lattice_scheduler.decide import CycleDecision, decide_vcluster
from lattice_scheduler.solver import solve
from lattice_scheduler.topology import TopologyModel

SIZES = [(100, 1_000, 16), (500, 5_000, 64), (1_000, 10_000, 128)]
GOALS_S = {1_000: 0.5, 5_000: 1.5, 10_000: 3.0}
SIM_STEPS_PER_RUN = 3  # Simulation.step() calls timed per measured run
COVERAGE_BUDGET_S = 1.0  # wall time given to one Simulation for estimate_coverage_*
VCLUSTER = "hpc"
NOW = 1_750_000_000.0
H = 3600

# (share, gpu_type, gpu_count, memory_gb, features, fingerprints)
NODE_TYPES = [
    (0.40, "GH200", 4, 512, ["nvme_scratch"], ["gh-a", "gh-b", "gh-c"]),
    (0.20, "A100", 8, 1024, ["nvme_scratch"], ["a100-a", "a100-b"]),
    (0.10, "MI300A", 4, 512, [], ["mi-a", "mi-b"]),
    (0.20, "", 0, 256, ["single_numa"], ["cpu-a", "cpu-b"]),
    (0.10, "", 0, 512, ["cxl_memory_gb=2048"], ["cxl-a", "cxl-b"]),
]
SIZES_DIST = [(1, 35), (2, 15), (4, 15), (8, 12), (16, 10), (32, 7), (64, 4), (128, 2)]
WALLTIMES = [600, 1800, H, 2 * H, 4 * H, 12 * H, 24 * H]


# --- synthetic input ---------------------------------------------------------------------


def make_nodes(rng: random.Random, count: int, groups: int) -> dict[str, Node]:
    group_type: list[int] = []
    for t, (share, *_rest) in enumerate(NODE_TYPES):
        group_type += [t] * round(share * groups)
    group_type = (group_type + [0] * groups)[:groups]
    nodes: dict[str, Node] = {}
    for i in range(count):
        g = i * groups // count
        t = group_type[g] if rng.random() < 0.9 else rng.randrange(len(NODE_TYPES))
        _, gpu_type, gpu_count, mem, feats, fps = NODE_TYPES[t]
        roll = rng.random()
        fp = fps[g % len(fps)] if roll < 0.85 else rng.choice(fps) if roll < 0.97 else ""
        roll = rng.random()
        state = NodeState.DOWN if roll < 0.015 else NodeState.DRAINING if roll < 0.025 else None
        nid = f"x{g:03d}n{i:05d}"
        nodes[nid] = Node(
            id=nid,
            hostname=nid,
            state=state or NodeState.READY,
            group=g,
            conformance_group=fp,
            capabilities=NodeCapabilities(
                cpu_cores=72,
                memory_gb=mem,
                gpu_type=gpu_type,
                gpu_count=gpu_count,
                features=list(feats),
            ),
            home_vcluster="other" if rng.random() < 0.05 else "",
        )
    return nodes


def make_running(
    rng: random.Random, nodes: dict[str, Node], tenants: list[str]
) -> list[Allocation]:
    """Hold about half of the Ready nodes with packed running allocations."""
    by_group: dict[int, list[Node]] = {}
    for n in nodes.values():
        if n.state == NodeState.READY:
            by_group.setdefault(n.group, []).append(n)
    running: list[Allocation] = []
    for _g, members in sorted(by_group.items()):
        target = len(members) // 2
        rng.shuffle(members)
        pos = 0
        while pos < target:
            size = min(rng.choice([1, 2, 4, 8, 16, 32]), target - pos)
            held = members[pos : pos + size]
            pos += size
            aid = f"r{len(running):06d}"
            walltime = (
                0 if rng.random() < 0.05 else rng.choice([H, 2 * H, 4 * H, 8 * H, 12 * H, 24 * H])
            )
            started = NOW - rng.uniform(0, 0.95 * (walltime or 24 * H))
            tenant = rng.choice(tenants)
            a = Allocation(
                id=aid,
                spec=AllocationSpec(
                    entrypoint="true",
                    tenant=tenant,
                    vcluster=VCLUSTER,
                    nodes=size,
                    walltime_seconds=walltime,
                    lifecycle=LifecycleType.UNBOUNDED if walltime == 0 else LifecycleType.BOUNDED,
                ),
                state=AllocationState.RUNNING,
                assigned_nodes=[n.id for n in held],
                submitted_at=started - 600,
                started_at=started,
            )
            for n in held:
                n.owner = aid
                n.owner_tenant = tenant
                n.owner_vcluster = VCLUSTER
            running.append(a)
    return running


def make_pending(
    rng: random.Random, count: int, nodes: int, tenants: list[str]
) -> list[Allocation]:
    sizes, weights = zip(*SIZES_DIST, strict=True)
    out: list[Allocation] = []
    for i in range(count):
        size = min(rng.choices(sizes, weights)[0], max(1, nodes // 8))
        t = rng.choices(range(len(NODE_TYPES)), [x[0] for x in NODE_TYPES])[0]
        _, gpu_type, gpu_count, _mem, feats, _fps = NODE_TYPES[t]
        c = Constraints()
        features: list[str] = []
        if gpu_type:
            c.gpu_type = gpu_type if rng.random() < 0.8 else ""
            c.gpu_count = gpu_count if rng.random() < 0.3 else 0
            if not c.gpu_type and rng.random() < 0.3:
                features.append("require_unified_memory")
        elif "cxl_memory_gb=2048" in feats and rng.random() < 0.5:
            c.memory_gb = 1024
            features.append("allow_cxl_memory")
        else:
            c.memory_gb = rng.choice([0, 0, 128, 256])
        if "nvme_scratch" in feats and rng.random() < 0.3:
            features.append("nvme_scratch")
        if size > 1 and rng.random() < 0.15:
            features.append("require_conformance")
        if rng.random() < 0.1:
            features.append("prefer_same_numa")
        c.features = features
        c.topology = rng.choices(["", "tight", "any"], [60, 25, 15])[0]
        walltime = 0 if rng.random() < 0.05 else rng.choice(WALLTIMES)
        out.append(
            Allocation(
                id=f"p{i:06d}",
                spec=AllocationSpec(
                    entrypoint="true",
                    tenant=rng.choice(tenants),
                    vcluster=VCLUSTER,
                    nodes=size,
                    walltime_seconds=walltime,
                    lifecycle=LifecycleType.UNBOUNDED if walltime == 0 else LifecycleType.BOUNDED,
                    preemption_class=rng.randrange(10),
                    constraints=c,
                ),
                submitted_at=NOW - rng.uniform(0, 2 * 86400),
            )
        )
    return out


def make_tenants(rng: random.Random, nodes: int) -> dict[str, Tenant]:
    out = {}
    for i in range(20):
        name = f"tenant{i:02d}"
        quota = i < 2  # two tenants with hard quotas, generous enough to bind late
        out[name] = Tenant(
            name=name,
            max_nodes=nodes // 10 if quota else None,
            max_concurrent_allocations=max(10, nodes // 100) if quota else None,
            fair_share_target=rng.choice([0.02, 0.05, 0.1]),
        )
    return out


# --- the cycle -------------------------------------------------------------------------


def standin_scorer(ctx: dict[str, Any]):  # type: ignore[no-untyped-def]
    """A few float operations per allocation, shaped like f1..f9 (balanced HPC weights)."""
    now = ctx["now"]
    usage = ctx["usage"]
    targets = ctx["targets"]
    backlog = ctx["backlog"]

    def score(a: Allocation) -> float:
        s = a.spec
        f1 = s.preemption_class / 10.0
        f2 = math.log1p(max(0.0, now - a.submitted_at) / 3600.0)
        target = targets.get(s.tenant, 0.0)
        f3 = max(0.0, target - usage.get(s.tenant, 0.0)) / target if target > 0 else 0.0
        return 0.2 * f1 + 0.2 * f2 + 0.2 * f3 + 0.15 * 0.5 + 0.1 * 0.5 + 0.05 * backlog + 0.1 * 0.5

    return score


def scorer_for(state: SimpleNamespace) -> tuple[Any, str]:
    try:
        from lattice_scheduler import cost
    except Exception:  # not there (yet): the stand-in
        cost = None
    if cost is not None and hasattr(cost, "score") and hasattr(cost, "build_context"):
        ctx = cost.build_context(state, NOW, vcluster=VCLUSTER)
        weights = CostWeights()
        cost_score = cost.score
        return (lambda a: cost_score(a, ctx, weights)), "lattice_scheduler.cost.score"
    held: Counter[str] = Counter()
    for a in state.running:
        held[a.spec.tenant] += len(a.assigned_nodes)
    total = len(state.nodes) or 1
    ctx = {
        "now": NOW,
        "usage": {t: n / total for t, n in held.items()},
        "targets": {t.name: t.fair_share_target for t in state.tenants.values()},
        "backlog": min(1.0, len(state.pending) / max(1, len(state.running))),
    }
    return standin_scorer(ctx), "stand-in"


def cycle(state: SimpleNamespace, depth: int = 10) -> dict[str, Any]:
    t0 = time.perf_counter()
    topo = TopologyModel.from_nodes(state.nodes)
    t1 = time.perf_counter()
    score, which = scorer_for(state)
    t2 = time.perf_counter()
    res = solve(
        state.pending_list,
        state.nodes,
        state.running,
        score=score,
        now=NOW,
        backfill_depth=depth,
        vcluster=VCLUSTER,
        tenants=state.tenants,
        topology=topo,
    )
    t3 = time.perf_counter()
    return {
        "total_s": t3 - t0,
        "topology_s": t1 - t0,
        "context_s": t2 - t1,
        "solve_s": t3 - t2,
        "score": which,
        "result": res,
    }


def cycle_with_estimates(state: SimpleNamespace, depth: int) -> dict[str, Any]:
    """The same cycle, plus what the live loop adds inside it for estimated start times:
    ``estimate.from_decision`` on the cycle's decision (its proposals and reservations;
    wrapping the solver's result as a ``CycleDecision`` is not timed, the live loop
    gets one from ``decide_vcluster``)."""
    c = cycle(state, depth)
    res = c["result"]
    d = CycleDecision(proposals=list(res.proposals), reservations=list(res.reservations))
    t0 = time.perf_counter()
    estimate.from_decision(d, NOW)
    c["from_decision_s"] = time.perf_counter() - t0
    c["total_s"] += c["from_decision_s"]
    return c


def mirror_of(state: SimpleNamespace, depth: int) -> StateMirror:
    """The synthetic cluster as the scheduler's StateMirror (for ``decide_vcluster`` and
    ``estimate.Simulation``); shares the node and allocation objects, which neither
    changes."""
    m = StateMirror()
    m.nodes = state.nodes
    m.allocations = state.allocations
    m.tenants = state.tenants
    m.vclusters = {VCLUSTER: VCluster(name=VCLUSTER, backfill_depth=depth)}
    m.pending = dict(state.pending)
    m.holding = dict(state.holding)
    return m


def simulation_run(m: StateMirror, decision: CycleDecision) -> dict[str, Any]:
    """One measured Simulation: its setup, then up to SIM_STEPS_PER_RUN steps, each timed."""
    t0 = time.perf_counter()
    sim = estimate.Simulation(m, VCLUSTER, NOW, decision)
    setup = time.perf_counter() - t0
    steps: list[float] = []
    while not sim.done and len(steps) < SIM_STEPS_PER_RUN:
        t0 = time.perf_counter()
        sim.step()
        steps.append(time.perf_counter() - t0)
    return {"setup_s": setup, "steps_s": steps}


def estimate_coverage(m: StateMirror, decision: CycleDecision) -> dict[str, Any]:
    """A fresh Simulation run for at most COVERAGE_BUDGET_S of wall time (checked between
    steps, as the live loop's budget is): how much of the queue has an estimate then."""
    t0 = time.perf_counter()
    deadline = t0 + COVERAGE_BUDGET_S
    sim = estimate.Simulation(m, VCLUSTER, NOW, decision)
    steps = 0

    def keep_going() -> bool:
        nonlocal steps
        if time.perf_counter() >= deadline:
            return False
        steps += 1  # run() steps once for every True
        return True

    est = sim.run(keep_going)
    pending = [i for i in m.pending if m.allocations[i].spec.vcluster == VCLUSTER]
    covered = sum(1 for i in pending if i in est)
    return {
        "coverage": covered / max(1, len(pending)),
        "steps": steps,
        "wall_s": time.perf_counter() - t0,
        "done": sim.done,
        "simulated_s": sim.t - NOW,
        "bases": dict(Counter(est[i].estimate_basis for i in pending if i in est)),
    }


def child(
    pending: int, count: int, groups: int, *, runs: int, seed: int, depth: int, profile: str | None
) -> None:
    rng = random.Random(seed)
    tenant_map = make_tenants(rng, count)
    nodes = make_nodes(rng, count, groups)
    running = make_running(rng, nodes, sorted(tenant_map))
    queue = make_pending(rng, pending, count, sorted(tenant_map))
    state = SimpleNamespace(
        allocations={a.id: a for a in [*running, *queue]},
        nodes=nodes,
        tenants=tenant_map,
        pending={a.id: None for a in queue},
        holding={a.id: None for a in running},
        pending_list=queue,
        running=running,
    )
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cycle(state, depth)  # warm-up
    cycle_with_estimates(state, depth)
    # estimates off / on, interleaved run by run (alternating which goes first)
    samples: list[dict[str, Any]] = []
    with_est: list[dict[str, Any]] = []
    for i in range(runs):
        if i % 2:
            with_est.append(cycle_with_estimates(state, depth))
            samples.append(cycle(state, depth))
        else:
            samples.append(cycle(state, depth))
            with_est.append(cycle_with_estimates(state, depth))
    peak_cycles = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    last = samples[-1]
    # the scheduler's own decision on the same input, for the simulation
    m = mirror_of(state, depth)
    t0 = time.perf_counter()
    decision = decide_vcluster(m, VCLUSTER, NOW)
    decide_s = time.perf_counter() - t0
    estimate.Simulation(m, VCLUSTER, NOW, decision).step()  # warm-up
    sims = [simulation_run(m, decision) for _ in range(runs)]
    coverage = estimate_coverage(m, decision)
    res = last["result"]
    prof_top: list[dict[str, Any]] = []
    if profile:
        import cProfile
        import pstats

        out = Path(profile)
        out.mkdir(parents=True, exist_ok=True)
        prof = cProfile.Profile()
        prof.enable()
        cycle(state, depth)
        prof.disable()
        path = out / f"scheduler_cycle_{count}.prof"
        prof.dump_stats(path)
        stats = pstats.Stats(prof)
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:12]  # type: ignore[attr-defined]
        prof_top = [
            {
                "function": f"{Path(f).name}:{ln}:{fn}",
                "calls": nc,
                "self_s": r(tt, 4),
                "cum_s": r(ct, 4),
            }
            for (f, ln, fn), (_cc, nc, tt, ct, _callers) in rows
        ]
    times = [s["total_s"] for s in samples]
    ready = sum(1 for n in nodes.values() if n.state == NodeState.READY)
    free = sum(1 for n in nodes.values() if n.state == NodeState.READY and not n.owner)
    obj: dict[str, Any] = {
        "pending": pending,
        "nodes": count,
        "groups": groups,
        "median_s": r(median(times), 4),
        "min_s": r(min(times), 4),
        "max_s": r(max(times), 4),
        "peak_rss_mb": r(peak_cycles, 1),  # before the simulation measurements
        "rss_before_cycles_mb": r(rss_before, 1),
        "runs": runs,
        "backfill_depth": depth,
        "goal_s": GOALS_S.get(count),
        "score": last["score"],
        "breakdown_median_s": {
            k: r(median(s[k] for s in samples), 4) for k in ("topology_s", "context_s", "solve_s")
        },
        "input": {
            "ready_nodes": ready,
            "free_nodes": free,
            "running_allocations": len(running),
            "pending_nodes_requested": sum(a.spec.nodes for a in queue),
        },
        "outcome": {
            "proposals": len(res.proposals),
            "nodes_placed": sum(len(p.node_ids) for p in res.proposals),
            "backfilled": sum(1 for p in res.proposals if p.backfilled),
            "multi_group": sum(1 for p in res.proposals if p.groups_spanned > 1),
            "mean_conformance_fitness": r(
                sum(p.conformance_fitness for p in res.proposals) / max(1, len(res.proposals)), 3
            ),
            "reservations": len(res.reservations),
            "pending_reasons": dict(Counter(p.reason for p in res.pending)),
        },
    }
    med_off = median(times)
    med_on = median(s["total_s"] for s in with_est)
    step_times = [x for s in sims for x in s["steps_s"]]
    obj.update(
        {
            "estimate_overhead_ratio": r(med_on / med_off if med_off > 0 else None, 4),
            "estimate_from_decision_s": r(median(s["from_decision_s"] for s in with_est), 6),
            "decide_vcluster_s": r(decide_s, 4),
            "simulation_setup_s": r(median(s["setup_s"] for s in sims), 4),
            "simulation_step_s": r(median(step_times), 4),
            "simulation_steps_timed": len(step_times),
            "estimate_coverage_1s": r(coverage["coverage"], 4),
            "estimate_coverage_steps": coverage["steps"],
            "peak_rss_with_simulation_mb": r(
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1
            ),
            "estimate_coverage_detail": {
                "wall_s": r(coverage["wall_s"], 3),
                "done": coverage["done"],
                "simulated_ahead_s": r(coverage["simulated_s"], 0),
                "bases": coverage["bases"],
                "decision": {
                    "proposals": len(decision.proposals),
                    "borrowed": len(decision.borrowed),
                    "reservations": len(decision.reservations),
                },
            },
        }
    )
    if prof_top:
        obj["profile_top_cumulative"] = prof_top
    print(json.dumps(obj), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=None, help="measured cycles per size (default 5)")
    p.add_argument("--quick", action="store_true", help="1 run of the smallest size (CI)")
    p.add_argument(
        "--profile", metavar="DIR", default=None, help="cProfile one extra cycle per size into DIR"
    )
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--depth", type=int, default=10, help="backfill depth (default 10)")
    p.add_argument(
        "--child", nargs=3, type=int, metavar=("PENDING", "NODES", "GROUPS"), help=argparse.SUPPRESS
    )
    args = p.parse_args()
    runs = args.runs if args.runs is not None else (1 if args.quick else 5)
    if args.child:
        child(
            *args.child, runs=max(1, runs), seed=args.seed, depth=args.depth, profile=args.profile
        )
        return
    sizes = SIZES[:1] if args.quick else SIZES
    results = []
    for pending, count, groups in sizes:
        log(f"{pending} pending / {count} nodes / {groups} groups: {runs} run(s) + warm-up")
        cmd = [sys.executable, __file__, "--child", str(pending), str(count), str(groups)]
        cmd += ["--runs", str(runs), "--seed", str(args.seed), "--depth", str(args.depth)]
        if args.profile:
            cmd += ["--profile", args.profile]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr)
            raise SystemExit(f"size {count} failed (exit {proc.returncode})")
        obj = json.loads(proc.stdout.strip().splitlines()[-1])
        log(
            f"  median {obj['median_s']} s (min {obj['min_s']}, max {obj['max_s']}), "
            f"peak RSS {obj['peak_rss_mb']} MB, score={obj['score']}, outcome {obj['outcome']}"
        )
        log(
            f"  estimates: overhead x{obj['estimate_overhead_ratio']}, simulation setup "
            f"{obj['simulation_setup_s']} s, step {obj['simulation_step_s']} s, coverage "
            f"{obj['estimate_coverage_1s']} after {obj['estimate_coverage_steps']} step(s) in "
            f"{COVERAGE_BUDGET_S:g} s"
        )
        results.append(obj)
    sys.stdout.flush()
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
