"""The quorum at scale: 10,000 simulated nodes and 100,000 pending allocations.

A real 3-member ``lattice-server`` quorum (the dev cluster's layout) and one
``lattice-scheduler`` for the ``default`` vCluster (its own /metrics on a free port).
``--nodes`` simulated agents (``lattice_test_harness.simagents``, ``--processes`` OS
processes, the real gRPC protocol: RegisterNode, a Heartbeat every
``--heartbeat-interval`` seconds spread evenly, one WatchDesiredState stream each, fake
execution) register. One task group per 10,000 fills every node with a job that runs
for the whole benchmark, then ``--pending`` more one-node jobs are submitted in task
groups of 10,000 (the bulk submission path: one Raft entry each), so the cluster is full
and the queue deep, as a busy site is. Then:

* ``heartbeat_cpu_pct``: the leader's CPU (utime+stime from /proc, % of one core) over
  a ``--window`` with heartbeats flowing and nothing submitted, minus the same window
  with the simulated agents' heartbeats paused (streams stay open; the window is short
  enough that no node turns Degraded); ``--runs`` pairs, median. The spec's target is
  < 1 % of the quorum's CPU for 10,000 agents, the issue's goal < 25 % of one core.
* ``cycle_s``: the scheduler's ``lattice_scheduling_cycle_duration_seconds`` (decide,
  proposals, pending reasons) over the measured windows: increase of the sum / increase
  of the count; ``cycle_max_s`` the largest bucket bound reached. Goal < 3 s.
* ``leader_rss_mb``: the leader's resident memory with that state (report).
* ``dump_s`` and ``max_commit_stall_ms``: pysyncobj writes its full dump (log
  compaction) in a forked child; ``quorum.log_compaction_min_time`` is set to
  ``--dump-interval`` so one comes soon. While a steady stream of small proposals
  (``UpdateTenant`` every 10 ms through the leader's gRPC ``QuorumService.Propose``)
  runs, the leader's data dir is watched: ``dump_s`` is from ``raft.dump.tmp``
  appearing to ``raft.dump`` being replaced; ``max_commit_stall_ms`` the longest
  commit of a proposal in flight during it (``commit_max_outside_dump_ms`` for
  comparison). Goal < 100 ms.
* ``failover_s``: SIGKILL the leader; time until one of the two others acknowledges a
  REST submission. Goal < 5 s.

Progress on stderr; the last line of stdout is the JSON object
``{"nodes", "pending", "heartbeat_cpu_pct", "cycle_s", "leader_rss_mb", "failover_s",
"dump_s", "max_commit_stall_ms", ...}`` (``machine`` reports the load of the shared box).

    uv run python scripts/bench/scale.py [--nodes 10000] [--pending 100000] [--quick]
        [--runs 3] [--profile DIR]

``--profile DIR`` runs the members under ``_profiled.py`` and writes a cProfile of the
leader's main thread over the active heartbeat windows to DIR (py-spy is not needed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pstats
import re
import shutil
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    REPO,
    CpuMeter,
    cpu_seconds,
    emit,
    log,
    median,
    parser,
    r,
    rest_headers,
    runs_of,
    stop_cluster,
    wait_until,
)

TASK_GROUP_MAX = 10_000
# a leader saturated by heartbeats answers /healthz late: look for it patiently
LEADER_WAIT = 300.0


def _args() -> Any:
    p = parser(__doc__.split("\n\n")[0], default_runs=3)
    p.add_argument("--nodes", type=int, default=None, help="simulated nodes (10000)")
    p.add_argument("--pending", type=int, default=None, help="pending allocations (100000)")
    p.add_argument("--processes", type=int, default=None, help="simulated-agent processes (4)")
    p.add_argument("--members", type=int, default=3, choices=(1, 3, 5))
    p.add_argument("--heartbeat-interval", type=float, default=10.0)
    p.add_argument(
        "--coalesce-window",
        type=float,
        default=0.1,
        help="seconds of a sim process's heartbeats sent as one BatchHeartbeat (0: one "
        "Heartbeat call each, as real agents)",
    )
    p.add_argument("--window", type=float, default=None, help="seconds per CPU window (15)")
    p.add_argument("--dump-interval", type=float, default=None, help="seconds (60)")
    p.add_argument("--cycle-interval", type=float, default=5.0)
    p.add_argument(
        "--phases",
        default="heartbeats,dump,failover",
        help="what to measure once the state is built (comma-separated; default all)",
    )
    a = p.parse_args()
    a.phases = {x.strip() for x in a.phases.split(",") if x.strip()}
    q = a.quick
    a.nodes = a.nodes or (500 if q else 10_000)
    a.pending = a.pending if a.pending is not None else (2_000 if q else 100_000)
    a.processes = a.processes or (2 if q else 4)
    a.window = a.window or (5.0 if q else 15.0)
    a.dump_interval = a.dump_interval or (15.0 if q else 60.0)
    return a


# --- small HTTP helpers ------------------------------------------------------------------


def http(method: str, url: str, body: Any = None, timeout: float = 60.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=rest_headers())
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            out[name] = float(value)
    return out


def cycle_stats(m: dict[str, float]) -> tuple[float, float, dict[float, float]]:
    """(sum, count, {le: cumulative count}) of the default vCluster's cycle histogram."""
    base = "lattice_scheduling_cycle_duration_seconds"
    s = m.get(f'{base}_sum{{vcluster="default"}}', 0.0)
    n = m.get(f'{base}_count{{vcluster="default"}}', 0.0)
    buckets = {}
    for k, v in m.items():
        mm = re.match(rf'{base}_bucket\{{.*le="([^"]+)".*vcluster="default".*\}}', k) or re.match(
            rf'{base}_bucket\{{vcluster="default",le="([^"]+)"\}}', k
        )
        if mm and mm.group(1) != "+Inf":
            buckets[float(mm.group(1))] = v
    return s, n, buckets


