"""Replay time of a large synthetic trace: 10,000 jobs on 1,000 nodes by default.

The trace is ``rm_replay.generate.synthetic(jobs, nodes, seed)``: HPC 70 % / ML 20 % /
services 10 %, sizes up to 1/8 of the cluster, offered at 100 % load with a backlog
at t=0, on dragonfly groups of 128 nodes, with the specification's weight profiles.
The replay runs in this process (``rm_replay.engine.simulate``, the real scheduler
for ``--policy lattice``); generation is not timed. Progress goes to stderr; the
last line of stdout is one JSON object::

    {"jobs": 10000, "nodes": 1000, "policy": "lattice", "wall_s": ..., "peak_rss_mb": ...,
     "decisions": ..., "decision_s": ..., "simulated_days": ..., ...}

``decision_s`` is the wall time spent in scheduling decisions (``CycleStat.duration_s``
summed), ``wall_s`` the whole replay. Benchmarks are scripts that print JSON, never
timed assertions (ARCHITECTURE.md, section 5).

Measured on the 2-core dev machine (10,000 jobs / 1,000 nodes, 18 simulated days):
lattice 50-55 s (19,756 decisions, 36-41 s in them, mean queue 341; 215 s before the
solver's availability index, the per-model usable-node cache, the scoring memo and
the engine's scoring index), easy 24 s, fcfs 4.4 s; peak RSS 49 MB. ``--quick``
(1,000 / 100): lattice 0.5 s. The lattice time is the real solver's (see the
README's Performance section).

    uv run python tools/rm-replay/scripts/bench_replay.py [--jobs N] [--nodes N]
        [--policy lattice|easy|fcfs] [--seed N] [--quick] [--profile FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import resource
import sys
import time


def _rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=10_000, help="jobs in the trace (default 10000)")
    p.add_argument("--nodes", type=int, default=1_000, help="nodes in the cluster (default 1000)")
    p.add_argument("--policy", default="lattice", choices=["lattice", "easy", "fcfs"])
    p.add_argument("--seed", type=int, default=0, help="generator and replay seed")
    p.add_argument("--quick", action="store_true", help="1,000 jobs on 100 nodes (CI smoke run)")
    p.add_argument("--profile", metavar="FILE", help="write cProfile stats of the replay to FILE")
    args = p.parse_args(argv)
    if args.quick:
        args.jobs, args.nodes = 1_000, 100

    from rm_replay.engine import simulate
    from rm_replay.generate import synthetic

    t0 = time.perf_counter()
    scenario = synthetic(args.jobs, args.nodes, args.seed)
    inventory = scenario.inventory_obj()
    weights = scenario.weights_obj()
    gen_s = time.perf_counter() - t0
    rss_before = _rss_mb()
    print(
        f"[bench] {scenario.name}: {len(scenario.events)} jobs generated in {gen_s:.1f} s; "
        f"replaying with {args.policy}",
        file=sys.stderr,
        flush=True,
    )
    prof = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    result = simulate(
        scenario.events,
        inventory,
        policy=args.policy,
        weights_by_vcluster=weights,
        seed=args.seed,
        trace_name=scenario.name,
    )
    if prof is not None:
        prof.disable()
        prof.dump_stats(args.profile)
    wall = time.perf_counter() - t0
    states: dict[str, int] = {}
    for j in result.jobs:
        states[j.state] = states.get(j.state, 0) + 1
    decisions = result.cycles
    out = {
        "jobs": len(result.jobs),
        "nodes": result.inventory_summary["nodes"],
        "policy": args.policy,
        "wall_s": round(wall, 2),
        "peak_rss_mb": _rss_mb(),
        "rss_before_replay_mb": rss_before,
        "decisions": len(decisions),
        "decision_s": round(sum(c.duration_s for c in decisions), 2),
        "mean_pending_at_decision": round(sum(c.pending for c in decisions) / len(decisions), 1)
        if decisions
        else 0,
        "simulated_days": round((result.end_time - result.start_time) / 86400, 2),
        "makespan_h": round(result.makespan / 3600, 1),
        "states": dict(sorted(states.items())),
        "preemptions": result.sim_config.get("preemptions", 0),
        "seed": args.seed,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
