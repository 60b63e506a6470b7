"""Durable submission throughput over gRPC.

One lattice-server (LocalCluster members=1, agents=0: nothing runs, allocations stay
Pending; the vCluster's scheduler still runs and still reacts to every submission).
``--clients`` concurrent clients (asyncio tasks, one grpclib Channel each) call
AllocationService.Submit back to back until ``--total`` submissions are acknowledged.
The server acknowledges only after the Raft commit, so every acknowledged submission is
durable. Afterwards the number of allocations in the server is checked against the
number acknowledged.

The load generator shares the machine's cores with the server, so the clients are
spread over ``--procs`` worker processes (default 2, 16 clients each); they connect and
warm up first, then start together; the rate is acknowledged submissions / (last
finish - first start) on the system-wide monotonic clock. Medians over runs, all on one
cluster.

    uv run python scripts/bench/submit_throughput.py [--runs N] [--quick]

Goal: >= 1,000 submissions/s (spec: API throughput > 1000 req/s).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    CpuMeter,
    PySpy,
    cluster_procs,
    count_allocations,
    dev_cluster,
    emit,
    grpc_channel,
    grpc_metadata,
    latency_summary,
    log,
    median,
    parser,
    r,
    runs_of,
)


def _spec(tenant: str, vcluster: str) -> Any:
    from lattice_common.proto.lattice import v1

    return v1.SubmitRequest(
        allocation=v1.AllocationSpec(
            entrypoint="true",
            tenant=tenant,
            vcluster=vcluster,
            nodes=1,
            walltime_seconds=600,
            name="bench-submit",
        )
    )


async def _client_proc(
    address: str, n_clients: int, quota: list[int], tenant: str, vcluster: str, start: Any
) -> dict[str, Any]:
    from grpclib.exceptions import GRPCError
    from lattice_common.proto.lattice import v1

    channels = [grpc_channel(address) for _ in range(n_clients)]
    stubs = [v1.AllocationServiceStub(ch, metadata=grpc_metadata()) for ch in channels]
    req = _spec(tenant, vcluster)
    try:
        # connect + warm up every channel (these submissions are counted separately)
        await asyncio.gather(*(s.submit(req, timeout=30) for s in stubs))
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, start.wait)
        lat: list[float] = []
        errors: list[str] = []
        acked = 0

        async def client(stub: Any, n: int) -> None:
            nonlocal acked
            for _ in range(n):
                t = time.perf_counter()
                try:
                    resp = await stub.submit(req, timeout=60)
                except (GRPCError, OSError) as e:
                    errors.append(repr(e)[:200])
                    continue
                lat.append(time.perf_counter() - t)
                acked += len(resp.allocation_ids)

        cpu0 = time.process_time()
        t0 = time.monotonic()
        await asyncio.gather(*(client(s, n) for s, n in zip(stubs, quota, strict=True)))
        t1 = time.monotonic()
        return {
            "t0": t0,
            "t1": t1,
            "acked": acked,
            "warmup": len(stubs),
            "errors": errors[:5],
            "n_errors": len(errors),
            "lat": lat,
            "cpu_s": time.process_time() - cpu0,
        }
    finally:
        for ch in channels:
            ch.close()


def _worker(args: tuple[Any, ...]) -> dict[str, Any]:
    address, n_clients, quota, tenant, vcluster, start = args
    return asyncio.run(_client_proc(address, n_clients, quota, tenant, vcluster, start))


def one_run(cluster: Any, *, total: int, clients: int, procs: int, profile: Any) -> dict[str, Any]:
    address = cluster.leader().grpc_address
    # split total over clients as evenly as possible, clients over processes
    per_client = [total // clients + (1 if i < total % clients else 0) for i in range(clients)]
    groups = [per_client[i::procs] for i in range(procs)]
    before = count_allocations(cluster)
    pids = {n: p.pid for n, p in cluster_procs(cluster).items()}
    ctx = mp.get_context("spawn")
    with ctx.Manager() as mgr:
        start = mgr.Event()
        with ctx.Pool(procs) as pool:
            pending = pool.map_async(
                _worker,
                [(address, len(g), g, cluster.tenant, cluster.vclusters[0], start) for g in groups],
            )
            time.sleep(0.5)  # let workers spawn and warm up; they wait on `start`
            deadline = time.monotonic() + 60
            # wait until every worker's warm-up submission is committed
            while count_allocations(cluster) < before + clients and time.monotonic() < deadline:
                time.sleep(0.2)
            with PySpy(profile, pids) as spy:
                meter = CpuMeter(pids).start()
                start.set()
                results = pending.get(timeout=1800)
                meter.stop()
    t0 = min(x["t0"] for x in results)
    t1 = max(x["t1"] for x in results)
    acked = sum(x["acked"] for x in results)
    warm = sum(x["warmup"] for x in results)
    after = count_allocations(cluster)
    elapsed = t1 - t0
    cpu = {
        n: (
            {**v, "cpu_ms_per_submit": r(1000 * (v["cpu_s"] or 0) / max(acked, 1), 3)}
            if n != "machine"
            else v
        )
        for n, v in meter.result.items()
        if n != "this-process"  # the coordinator only waits
    }
    client_cpu = sum(x["cpu_s"] for x in results)
    cpu["clients(all procs)"] = {
        "cpu_s": r(client_cpu),
        "cores": r(client_cpu / elapsed),
        "cpu_ms_per_submit": r(1000 * client_cpu / max(acked, 1), 3),
    }
    lat = [v for x in results for v in x["lat"]]
    return {
        "allocations_before": before,
        "submits_per_s": r(acked / elapsed, 1),
        "elapsed_s": r(elapsed, 3),
        "acked": acked,
        "errors": sum(x["n_errors"] for x in results),
        "error_samples": [e for x in results for e in x["errors"]][:5],
        "server_count_delta": after - before,
        "expected_delta": acked + warm,
        "durable_count_ok": after - before == acked + warm,
        **{f"submit_{k}": v for k, v in latency_summary(lat).items() if k in ("p50_ms", "p99_ms")},
        "cpu": cpu,
        "profile": spy.summary,
    }


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--procs", type=int, default=2, help="client worker processes")
    p.add_argument("--total", type=int, default=None, help="submissions per run (5000)")
    p.add_argument(
        "--no-scheduler",
        action="store_true",
        help="stop the vCluster's scheduler after start-up (isolates the server; diagnostic)",
    )
    args = p.parse_args()
    n_runs = runs_of(args)
    total = args.total or (1000 if args.quick else 5000)
    procs = max(1, min(args.procs, args.clients))

    results = []
    with dev_cluster(members=1, agents=0, keep=args.keep) as cluster:
        if args.no_scheduler:
            for proc in cluster.schedulers.values():
                proc.terminate()
                proc.wait(10)
            log("scheduler stopped (--no-scheduler)")
        for i in range(n_runs):
            last = i == n_runs - 1
            res = one_run(
                cluster,
                total=total,
                clients=args.clients,
                procs=procs,
                profile=args.profile if (last and args.profile) else None,
            )
            log(
                f"run {i + 1}/{n_runs}: {res['submits_per_s']}/s, acked {res['acked']}, "
                f"errors {res['errors']}, count ok {res['durable_count_ok']}"
            )
            results.append(res)
    last = results[-1]
    out: dict[str, Any] = {
        "clients": args.clients,
        "submits_per_s": r(median(x["submits_per_s"] for x in results), 1),
        "total": total,
        "runs": n_runs,
        "run_rates": [x["submits_per_s"] for x in results],
        "acked_total": sum(x["acked"] for x in results),
        "errors": sum(x["errors"] for x in results),
        "durable_count_ok": all(x["durable_count_ok"] for x in results),
        "submit_p50_ms": r(median(x.get("submit_p50_ms") for x in results)),
        "submit_p99_ms": r(median(x.get("submit_p99_ms") for x in results)),
        "scheduler_running": not args.no_scheduler,
        "note": f"{args.clients} grpclib clients (one Channel each) in {procs} worker "
        "processes on the same machine as the server (machine cores shared); each run on the "
        "same 1-member cluster, so later runs see a larger state (more Pending allocations)",
        "goal_submits_per_s": 1000,
        "by_run": [
            {
                "allocations_before": x["allocations_before"],
                "submits_per_s": x["submits_per_s"],
                **{
                    f"{n}_cpu_ms_per_submit": v.get("cpu_ms_per_submit")
                    for n, v in x["cpu"].items()
                    if n != "machine"
                },
                "machine_busy_cores": x["cpu"].get("machine", {}).get("busy_cores"),
            }
            for x in results
        ],
        "cpu_last_run": last["cpu"],
    }
    if last.get("error_samples"):
        out["error_samples"] = last["error_samples"]
    if last["profile"]:
        out["profile"] = last["profile"]
    emit(out)


if __name__ == "__main__":
    main()