def pct_of_core(used: dict[str, float | None], window: float) -> float:
    """% of one core from the CPU seconds (0.01 s steps), finer than the rounded share."""
    return 100.0 * (used["cpu_s"] or 0.0) / window


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def node_states(cluster: Any) -> dict[str, int]:
    """Nodes per state (and ``_owned``: nodes running an allocation); {} when the
    leader does not answer in time (the callers poll)."""
    try:
        url = cluster.leader(LEADER_WAIT).rest_url + "/api/v1/nodes"
        nodes = http("GET", url, timeout=120)["nodes"]
    except (OSError, ValueError, RuntimeError) as e:
        log(f"node list failed: {e!r}")
        return {}
    out: dict[str, int] = {}
    for n in nodes:
        out[n["state"]] = out.get(n["state"], 0) + 1
    out["_owned"] = sum(1 for n in nodes if n.get("owner"))
    return out


def submit_groups(cluster: Any, count: int, tag: str) -> float:
    """``count`` one-node jobs in task groups of at most 10,000; seconds taken."""
    t0 = time.perf_counter()
    done = 0
    while done < count:
        n = min(TASK_GROUP_MAX, count - done)
        body = {
            "entrypoint": f"sleep infinity # {tag}",
            "tenant": cluster.tenant,
            "vcluster": cluster.vclusters[0],
            "walltime": "24h",
            "nodes": 1,
            "task_group": f"0-{n - 1}",
        }
        http(
            "POST", cluster.leader(LEADER_WAIT).rest_url + "/api/v1/allocations", body, timeout=300
        )
        done += n
        log(f"submitted {done}/{count} {tag}")
    return time.perf_counter() - t0


# --- the cluster --------------------------------------------------------------------------


def make_cluster(base: Path, args: Any, profile_dir: Path | None) -> Any:
    from lattice_cli.devcluster import LocalCluster, free_port

    env = {
        "LATTICE_QUORUM__LOG_COMPACTION_MIN_TIME": str(args.dump_interval),
        # the bench's own modules (_profiled) for the members
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")]
        ).rstrip(os.pathsep),
    }
    if profile_dir is not None:
        env["LATTICE_BENCH_PROFILE_DIR"] = str(profile_dir)

    class ScaleCluster(LocalCluster):
        metrics_port = free_port()

        def start_member(self, m: Any) -> None:
            args_ = ["--config", str(m.dir / "config.yaml")]
            if m.id == 1 and not (m.dir / "raft" / "cluster.json").exists():
                args_.append("--bootstrap")
            if profile_dir is not None:
                m.proc = self._spawn(f"member-{m.id}", "_profiled", ["lattice_api.main", *args_])
            else:
                m.proc = self._spawn(f"member-{m.id}", "lattice_api.main", args_)

        def start_scheduler(self, vcluster: str) -> None:
            # the dev cluster's scheduler, with its /metrics served
            self.schedulers[vcluster] = self._spawn(
                f"scheduler-{vcluster}",
                "lattice_scheduler.main",
                [
                    "--vcluster",
                    vcluster,
                    "--quorum-endpoint",
                    self.grpc_endpoints,
                    "--cycle-interval",
                    str(self.cycle_interval),
                    "--metrics-listen",
                    f"127.0.0.1:{self.metrics_port}",
                ],
            )

    return ScaleCluster(
        base / "cluster",
        members=args.members,
        agents=0,
        vclusters=("default",),
        cycle_interval=args.cycle_interval,
        heartbeat_interval=args.heartbeat_interval,
        env=env,
        tsdb=False,
    )


