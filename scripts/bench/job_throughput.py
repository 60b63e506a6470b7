"""End-to-end throughput of trivial jobs: submit -> schedule -> run -> Completed.

A dev cluster (LocalCluster: 1 lattice-server, 2 agents, default 5 s scheduling cycle;
a fresh cluster per run). ``--jobs`` one-node jobs running ``true`` are submitted as
fast as possible over REST (``--concurrency`` keep-alive connections); the clock runs
from the first submit until the last of them is Completed (or otherwise terminal),
observed on the quorum's internal WatchState stream (the same stream schedulers use),
so nothing polls. Afterwards the REST list (``?all=true&state=Completed``) is checked.

Where the time goes (``breakdown_last_run.median_segments_ms``), per job on a node, on
the wall clock: (1) assignment committed and seen on the WatchState stream -> the agent
logs "started allocation" (desired-state stream, reconcile, posix_spawn); (2) -> the
agent sees the process exit (``finished_at``; ``/bin/sh`` wrapper + ``true``); (3) ->
the agent logs "exited" (group reaped, exit code settled); (4) -> Completed seen on the
stream (heartbeat RPC, UpdateAllocationState commit); (5) -> the node's next job seen
Running (scheduler: node freed in its stream, poke, cycle, AssignNodes commit). One job
runs per node at a time (nodes are exclusive), so the rate is at most agents / per-job
turnaround; ``process_busy_share`` is the share of the time a job process exists.

With 2 and with 8 agents (``--agents 2,8``, the default; ``--quick``: 2). Before the clock
starts, one 2 s job per agent, until the agents have loaded their eBPF programs (a
compile, once per agent start). ``--work-dir`` puts both sides' files on another file
system (``work_dir`` in the JSON says which): an agent creates and removes some twenty
files and directories per job, which costs far more on some (ext4 without a journal
steps over recently freed inodes at every create) than on tmpfs. Slurm anchor
(``_slurm.py``; ``--no-slurm`` skips it, and it is skipped where slurm-wlm cannot be
installed): Debian's tuned slurmctld with as many slurmd nodes as agents runs the same
number of ``sbatch --wrap true`` jobs (``--concurrency`` concurrent sbatch loops) in the
same invocation, first submit until none is pending, running or completing, as many
runs as Lattice gets on one Slurm cluster (their median); ``slurm_jobs_per_s`` and ``ratio_to_slurm`` per agent count in ``by_agents``, the top
level for the first count.

    uv run python scripts/bench/job_throughput.py [--runs N] [--jobs N] [--agents 2,8] [--quick]
        [--work-dir DIR]

Goal: >= 100 jobs/s; >= 3x Slurm's end-to-end rate at 2 agents, scaling with agents until
the machine's cores are the limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sys
import time
import urllib.request
import uuid
from collections import Counter, defaultdict
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    TERMINAL,
    CpuMeter,
    PySpy,
    cluster_procs,
    dev_cluster,
    emit,
    job_body,
    log,
    median,
    parser,
    r,
    rest_headers,
    runs_of,
    settle_processes,
    wait_until,
    work_dir,
)


async def submit_and_wait(
    cluster: Any,
    n_jobs: int,
    concurrency: int,
    tag: str,
    timeout: float,
    entrypoint: str = "true",
) -> dict[str, Any]:
    import aiohttp
    from lattice_common.rpc import Endpoints, RemoteQuorum

    done: dict[str, tuple[str, float, float]] = {}  # id -> (state, perf_counter, epoch)
    running_seen: dict[str, float] = {}  # id -> epoch when first seen Running (assigned)
    synced = asyncio.Event()
    quorum = RemoteQuorum(Endpoints(cluster.leader().grpc_address))

    async def watch() -> None:
        async for d in quorum.watch():
            now, wall = time.perf_counter(), time.time()
            for a in d.allocations:
                if a.spec.name != tag:
                    continue
                if a.state.value == "Running":
                    running_seen.setdefault(a.id, wall)
                elif a.state.value in TERMINAL and a.id not in done:
                    done[a.id] = (a.state.value, now, wall)
            synced.set()
            if len(done) >= n_jobs:
                return

    watcher = asyncio.create_task(watch())
    await asyncio.wait_for(synced.wait(), 30)
    body = job_body(cluster, entrypoint, name=tag)
    url = cluster.rest_url + "/api/v1/allocations"
    next_i = 0
    submitted: list[str] = []
    errors: list[str] = []
    try:
        async with aiohttp.ClientSession(
            headers=rest_headers(cluster.tenant),
            connector=aiohttp.TCPConnector(limit=concurrency),
        ) as s:

            async def submitter() -> None:
                nonlocal next_i
                while next_i < n_jobs:
                    next_i += 1
                    async with s.post(url, json=body) as resp:
                        if resp.status != 201:
                            errors.append(f"{resp.status} {(await resp.text())[:200]}")
                            continue
                        submitted.append((await resp.json())["id"])

            t0 = time.perf_counter()
            await asyncio.gather(*(submitter() for _ in range(concurrency)))
            t_sub = time.perf_counter() - t0
            if errors:
                log(f"{len(errors)} submissions failed, e.g. {errors[0]}")
            n_ok = len(submitted)
            deadline = t0 + timeout
            while len(done) < n_ok:  # t_end comes from the watch, so 20 ms polling is fine
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"only {len(done)}/{n_ok} jobs finished in {timeout:.0f}s")
                await asyncio.sleep(0.02)
            t_end = max(t for _, t, _ in done.values())
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher
        quorum.endpoints.close()
    return {
        "elapsed_s": t_end - t0,
        "submit_phase_s": t_sub,
        "submitted": len(submitted),
        "submit_errors": len(errors),
        "states": dict(Counter(st for st, _, _ in done.values())),
        "seen": {
            "terminal": {k: w for k, (_, _, w) in done.items()},
            "running": dict(running_seen),
        },
    }


def timeline(cluster: Any, tag: str, seen: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Per-job turnaround on each node, split into segments, all on the wall clock:
    Running / Completed as this script's WatchState stream saw them, "spawned" / "exited"
    from the agent's log, ``finished_at`` from the allocation (agent's clock)."""
    req = urllib.request.Request(
        cluster.rest_url + "/api/v1/allocations?all=true", headers=rest_headers(cluster.tenant)
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        allocs = [a for a in json.loads(resp.read())["allocations"] if a["spec"]["name"] == tag]
    completed = sum(1 for a in allocs if a["state"] == "Completed")
    ev = agent_events(cluster)
    run_seen, done_seen = seen["running"], seen["terminal"]
    by_node: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for a in allocs:
        if a["id"] in run_seen and a.get("assigned_nodes"):
            by_node[a["assigned_nodes"][0]].append(a)
    seg: dict[str, list[float]] = defaultdict(list)
    waits = []
    busy = span = 0.0
    for jobs in by_node.values():
        jobs.sort(key=lambda a: run_seen[a["id"]])
        for a in jobs:
            i = a["id"]
            waits.append(run_seen[i] - a["submitted_at"])
            sp, ex, fin = ev["spawned"].get(i), ev["exited"].get(i), a.get("finished_at")
            if sp is not None:
                seg["1 assign seen -> agent spawned"].append(sp - run_seen[i])
                if fin:
                    seg["2 spawned -> exit seen by agent"].append(fin - sp)
            if ex is not None and fin:
                seg["3 exit -> reaped (agent)"].append(ex - fin)
            if ex is not None and i in done_seen:
                seg["4 reaped -> Completed seen (heartbeat, commit)"].append(done_seen[i] - ex)
        for prev, nxt in pairwise(jobs):
            seg["per-job turnaround on a node"].append(run_seen[nxt["id"]] - run_seen[prev["id"]])
            if prev["id"] in done_seen:
                seg["5 Completed seen -> next assign seen (scheduler)"].append(
                    run_seen[nxt["id"]] - done_seen[prev["id"]]
                )
        spawned = [
            (ev["spawned"][a["id"]], a.get("finished_at"))
            for a in jobs
            if a["id"] in ev["spawned"] and a.get("finished_at")
        ]
        busy += sum(f - s for s, f in spawned)
        if spawned:
            span += spawned[-1][1] - spawned[0][0]
    return {
        "completed_by_rest_list": completed,
        "jobs_per_node": {k: len(v) for k, v in sorted(by_node.items())},
        "median_segments_ms": {k: r(1000 * median(v)) for k, v in sorted(seg.items())},
        "process_busy_share": r(busy / span if span else 0.0, 3),
        "median_queue_wait_ms": r(1000 * median(waits)),
    }


_AGENT_EVENTS = {
    "spawned": re.compile(r"started allocation (\w+):"),
    "exited": re.compile(r"allocation (\w+) exited:"),
}


def agent_events(cluster: Any) -> dict[str, dict[str, float]]:
    """event -> allocation id -> when the agent logged it (epoch s, ms resolution):
    "spawned" right after posix_spawn, "exited" after the group was reaped and the
    exit code settled (just before it reports)."""
    out: dict[str, dict[str, float]] = {k: {} for k in _AGENT_EVENTS}
    for a in cluster.agents:
        path = cluster.log_path(f"agent-{a.node_id}")
        with contextlib.suppress(OSError):
            for line in path.read_text(errors="replace").splitlines():
                if "allocation" not in line:
                    continue
                with contextlib.suppress(ValueError, KeyError):
                    rec = json.loads(line)
                    for ev, rx in _AGENT_EVENTS.items():
                        m = rx.search(rec["msg"])
                        if m:
                            ts = datetime.fromisoformat(rec["ts"].replace("Z", "+00:00"))
                            out[ev][m.group(1)] = ts.timestamp()
    return out


def warm_up(cluster: Any, agents: int, tag: str, timeout: float) -> None:
    """One 2 s job per agent before the clock starts, then until every agent has loaded
    its eBPF programs (where that telemetry source is on): an agent compiles them (about
    a second of a core) at its first collection (every second) that finds an allocation
    running, once per start, and the rate measured is the steady one."""
    asyncio.run(submit_and_wait(cluster, agents, agents, f"{tag}-warmup", timeout, "sleep 2"))

    def ebpf_settled() -> bool:
        for a in cluster.agents:
            text = cluster.log_path(f"agent-{a.node_id}").read_text(errors="replace")
            sources = re.search(r"telemetry: sources ([^\"]*?), \d+ s windows", text)
            if sources is None:
                return False  # telemetry not started yet
            if "ebpf" in sources.group(1) and "eBPF programs" not in text:
                return False  # neither "loaded in" nor "failed to load" yet
        return True

    wait_until("agents' eBPF programs loaded", ebpf_settled, timeout=60.0, interval=0.2)


def run_agents(args: Any, agents: int, n_jobs: int, n_runs: int) -> list[dict[str, Any]]:
    results = []
    for i in range(n_runs):
        last = i == n_runs - 1
        tag = f"bench-jobs-{uuid.uuid4().hex[:8]}"
        with dev_cluster(
            members=1,
            agents=agents,
            cycle_interval=args.cycle_interval,
            keep=args.keep,
        ) as cluster:
            pids = {n: p.pid for n, p in cluster_procs(cluster).items()}
            warm_up(cluster, agents, tag, args.timeout)
            quiet, waited = settle_processes(pids)
            log(f"warm-up: {agents} jobs; cluster {'quiet' if quiet else 'busy'} {waited:.1f}s")
            with (
                CpuMeter(pids) as meter,
                PySpy(args.profile if (last and args.profile) else None, pids) as spy,
            ):
                res = asyncio.run(
                    submit_and_wait(cluster, n_jobs, args.concurrency, tag, args.timeout)
                )
            res.update(timeline(cluster, tag, res.pop("seen")))
        res["jobs_per_s"] = r(res["submitted"] / res["elapsed_s"], 1)
        res["cpu"] = meter.result
        res["profile"] = spy.summary
        log(
            f"{agents} agents run {i + 1}/{n_runs}: {res['jobs_per_s']} jobs/s ({res['submitted']} "
            f"in {res['elapsed_s']:.2f}s; submit phase {res['submit_phase_s']:.2f}s) {res['states']}"
        )
        results.append(res)
    return results


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=None, help="jobs per run (500)")
    p.add_argument("--agents", default=None, help="comma-separated agent counts (2,8)")
    p.add_argument("--concurrency", type=int, default=16, help="concurrent REST submitters")
    p.add_argument("--cycle-interval", type=float, default=5.0)
    p.add_argument("--timeout", type=float, default=600.0, help="per run")
    p.add_argument("--no-slurm", action="store_true", help="skip the Slurm anchor")
    args = p.parse_args()
    n_runs = runs_of(args)
    n_jobs = args.jobs or (100 if args.quick else 500)
    counts = [int(x) for x in (args.agents or ("2" if args.quick else "2,8")).split(",") if x]

    slurm: dict[str, Any] = {"available": False, "reason": "--no-slurm"}
    if not args.no_slurm:
        from _slurm import anchor

        log(f"Slurm anchor: {n_jobs} trivial jobs with {counts} slurmd nodes")
        slurm = anchor(
            node_counts=tuple(counts),
            jobs=n_jobs,
            measure_submit=False,
            e2e_clients=args.concurrency,
            e2e_runs=n_runs,  # the median of as many runs as Lattice gets
            keep=args.keep,
        )
        log(f"Slurm: {slurm.get('jobs_per_s') or slurm.get('reason')}")
    slurm_rates = slurm.get("jobs_per_s") or {}

    by_agents: dict[str, dict[str, Any]] = {}
    per_count: dict[int, list[dict[str, Any]]] = {}
    for agents in counts:
        results = run_agents(args, agents, n_jobs, n_runs)
        per_count[agents] = results
        rate = median(x["jobs_per_s"] for x in results)
        s_rate = slurm_rates.get(str(agents))
        by_agents[str(agents)] = {
            "jobs_per_s": r(rate, 1),
            "run_rates": [x["jobs_per_s"] for x in results],
            "slurm_jobs_per_s": s_rate,
            "ratio_to_slurm": r(rate / s_rate, 2) if s_rate else None,
            "machine_busy_cores": results[-1]["cpu"].get("machine", {}).get("busy_cores"),
        }

    head = by_agents[str(counts[0])]
    results = per_count[counts[0]]
    all_results = [x for v in per_count.values() for x in v]
    last = all_results[-1]
    out: dict[str, Any] = {
        "agents": counts[0],
        "jobs_per_s": head["jobs_per_s"],
        "jobs": n_jobs,
        "runs": n_runs,
        "slurm_jobs_per_s": head["slurm_jobs_per_s"],
        "ratio_to_slurm": head["ratio_to_slurm"],
        "by_agents": by_agents,
        "run_rates": head["run_rates"],
        "submit_phase_s_median": r(median(x["submit_phase_s"] for x in results), 3),
        "submit_errors": sum(x["submit_errors"] for x in all_results),
        "final_states": dict(sum((Counter(x["states"]) for x in all_results), Counter())),
        "completed_by_rest_list": [x["completed_by_rest_list"] for x in all_results],
        "breakdown_last_run": {
            k: last[k]
            for k in (
                "jobs_per_node",
                "median_segments_ms",
                "process_busy_share",
                "median_queue_wait_ms",
            )
        },
        "cluster": {"members": 1, "agents": counts, "cycle_interval_s": args.cycle_interval},
        "work_dir": work_dir(),
        "method": f"{args.concurrency} concurrent REST submitters; completion seen on WatchState; "
        "fresh cluster per run, one 2 s job per agent before the clock starts; Slurm: same job count, as many slurmd as agents, "
        f"{args.concurrency} concurrent sbatch loops, measured first in the same invocation",
        "goal_jobs_per_s": 100,
        "goal_ratio_to_slurm": 3,
        "cpu_last_run": last["cpu"],
        "slurm": {k: v for k, v in slurm.items() if k != "config"},
    }
    if last["profile"]:
        out["profile"] = last["profile"]
    emit(out)


if __name__ == "__main__":
    main()
