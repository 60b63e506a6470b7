"""Submit-to-Running latency on an idle dev cluster.

LocalCluster with 1 lattice-server, 2 agents and the default 5 s scheduling cycle, so
only the submission "poke" (a new Pending allocation in the scheduler's watch stream
starts a cycle at once) can make this fast. Sequentially, per sample: POST a trivial
job (``true``) over REST, follow ``GET /api/v1/allocations/{id}/watch`` (NDJSON) and
take the time from just before the POST to the first line that says Running; then
read on until the job is Completed so the cluster is idle again before the next one.

Also reported, as medians over all samples, where the time goes: the POST round trip
(validation + Raft commit), the first observation of each state on the watch stream,
and the server-side ``started_at - submitted_at``. Note: the quorum's AssignNodes
moves an allocation straight from Pending to Running (started_at = the scheduler's
clock), so "Running" means "placed by the scheduler and committed", before the agent
has started the process; ``completed_observed`` is the full submit -> ran -> Completed
time of the trivial job.

    uv run python scripts/bench/submit_latency.py [--runs N] [--samples S] [--quick]

Goal: p50 < 300 ms.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from collections import Counter
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
    latency_summary,
    log,
    median,
    parser,
    percentile,
    r,
    rest_headers,
    runs_of,
)


async def one_sample(session: Any, base: str, body: dict[str, Any]) -> dict[str, Any]:
    """Submit, watch to Running, then to the end. Times are seconds from before the POST."""
    t0 = time.perf_counter()
    async with session.post(base + "/api/v1/allocations", json=body) as resp:
        if resp.status != 201:
            raise RuntimeError(f"submit failed: {resp.status} {await resp.text()}")
        alloc = await resp.json()
    t_post = time.perf_counter() - t0
    seen: dict[str, float] = {}
    last: dict[str, Any] = alloc
    async with session.get(base + f"/api/v1/allocations/{alloc['id']}/watch") as resp:
        if resp.status != 200:
            raise RuntimeError(f"watch failed: {resp.status} {await resp.text()}")
        while True:
            line = await asyncio.wait_for(resp.content.readline(), 60)
            if not line:
                break
            now = time.perf_counter() - t0
            last = json.loads(line)["allocation"]
            seen.setdefault(last["state"], now)
            if last["state"] in TERMINAL:
                break
    server = None
    if last.get("started_at") and last.get("submitted_at"):
        server = last["started_at"] - last["submitted_at"]
    return {
        "id": alloc["id"],
        "post": t_post,
        "running": seen.get("Running"),
        "seen": seen,
        "final_state": last["state"],
        "server_started_minus_submitted": server,
    }


async def run_samples(cluster: Any, n: int, pause: float) -> list[dict[str, Any]]:
    import aiohttp

    base = cluster.rest_url
    body = job_body(cluster, "true", name="bench-latency")
    out = []
    async with aiohttp.ClientSession(headers=rest_headers(cluster.tenant)) as s:
        for i in range(n):
            smp = await one_sample(s, base, body)
            if smp["running"] is None:
                log(f"sample {i}: never saw Running (final {smp['final_state']}); skipped")
            out.append(smp)
            await asyncio.sleep(pause)  # idle again: heartbeats and releases settle
    return out


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=None, help="samples per run (default 20)")
    p.add_argument("--pause", type=float, default=0.2, help="idle seconds between samples")
    p.add_argument("--cycle-interval", type=float, default=5.0)
    args = p.parse_args()
    n_runs = runs_of(args)
    per_run = args.samples or (10 if args.quick else 20)

    runs: list[list[dict[str, Any]]] = []
    cpu: dict[str, Any] = {}
    prof: dict[str, Any] = {}
    with dev_cluster(
        members=1, agents=2, cycle_interval=args.cycle_interval, keep=args.keep
    ) as cluster:
        pids = {n: p.pid for n, p in cluster_procs(cluster).items()}
        # one warm-up job: first fork/exec paths, imports, connections
        asyncio.run(run_samples(cluster, 1, args.pause))
        for i in range(n_runs):
            last = i == n_runs - 1
            with (
                CpuMeter(pids) as m,
                PySpy(args.profile if (last and args.profile) else None, pids) as spy,
            ):
                smp = asyncio.run(run_samples(cluster, per_run, args.pause))
            ok = [s["running"] for s in smp if s["running"] is not None]
            log(
                f"run {i + 1}/{n_runs}: {len(ok)} samples, p50 "
                f"{1000 * statistics.median(ok):.0f} ms, max {1000 * max(ok):.0f} ms"
            )
            runs.append(smp)
            cpu, prof = m.result, spy.summary

    allsmp = [s for run in runs for s in run]
    running = [s["running"] for s in allsmp if s["running"] is not None]
    summ = latency_summary(running)

    def med_ms(values: Any) -> float | None:
        return r(1000 * median(v for v in values if v is not None))

    states_seen = sorted(
        {st for s in allsmp for st in s["seen"]},
        key=lambda st: median(s["seen"][st] for s in allsmp if st in s["seen"]),
    )

    out: dict[str, Any] = {
        "p50_ms": summ.get("p50_ms"),
        "p95_ms": summ.get("p95_ms"),
        "samples": len(running),
        "runs": n_runs,
        "p99_ms": summ.get("p99_ms"),
        "max_ms": summ.get("max_ms"),
        "min_ms": summ.get("min_ms"),
        "run_p50s_ms": [
            r(1000 * percentile([s["running"] for s in run if s["running"] is not None], 50))
            for run in runs
        ],
        "missed_running": len(allsmp) - len(running),
        "breakdown_median_ms": {
            "post_roundtrip": med_ms(s["post"] for s in allsmp),
            **{
                f"{st.lower()}_observed": med_ms(s["seen"].get(st) for s in allsmp)
                for st in states_seen
            },
            "server_started_minus_submitted": med_ms(
                s["server_started_minus_submitted"] for s in allsmp
            ),
        },
        "final_states": dict(Counter(s["final_state"] for s in allsmp)),
        "cluster": {"members": 1, "agents": 2, "cycle_interval_s": args.cycle_interval},
        "method": "REST POST then /watch NDJSON; sequential; job `true`; "
        "wait for Completed between samples",
        "goal_p50_ms": 300,
        "cpu_last_run": cpu,
    }
    if prof:
        out["profile"] = prof
    emit(out)


if __name__ == "__main__":
    main()