# --- measurements --------------------------------------------------------------------------


def heartbeat_windows(
    cluster: Any, fleet: Any, args: Any, runs: int, profile_dir: Path | None
) -> dict[str, Any]:
    leader = cluster.leader(LEADER_WAIT)
    pid = leader.proc.pid
    sched = cluster.schedulers["default"].pid
    murl = f"http://127.0.0.1:{cluster.metrics_port}/metrics"
    active: list[float] = []
    paused: list[float] = []
    sched_cpu: list[float] = []
    machine: list[float] = []
    hb_rates: list[float] = []
    batch_rates: list[float] = []  # BatchHeartbeat calls per second (coalesced)
    by_member: list[dict[str, float | None]] = []  # every member's CPU per active window
    cyc0 = cycle_stats(metrics(murl))
    for i in range(runs):
        if profile_dir is not None:
            os.kill(pid, signal.SIGUSR1)
        st0 = fleet.status()
        hb0, batches0 = st0.get("heartbeats", 0), st0.get("heartbeat_batches", 0)
        members = {f"member-{mm.id}": mm.proc.pid for mm in cluster.members if mm.proc is not None}
        m = CpuMeter({"leader": pid, "scheduler": sched, **members}).start()
        time.sleep(args.window)
        res = m.stop()
        by_member.append({k: r(100.0 * (res[k]["cores"] or 0.0)) for k in members if k in res})
        st1 = fleet.status()
        hb_rates.append((st1.get("heartbeats", 0) - hb0) / args.window)
        batch_rates.append((st1.get("heartbeat_batches", 0) - batches0) / args.window)
        if profile_dir is not None:
            os.kill(pid, signal.SIGUSR2)
        active.append(pct_of_core(res["leader"], args.window))
        sched_cpu.append(100.0 * (res["scheduler"]["cores"] or 0.0))
        machine.append(res.get("machine", {}).get("busy_cores") or 0.0)
        fleet.pause()
        time.sleep(1.0)  # heartbeats in flight finish
        m = CpuMeter({"leader": pid}).start()
        time.sleep(args.window)
        res = m.stop()
        fleet.resume()
        paused.append(pct_of_core(res["leader"], args.window))
        log(
            f"run {i + 1}/{runs}: leader {active[-1]:.1f} % with heartbeats, "
            f"{paused[-1]:.1f} % paused; machine busy {machine[-1]:.2f} cores"
        )
        time.sleep(2.0)
    cyc1 = cycle_stats(metrics(murl))
    dn = cyc1[1] - cyc0[1]
    reached = [le for le, v in cyc1[2].items() if v < cyc1[1]]  # some cycle above le
    # leader CPU per heartbeat handled, and what it makes at the nominal rate
    # (nodes / interval): comparable across loads, unlike the saturated figure
    per_hb = [
        (a - p) / 100.0 / rate * 1000.0
        for a, p, rate in zip(active, paused, hb_rates, strict=True)
        if rate > 0
    ]
    ms_per_hb = median(per_hb)
    return {
        "heartbeat_cpu_pct": r(median(a - p for a, p in zip(active, paused, strict=True))),
        "leader_cpu_ms_per_heartbeat": r(ms_per_hb, 3),
        "heartbeat_cpu_pct_at_nominal_rate": r(
            ms_per_hb * args.nodes / args.heartbeat_interval / 10.0
        ),
        "leader_cpu_with_heartbeats_pct": r(median(active)),
        "leader_cpu_paused_pct": r(median(paused)),
        "leader_cpu_runs": [[r(a), r(p)] for a, p in zip(active, paused, strict=True)],
        "scheduler_cpu_pct": r(median(sched_cpu)),
        "leader_member": leader.id,
        "members_cpu_pct_runs": by_member,
        "heartbeats_per_s": r(median(hb_rates)),
        "heartbeat_calls_per_s": r(median(batch_rates)) if any(batch_rates) else None,
        "cycle_s": r((cyc1[0] - cyc0[0]) / dn, 3) if dn > 0 else None,
        "cycles_measured": int(dn),
        "cycle_max_bucket_s": max(reached) if reached else None,
        "machine_busy_cores": r(median(machine)),
    }


