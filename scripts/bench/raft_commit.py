"""Raft commit latency and pipelined commit throughput of a 3-member quorum.

Primary ("rpc") variant: three real ``lattice-server`` processes (LocalCluster,
members=3, agents=0); commits are driven through the leader's internal gRPC
QuorumService.Propose with lattice_common.rpc.RemoteQuorum -- exactly the path a
scheduler's AssignNodes takes. Each commit is an ``UpdateTenant`` of a tenant made for
the benchmark (small, does not grow the state).

Secondary ("inproc") variant, labelled ``in_process_leader`` in the JSON: the leader is
a QuorumMember inside this process and proposals call ``member.propose`` directly (what
the API does for a REST/gRPC submit); the two followers are bare QuorumMember
processes (_raft_member.py). The difference between the two is the gRPC hop plus the
client's CPU.

Per run: warm-up, ``--seq`` sequential single commits (latency), then ``--pipelined``
commits with ``--concurrency`` in flight (commits/s; the server micro-batches
everything proposed in one loop iteration into one Raft entry). Medians over runs.

    uv run python scripts/bench/raft_commit.py [--runs N] [--quick] [--variant rpc|inproc|both]

Goals (issue): p99 < 15 ms, >= 5,000 commits/s. Spec: 3-member p99 < 50 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    CpuMeter,
    PySpy,
    cluster_procs,
    dev_cluster,
    emit,
    latency_summary,
    log,
    median_of_runs,
    parser,
    r,
    runs_of,
)

BENCH_TENANT = "bench-raft"
Propose = Callable[[Any], Awaitable[Any]]


def make_cmd(i: int) -> Any:
    from lattice_common import commands as c

    return c.UpdateTenant(
        name=BENCH_TENANT, fields={"fair_share_target": float(i % 1000)}, now=time.time()
    )


async def measure(
    propose: Propose,
    *,
    n_seq: int,
    n_pipe: int,
    concurrency: int,
    pids: dict[str, int],
    warmup: int = 50,
) -> dict[str, Any]:
    errors = 0

    async def one(i: int) -> None:
        nonlocal errors
        res = await propose(make_cmd(i))
        if getattr(res, "error", None) is not None:
            errors += 1

    for i in range(warmup):
        await one(i)

    seq: list[float] = []
    for i in range(n_seq):
        t0 = time.perf_counter()
        await one(i)
        seq.append(time.perf_counter() - t0)

    nxt = 0
    pipe_lat: list[float] = []

    async def worker() -> None:
        nonlocal nxt
        while nxt < n_pipe:
            i = nxt
            nxt += 1
            t0 = time.perf_counter()
            await one(i)
            pipe_lat.append(time.perf_counter() - t0)

    meter = CpuMeter(pids).start()
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, n_pipe))))  # n_pipe may be 0
    elapsed = time.perf_counter() - t0
    cpu = meter.stop()
    out: dict[str, Any] = {**latency_summary(seq)}
    out["pipelined_commits_per_s"] = r(n_pipe / elapsed, 1) if n_pipe else None
    out["pipelined_elapsed_s"] = r(elapsed, 3)
    pl = latency_summary(pipe_lat)
    out["pipelined_p50_ms"] = pl.get("p50_ms")
    out["pipelined_p99_ms"] = pl.get("p99_ms")
    out["errors"] = errors
    # CPU per commit during the pipelined phase: where the cores go
    out["pipelined_cpu"] = {
        n: (
            {**v, "cpu_ms_per_commit": r(1000.0 * (v["cpu_s"] or 0) / max(n_pipe, 1), 3)}
            if n != "machine"
            else v
        )
        for n, v in cpu.items()
    }
    return out


KEYS = (
    "p50_ms",
    "p95_ms",
    "p99_ms",
    "max_ms",
    "pipelined_commits_per_s",
    "pipelined_p50_ms",
    "pipelined_p99_ms",
)


# --- variant 1: real lattice-server processes, gRPC Propose to the leader ---------------


def run_rpc(args: Any, n_runs: int) -> dict[str, Any]:
    from lattice_common.rpc import Endpoints, RemoteQuorum

    with dev_cluster(members=3, agents=0, keep=args.keep) as cluster:
        leader = cluster.leader()
        log(f"leader is member {leader.id} ({leader.grpc_address})")
        cluster._post(leader.rest_url + "/api/v1/tenants", {"name": BENCH_TENANT}, True)
        pids = {n: p.pid for n, p in cluster_procs(cluster).items()}

        def term() -> int:
            st = cluster._get(cluster.leader().rest_url + "/api/v1/raft/status", quiet=True)
            return int((st or {}).get("term", -1))

        async def go() -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
            results = []
            cpu: dict[str, Any] = {}
            prof: dict[str, Any] = {}
            for i in range(n_runs):
                # aim at the current leader every run: a proposal sent to a follower is
                # forwarded by pysyncobj and costs another append-entries round
                leader = cluster.leader()
                term0 = term()
                quorums = [
                    RemoteQuorum(Endpoints(leader.grpc_address)) for _ in range(args.channels)
                ]
                rr = 0

                async def propose(cmd: Any, quorums: list[Any] = quorums) -> Any:
                    nonlocal rr
                    rr += 1
                    return await quorums[rr % len(quorums)].propose(cmd)

                try:
                    with PySpy(
                        args.profile and i == n_runs - 1 and Path(args.profile) / "rpc", pids
                    ) as spy:
                        res = await measure(
                            propose,
                            n_seq=args.seq,
                            n_pipe=args.pipelined,
                            concurrency=args.concurrency,
                            pids=pids,
                        )
                finally:
                    for q in quorums:
                        q.endpoints.close()
                res["leader"] = leader.id
                res["elections_during_run"] = max(0, term() - term0)
                cpu, prof = res.pop("pipelined_cpu"), spy.summary
                log(f"rpc run {i + 1}/{n_runs}: {json.dumps(res)}")
                results.append(res)
            return results, cpu, prof

        async def via_follower() -> dict[str, Any]:
            """Sequential commits sent to a follower's gRPC: pysyncobj forwards them."""
            leader = cluster.leader()
            follower = next(m for m in cluster.members if m.id != leader.id)
            q = RemoteQuorum(Endpoints(follower.grpc_address))
            try:
                res = await measure(
                    q.propose, n_seq=max(50, args.seq // 2), n_pipe=0, concurrency=1, pids={}
                )
            finally:
                q.endpoints.close()
            return {
                "what": f"sequential commits sent to follower {follower.id} (leader {leader.id})",
                **{k: res.get(k) for k in ("p50_ms", "p95_ms", "p99_ms", "max_ms")},
            }

        results, cpu, prof = asyncio.run(go())
        forwarded = asyncio.run(via_follower())
        log(f"via follower: {json.dumps(forwarded)}")
    out = {**median_of_runs(results, KEYS), "pipelined_cpu_last_run": cpu}
    out["errors"] = sum(x["errors"] for x in results)
    out["via_follower"] = forwarded
    out["elections_during_runs"] = sum(x["elections_during_run"] for x in results)
    out["by_run"] = [
        {
            k: x.get(k)
            for k in (
                "leader",
                "elections_during_run",
                "p50_ms",
                "p99_ms",
                "pipelined_commits_per_s",
            )
        }
        for x in results
    ]
    if prof:
        out["profile"] = prof
    return out


# --- variant 2: leader in this process, followers as bare member processes -------------------


def run_inproc(args: Any, n_runs: int) -> dict[str, Any]:
    from lattice_cli.devcluster import free_port
    from lattice_common import commands as c
    from lattice_common.types import Tenant
    from lattice_quorum.member import QuorumMember

    base = Path(tempfile.mkdtemp(prefix="lattice-bench-raft-"))
    ports = {i: free_port() for i in (1, 2, 3)}
    addr = {i: f"127.0.0.1:{p}" for i, p in ports.items()}
    followers: list[subprocess.Popen[bytes]] = []
    member: QuorumMember | None = None
    try:
        for i in (2, 3):
            peers = {k: v for k, v in addr.items() if k != i}
            followers.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(Path(__file__).parent / "_raft_member.py"),
                        "--id",
                        str(i),
                        "--bind",
                        addr[i],
                        "--peers",
                        json.dumps(peers),
                        "--data-dir",
                        str(base / f"m{i}"),
                        "--min-timeout",
                        "5",
                        "--max-timeout",
                        "8",
                        "--append-entries-period",
                        str(args.append_entries_period),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=open(base / f"m{i}.log", "wb"),  # noqa: SIM115
                    start_new_session=True,
                )
            )

        async def go() -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
            nonlocal member
            member = QuorumMember(
                node_id=1,
                bind=addr[1],
                peers={k: v for k, v in addr.items() if k != 1},
                data_dir=base / "m1",
                bootstrap=True,
                append_entries_period=args.append_entries_period,
            )
            member.attach_loop(asyncio.get_running_loop())
            deadline = time.monotonic() + 30
            while not member.is_leader:
                if time.monotonic() > deadline:
                    raise TimeoutError("in-process member did not become leader in 30s")
                await asyncio.sleep(0.05)
            log("in-process member 1 is leader")
            await member.propose(c.CreateTenant(tenant=Tenant(name=BENCH_TENANT), now=time.time()))
            pids = {"leader+driver(self)": os.getpid()}
            pids.update({f"follower-{i}": p.pid for i, p in zip((2, 3), followers, strict=True)})
            results = []
            cpu: dict[str, Any] = {}
            prof: dict[str, Any] = {}
            for i in range(n_runs):
                with PySpy(
                    args.profile and i == n_runs - 1 and Path(args.profile) / "inproc", pids
                ) as spy:
                    res = await measure(
                        member.propose,
                        n_seq=args.seq,
                        n_pipe=args.pipelined,
                        concurrency=args.concurrency,
                        pids={k: v for k, v in pids.items() if "self" not in k},
                    )
                cpu, prof = res.pop("pipelined_cpu"), spy.summary
                log(f"inproc run {i + 1}/{n_runs}: {json.dumps(res)}")
                results.append(res)
            return results, cpu, prof

        results, cpu, prof = asyncio.run(go())
    finally:
        if member is not None:
            member.close()
        for p in followers:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
        for p in followers:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    out = {**median_of_runs(results, KEYS), "pipelined_cpu_last_run": cpu}
    out["errors"] = sum(x["errors"] for x in results)
    if prof:
        out["profile"] = prof
    return out


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=("rpc", "inproc", "both"), default="both")
    p.add_argument("--seq", type=int, default=None, help="sequential commits per run (500)")
    p.add_argument("--pipelined", type=int, default=None, help="pipelined commits per run (20000)")
    p.add_argument("--concurrency", type=int, default=256, help="proposals in flight (256)")
    p.add_argument("--channels", type=int, default=4, help="gRPC channels for the rpc variant")
    p.add_argument(
        "--append-entries-period",
        type=float,
        default=0.01,
        help="pysyncobj appendEntriesPeriod for the inproc variant's members (server default "
        "0.01 s); an experiment knob: sequential latency tracks it",
    )
    args = p.parse_args()
    n_runs = runs_of(args)
    args.seq = args.seq or (100 if args.quick else 500)
    args.pipelined = args.pipelined or (2000 if args.quick else 20000)

    out: dict[str, Any] = {"members": 3}
    rpc = inproc = None
    if args.variant in ("rpc", "both"):
        rpc = run_rpc(args, n_runs)
    if args.variant in ("inproc", "both"):
        inproc = run_inproc(args, n_runs)
    # Headline: the Raft quorum itself (leader's propose -> majority commit over
    # loopback). The rpc variant adds one gRPC Propose per command on top; both are kept.
    primary = inproc or rpc
    assert primary is not None
    out["variant"] = "in_process_leader" if inproc else "rpc"
    out["p50_ms"] = primary["p50_ms"]
    out["p99_ms"] = primary["p99_ms"]
    out["pipelined_commits_per_s"] = primary["pipelined_commits_per_s"]
    out["runs"] = n_runs
    out["sequential_commits_per_run"] = args.seq
    out["pipelined_commits_per_run"] = args.pipelined
    out["concurrency"] = args.concurrency
    out["command"] = "UpdateTenant"
    out["goals"] = {"p99_ms": 15, "pipelined_commits_per_s": 5000, "spec_p99_ms": 50}
    if rpc:
        out["rpc"] = {
            "what": "3 lattice-server processes; RemoteQuorum.propose -> leader gRPC "
            f"QuorumService.Propose ({args.channels} channels)",
            **rpc,
        }
    if inproc:
        out["in_process_leader"] = {
            "what": "leader QuorumMember in the benchmark process, member.propose() directly; "
            "2 follower processes",
            "append_entries_period_s": args.append_entries_period,
            **inproc,
        }
    emit(out)


if __name__ == "__main__":
    main()
