"""Durable submission throughput over gRPC.

One lattice-server (LocalCluster members=1, agents=0: nothing runs, allocations stay
Pending; the vCluster's scheduler still runs and still reacts to every submission).
``--clients`` concurrent clients (asyncio tasks, one grpclib Channel each) call
AllocationService.Submit back to back until ``--total`` submissions are acknowledged,
asking for the ids alone (``SubmitRequest.ids_only``, as a bulk submitter would: the
answer of ``sbatch`` is the job id; the full answer, each allocation as committed, costs
the server and the client about 15 % of their CPU per submission).
The server acknowledges only after the Raft commit, so every acknowledged submission is
durable. Afterwards the number of allocations in the server is checked against the
number acknowledged.

The load generator shares the machine's cores with the server, so the clients are
built as Lattice's own gRPC clients are (betterproto2 with ``lattice_common.wire``'s
memoised field defaults) and spread over ``--procs`` worker processes (default 2, 16
clients each); they connect and warm up first, then start together; the rate is acknowledged submissions / (last
finish - first start) on the system-wide monotonic clock. Medians over runs, all on one
cluster.

Cost against state size (``--existing 0,20000,100000``, the default): a fresh cluster per
level is first loaded with that many existing allocations, a mix like a cluster's
history: ``--existing-pending-share`` (5 %) stay Pending, the rest are terminal
(Cancelled). They go in through the normal API in bulk: task groups of 10,000 over REST
(one Raft entry each), then one ``Batch`` of CancelAllocation per 2,000 through the
quorum's gRPC Propose (the scheduler's path), then waits until the server and scheduler
are idle again (the scheduler decodes those deltas long after their commit);
``preload`` reports how long each step took.
``by_existing`` gives the median rate per level, ``flat_ratio`` the largest level's rate
over the empty cluster's (goal >= 0.9).

Slurm anchor (``_slurm.py``, skipped with ``--no-slurm`` or where slurm-wlm cannot be
installed): Debian's slurmctld on this machine, ``--clients`` concurrent ``sbatch --hold
--wrap true`` loops for 10 s, as many windows as ``--runs`` (their median), measured in
the same invocation before the Lattice
clusters start; ``ratio_to_slurm`` = the empty cluster's rate / Slurm's (goal >= 4).

    uv run python scripts/bench/submit_throughput.py [--runs N] [--quick] [--existing 0,20000]

Goal: >= 1,000 submissions/s (spec: API throughput > 1000 req/s), within 10 % at 100,000
existing allocations, >= 4x Slurm's parallel sbatch rate.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    CpuMeter,
    PySpy,
    cluster_procs,
    count_allocations,
    cpu_seconds,
    dev_cluster,
    emit,
    grpc_channel,
    grpc_metadata,
    latency_summary,
    log,
    median,
    parser,
    r,
    rest_headers,
    runs_of,
    work_dir,
)

TASK_GROUP_MAX = 10_000
CANCEL_BATCH = 2_000


def _spec(tenant: str, vcluster: str) -> Any:
    from lattice_common.proto.lattice import v1

    return v1.SubmitRequest(
        ids_only=True,  # an id is all sbatch answers too; the allocation stays readable
        allocation=v1.AllocationSpec(
            entrypoint="true",
            tenant=tenant,
            vcluster=vcluster,
            nodes=1,
            walltime_seconds=600,
            name="bench-submit",
        ),
    )


async def _client_proc(
    address: str, n_clients: int, quota: list[int], tenant: str, vcluster: str, start: Any
) -> dict[str, Any]:
    import lattice_common.wire  # noqa: F401  (as every Lattice gRPC client: memoised message defaults)
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
    before = count_allocations(cluster, "Pending")
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
            while (
                count_allocations(cluster, "Pending") < before + clients
                and time.monotonic() < deadline
            ):
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
    after = count_allocations(cluster, "Pending")
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


def _post_group(cluster: Any, n: int, name: str) -> list[str]:
    body = {
        "entrypoint": "true",
        "tenant": cluster.tenant,
        "vcluster": cluster.vclusters[0],
        "walltime": "10m",
        "nodes": 1,
        "name": name,
        "task_group": f"0-{n - 1}",
    }
    req = urllib.request.Request(
        cluster.leader().rest_url + "/api/v1/allocations",
        data=json.dumps(body).encode(),
        headers=rest_headers(cluster.tenant),
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        return list(json.loads(resp.read())["allocation_ids"])


async def _cancel_all(address: str, ids: list[str]) -> int:
    """CancelAllocation for every id, CANCEL_BATCH per Raft entry; errors counted."""
    from lattice_common import commands as c
    from lattice_common.rpc import Endpoints, RemoteQuorum

    quorum = RemoteQuorum(Endpoints(address), timeout=600)
    errors = 0
    try:
        for k in range(0, len(ids), CANCEL_BATCH):
            now = time.time()
            batch = c.Batch(
                commands=[
                    c.CancelAllocation(allocation_id=i, requested_by="bench", now=now)
                    for i in ids[k : k + CANCEL_BATCH]
                ],
                now=now,
            )
            res = await quorum.propose(batch)
            errors += sum(1 for x in (res.results or []) if x.error)
    finally:
        quorum.endpoints.close()
    return errors


def preload(cluster: Any, existing: int, pending_share: float) -> dict[str, Any]:
    """``existing`` allocations: task groups over REST, then all but the pending share
    cancelled in batches through the quorum (see the module docstring)."""
    n_pending = round(existing * pending_share)
    n_terminal = existing - n_pending
    t0 = time.perf_counter()
    terminal_ids: list[str] = []
    for part, name in ((n_terminal, "bench-history"), (n_pending, "bench-backlog")):
        done = 0
        while done < part:
            k = min(TASK_GROUP_MAX, part - done)
            ids = _post_group(cluster, k, name)
            if name == "bench-history":
                terminal_ids.extend(ids)
            done += k
    t_submit = time.perf_counter() - t0
    errors = asyncio.run(_cancel_all(cluster.leader().grpc_address, terminal_ids))
    t_all = time.perf_counter() - t0
    settle = _settle(cluster)
    log(
        f"preloaded {existing} allocations ({n_terminal} Cancelled, {n_pending} Pending) in "
        f"{t_all:.1f}s (submit {t_submit:.1f}s, cancel {t_all - t_submit:.1f}s); "
        f"processes idle again after {settle:.1f}s"
    )
    return {
        "existing": existing,
        "terminal": n_terminal,
        "pending": n_pending,
        "preload_s": r(t_all),
        "submit_s": r(t_submit),
        "cancel_s": r(t_all - t_submit),
        "cancel_errors": errors,
        "settle_s": r(settle),
    }


def _settle(cluster: Any, timeout: float = 300.0) -> float:
    """Wait until the processes are idle again (below 5 % of a core over a second): the
    scheduler decodes the preload's deltas (100,000 allocations) well after they were
    committed, and that work must not land in the measured window."""
    pids = {n: p.pid for n, p in cluster_procs(cluster).items()}
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        before = {n: cpu_seconds(p) or 0.0 for n, p in pids.items()}
        time.sleep(1.0)
        if all((cpu_seconds(p) or 0.0) - before[n] < 0.05 for n, p in pids.items()):
            break
    return time.perf_counter() - t0


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--procs", type=int, default=2, help="client worker processes")
    p.add_argument("--total", type=int, default=None, help="submissions per run (5000)")
    p.add_argument(
        "--existing",
        default=None,
        help="comma-separated existing-allocation counts, a fresh cluster each "
        "(default 0,20000,100000; --quick 0,1000)",
    )
    p.add_argument("--existing-pending-share", type=float, default=0.05)
    p.add_argument("--no-slurm", action="store_true", help="skip the Slurm anchor")
    p.add_argument("--slurm-seconds", type=float, default=None, help="sbatch window (10)")
    p.add_argument(
        "--no-scheduler",
        action="store_true",
        help="stop the vCluster's scheduler after start-up (isolates the server; diagnostic)",
    )
    args = p.parse_args()
    n_runs = runs_of(args)
    total = args.total or (500 if args.quick else 5000)
    procs = max(1, min(args.procs, args.clients))
    levels = [
        int(x)
        for x in (args.existing or ("0,1000" if args.quick else "0,20000,100000")).split(",")
        if x.strip()
    ]

    slurm: dict[str, Any] = {"available": False, "reason": "--no-slurm"}
    if not args.no_slurm:
        from _slurm import anchor

        log("Slurm anchor: parallel sbatch rate")
        slurm = anchor(
            node_counts=(2,),
            jobs=0,
            submit_clients=args.clients,
            submit_seconds=args.slurm_seconds or (2.0 if args.quick else 10.0),
            submit_windows=1 if args.quick else n_runs,
            keep=args.keep,
        )
        log(f"Slurm: {slurm.get('par_submits_per_s') or slurm.get('reason')}")

    by_level: dict[int, dict[str, Any]] = {}
    for level in levels:
        results = []
        with dev_cluster(members=1, agents=0, keep=args.keep) as cluster:
            loaded = preload(cluster, level, args.existing_pending_share) if level else None
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
                    # each level's last run, in its own directory: the profiles compare
                    profile=f"{args.profile}/existing-{level}" if (last and args.profile) else None,
                )
                log(
                    f"existing {level} run {i + 1}/{n_runs}: {res['submits_per_s']}/s, "
                    f"acked {res['acked']}, errors {res['errors']}, "
                    f"count ok {res['durable_count_ok']}"
                )
                results.append(res)
        by_level[level] = {"preload": loaded, "results": results}

    def rate(level: int) -> float:
        return median(x["submits_per_s"] for x in by_level[level]["results"])

    all_results = [x for v in by_level.values() for x in v["results"]]
    first = by_level[levels[0]]["results"]
    last = all_results[-1]
    base_rate = rate(levels[0])
    slurm_rate = slurm.get("par_submits_per_s")
    out: dict[str, Any] = {
        "clients": args.clients,
        "submits_per_s": r(base_rate, 1),
        "by_existing": {str(lv): r(rate(lv), 1) for lv in levels},
        "flat_ratio": r(rate(levels[-1]) / base_rate, 3) if base_rate else None,
        "slurm_par_submits_per_s": slurm_rate,
        "ratio_to_slurm": r(base_rate / slurm_rate, 2) if slurm_rate else None,
        "total": total,
        "runs": n_runs,
        "run_rates": {
            str(lv): [x["submits_per_s"] for x in v["results"]] for lv, v in by_level.items()
        },
        "acked_total": sum(x["acked"] for x in all_results),
        "errors": sum(x["errors"] for x in all_results),
        "durable_count_ok": all(x["durable_count_ok"] for x in all_results),
        "submit_p50_ms": r(median(x.get("submit_p50_ms") for x in first)),
        "submit_p99_ms": r(median(x.get("submit_p99_ms") for x in first)),
        "scheduler_running": not args.no_scheduler,
        "preload": {str(lv): v["preload"] for lv, v in by_level.items() if v["preload"]},
        "note": f"{args.clients} grpclib clients (one Channel each) in {procs} worker "
        "processes on the same machine as the server (machine cores shared); a fresh "
        "1-member cluster per existing level, runs within a level on the same cluster "
        "(later runs see more Pending allocations)",
        "goal_submits_per_s": 1000,
        "goal_flat_ratio": 0.9,
        "goal_ratio_to_slurm": 4,
        "by_run": [
            {
                "existing": lv,
                "allocations_before": x["allocations_before"],
                "submits_per_s": x["submits_per_s"],
                **{
                    f"{n}_cpu_ms_per_submit": v.get("cpu_ms_per_submit")
                    for n, v in x["cpu"].items()
                    if n != "machine"
                },
                "machine_busy_cores": x["cpu"].get("machine", {}).get("busy_cores"),
            }
            for lv, v in by_level.items()
            for x in v["results"]
        ],
        "cpu_last_run": last["cpu"],
        "work_dir": work_dir(),
        "slurm": {k: v for k, v in slurm.items() if k != "config"},
    }
    if last.get("error_samples"):
        out["error_samples"] = last["error_samples"]
    profiles = {str(lv): v["results"][-1]["profile"] for lv, v in by_level.items()}
    if any(profiles.values()):
        out["profile_by_existing"] = profiles
    emit(out)


if __name__ == "__main__":
    main()