async def _dump_probe(cluster: Any, args: Any, runs: int) -> dict[str, Any]:
    """Steady proposals while watching the leader's data dir for full dumps."""
    from lattice_common import commands as c
    from lattice_common.rpc import Endpoints, RemoteQuorum

    leader = cluster.leader(LEADER_WAIT)
    dump = leader.dir / "raft" / "raft.dump"
    q = RemoteQuorum(Endpoints(leader.grpc_address))
    samples: list[tuple[float, float]] = []  # (start, end) monotonic
    dumps: list[tuple[float, float]] = []
    stop = asyncio.Event()

    async def proposer() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            t0 = time.monotonic()
            with contextlib.suppress(Exception):
                await q.propose(
                    c.UpdateTenant(
                        name=cluster.tenant,
                        fields={"fair_share_target": float(i % 100) / 100.0},
                        now=time.time(),
                    )
                )
            samples.append((t0, time.monotonic()))
            await asyncio.sleep(0.01)

    others = [m for m in cluster.members if m is not leader]
    follower_dumps: list[tuple[float, float]] = []  # the other members' (they also fork)

    async def watcher() -> None:
        files = [(leader.dir / "raft", dumps)] + [(m.dir / "raft", follower_dumps) for m in others]
        start: list[float | None] = [None] * len(files)
        mtime = [
            (d / "raft.dump").stat().st_mtime_ns if (d / "raft.dump").exists() else 0
            for d, _ in files
        ]
        deadline = time.monotonic() + runs * args.dump_interval * 2 + 60
        while len(dumps) < runs and time.monotonic() < deadline:
            now = time.monotonic()
            for i, (d, seen) in enumerate(files):
                if start[i] is None and (d / "raft.dump.tmp").exists():
                    start[i] = now
                m = (d / "raft.dump").stat().st_mtime_ns if (d / "raft.dump").exists() else 0
                if m != mtime[i]:
                    mtime[i] = m
                    if start[i] is not None:  # one we saw begin
                        seen.append((start[i], now))
                        if i == 0:
                            log(f"full dump {len(dumps)}/{runs}: {now - start[i]:.2f}s")
                    start[i] = None
            await asyncio.sleep(0.005)
        stop.set()

    gc_before = _full_collections(leader)
    task = asyncio.create_task(proposer())
    await watcher()
    await task
    q.endpoints.close()
    stalls = []
    worst: list[list[float]] = []  # per dump: the slowest commits, [ms, start s into the dump]
    for d0, d1 in dumps:
        inside = [(e - s, s - d0) for s, e in samples if e >= d0 and s <= d1]
        stalls.append(max(x for x, _ in inside) if inside else None)
        worst.append([[r(1000 * x), r(at, 2)] for x, at in sorted(inside, reverse=True)[:5]])
    every = dumps + follower_dumps
    outside = [
        e - s for s, e in samples if not any(e >= d0 - 0.5 and s <= d1 + 0.5 for d0, d1 in every)
    ]
    in_follower = [
        e - s for s, e in samples if any(e >= d0 and s <= d1 for d0, d1 in follower_dumps)
    ]
    gc_after = _full_collections(leader)
    during = {le: n - gc_before.get(le, 0) for le, n in gc_after.items()}
    return {
        **_gc_figures(cluster, leader),
        # the leader's full collections while the probe ran, and the longest one's bucket
        "leader_full_collections_in_probe": int(during.get(float("inf"), 0)),
        "leader_longest_full_in_probe_le_s": min(
            (le for le, n in during.items() if n >= during.get(float("inf"), 0) and n > 0),
            default=None,
        ),
        "leader_changed_during_probe": cluster.leader(LEADER_WAIT) is not leader,
        "dump_s": r(median(d1 - d0 for d0, d1 in dumps), 3) if dumps else None,
        "max_commit_stall_ms": r(1000 * max(x for x in stalls if x is not None))
        if any(x is not None for x in stalls)
        else None,
        "slowest_commits_in_dump": worst,
        "dumps_seen": len(dumps),
        "dump_bytes": dump.stat().st_size if dump.exists() else None,
        "commit_max_outside_dump_ms": r(1000 * max(outside)) if outside else None,
        # while another member wrote its dump (members stagger theirs)
        "commit_max_in_follower_dump_ms": r(1000 * max(in_follower)) if in_follower else None,
        "follower_dumps_seen": len(follower_dumps),
        "commits_probed": len(samples),
    }


def _full_collections(member: Any) -> dict[float, float]:
    """The member's cumulative histogram of full collections: {le: count}."""
    out: dict[float, float] = {}
    with contextlib.suppress(OSError, urllib.error.URLError):
        for k, v in metrics(member.rest_url + "/metrics").items():
            mm = re.match(r'lattice_gc_pause_seconds_bucket\{generation="2",le="([^"]+)"\}', k)
            if mm:
                out[float(mm.group(1))] = v
    return out


def _gc_figures(cluster: Any, leader: Any) -> dict[str, Any]:
    """Each member's garbage-collector pauses (``lattice_common.heap``) since it started:
    full collections, the longest, and the objects kept out of their walks."""
    out: dict[str, Any] = {}
    for m in cluster.members:
        with contextlib.suppress(OSError, urllib.error.URLError):
            mm = metrics(m.rest_url + "/metrics")
            out[str(m.id)] = {
                "full_collections": int(
                    mm.get('lattice_gc_pause_seconds_count{generation="2"}', 0)
                ),
                "longest_full_ms": r(1000 * mm.get("lattice_gc_longest_full_pause_seconds", 0.0)),
                "frozen_objects": int(mm.get("lattice_gc_frozen_objects", 0)),
            }
    return {
        "gc_by_member": out,
        "leader_gc_longest_full_ms": out.get(str(leader.id), {}).get("longest_full_ms"),
    }


def failover(cluster: Any) -> dict[str, Any]:
    leader = cluster.leader(LEADER_WAIT)
    others = [m for m in cluster.members if m is not leader]
    body = {
        "entrypoint": "true # failover probe",
        "tenant": cluster.tenant,
        "vcluster": cluster.vclusters[0],
        "walltime": "10m",
        "nodes": 1,
    }
    log(f"SIGKILL leader member {leader.id}")
    t0 = time.perf_counter()
    os.kill(leader.proc.pid, signal.SIGKILL)
    tries = 0
    # why the tries failed, by kind (e.g. "503 not_leader", "timeout"): what to fix
    why: dict[str, int] = {}
    while time.perf_counter() - t0 < 120:
        for m in others:
            tries += 1
            try:
                http("POST", m.rest_url + "/api/v1/allocations", body, timeout=3)
            except (urllib.error.URLError, OSError, ValueError) as e:
                kind = _failure_kind(e)
                if kind not in why:
                    log(f"  {time.perf_counter() - t0:.2f}s member {m.id}: {kind}")
                why[kind] = why.get(kind, 0) + 1
                time.sleep(0.02)
                continue
            took = time.perf_counter() - t0
            log(f"member {m.id} accepted a submission {took:.2f}s after the kill")
            leader.proc.wait(10)
            leader.proc = None
            return {"failover_s": r(took, 3), "failover_tries": tries, "failover_refusals": why}
    return {"failover_s": None, "failover_tries": tries, "failover_refusals": why}


def _failure_kind(e: BaseException) -> str:
    if isinstance(e, urllib.error.HTTPError):
        try:
            code = json.loads(e.read() or b"{}").get("error", {}).get("code", "")
        except (ValueError, OSError, AttributeError):
            code = ""
        return f"{e.code} {code}".strip()
    reason = getattr(e, "reason", e)
    return "timeout" if "timed out" in str(reason) else type(reason).__name__


def profile_summary(profile_dir: Path, pid: int, top: int = 25) -> dict[str, Any]:
    f = profile_dir / f"profile-{pid}.pstats"
    if not f.exists():
        return {}
    st = pstats.Stats(str(f))
    total = st.total_tt  # type: ignore[attr-defined]
    rows = []
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        rows.append((ct, tt, nc, f"{fn} ({Path(file).name}:{line})"))
    cum = sorted(rows, reverse=True)[:top]
    own = sorted(rows, key=lambda x: -x[1])[:top]
    return {
        "file": str(f),
        "total_s": r(total, 3),
        "cumulative": [[n, r(ct, 3), calls] for ct, _, calls, n in cum],
        "self": [[n, r(tt, 3), calls] for _, tt, calls, n in own],
    }


# --- main -----------------------------------------------------------------------------------


def main() -> None:
    args = _args()
    runs = runs_of(args, quick_runs=1)
    from lattice_test_harness.simagents import SimFleet

    base = Path(tempfile.mkdtemp(prefix="lattice-scale-"))
    profile_dir = Path(args.profile).resolve() if args.profile else None
    if profile_dir is not None:
        profile_dir.mkdir(parents=True, exist_ok=True)
    cluster = make_cluster(base, args, profile_dir)
    out: dict[str, Any] = {
        "nodes": args.nodes,
        "pending": args.pending,
        "coalesce_window_s": args.coalesce_window,
    }
    fleet = None
    load0 = os.getloadavg()
    try:
        t0 = time.perf_counter()
        cluster.start(timeout=90)
        log(f"{args.members}-member quorum up in {time.perf_counter() - t0:.1f}s")
        fleet = SimFleet(
            cluster.grpc_endpoints,
            args.nodes,
            args.processes,
            base / "sim",
            heartbeat_interval=args.heartbeat_interval,
            run_seconds=-1,  # the jobs run for the whole benchmark
            coalesce_window=args.coalesce_window,
        ).start()
        t0 = time.perf_counter()
        fleet.wait_ready(timeout=1800)
        out["register_s"] = r(time.perf_counter() - t0)
        log(f"{args.nodes} simulated nodes registered with streams in {out['register_s']}s")
        wait_until(
            "all nodes Ready",
            lambda: node_states(cluster).get("Ready", 0) >= args.nodes,
            timeout=300,
            interval=2.0,
        )
        # fill every node, then queue the pending work behind them
        t0 = time.perf_counter()
        submit_groups(cluster, args.nodes, "filler")
        wait_until(
            "every node running a job",
            lambda: (
                node_states(cluster).get("_owned", 0) >= args.nodes
                and fleet.status().get("started", 0) >= args.nodes
            ),
            timeout=1800,
            interval=2.0,
        )
        out["fill_s"] = r(time.perf_counter() - t0)
        log(f"all {args.nodes} nodes running in {out['fill_s']}s")
        out["submit_pending_s"] = r(submit_groups(cluster, args.pending, "pending"))
        murl = f"http://127.0.0.1:{cluster.metrics_port}/metrics"
        wait_until(
            "the scheduler to see the queue",
            lambda: (
                metrics(murl).get('lattice_scheduling_queue_depth{vcluster="default"}', 0)
                >= args.pending
            ),
            timeout=600,
            interval=1.0,
        )
        time.sleep(2 * args.heartbeat_interval)  # settle: a whole round of heartbeats
        leader = cluster.leader(LEADER_WAIT)
        out["leader_rss_mb"] = r(rss_mb(leader.proc.pid), 1)
        if "heartbeats" in args.phases:
            out.update(heartbeat_windows(cluster, fleet, args, runs, profile_dir))
        states = node_states(cluster)
        out["node_states"] = states
        out["leader_rss_mb"] = r(rss_mb(leader.proc.pid), 1)
        out["leader_cpu_s_total"] = r(cpu_seconds(leader.proc.pid))
        if profile_dir is not None:
            out["profile"] = profile_summary(profile_dir, leader.proc.pid)
        log(
            f"heartbeats: {out.get('heartbeat_cpu_pct')} % of a core; cycle "
            f"{out.get('cycle_s')} s; leader RSS {out['leader_rss_mb']} MB; nodes {states}"
        )
        if "dump" in args.phases:
            out.update(asyncio.run(_dump_probe(cluster, args, min(runs, 2))))
            log(f"dump {out['dump_s']} s, longest commit during it {out['max_commit_stall_ms']} ms")
        if "failover" in args.phases:
            out.update(failover(cluster))
        time.sleep(2 * args.heartbeat_interval)
        out["sim"] = fleet.status()
    except BaseException:
        logs = cluster.base / "logs"
        for f in sorted(logs.glob("*.log")) if logs.exists() else []:
            tail = f.read_text(errors="replace").splitlines()[-20:]
            log(f"--- {f.name} ---\n" + "\n".join(tail))
        raise
    finally:
        if fleet is not None:
            fleet.stop()
        stop_cluster(cluster)
        if args.keep:
            log(f"files kept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    out["machine"] = {
        "cpu_count": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in load0],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }
    out["runs"] = runs
    out["repo"] = str(REPO)
    for k in ("heartbeat_cpu_pct", "cycle_s", "leader_rss_mb", "failover_s", "dump_s"):
        out.setdefault(k, None)
    out.setdefault("max_commit_stall_ms", None)
    emit(out)


if __name__ == "__main__":
    main()
