"""Node runtime: what the prologue adds to submit -> Running for cached images, and
what the node agent costs with 64 allocations on its node.

1. Latency (a dev cluster: LocalCluster with 1 lattice-server and 1 agent, idle). Three
   kinds of one-node jobs running ``true``: ``bare`` (no image: Pending -> Running when
   the scheduler's AssignNodes commits), ``uenv`` (a SquashFS uenv from a local
   registry directory, ``uenv: env/1.0:v1``) and ``oci`` (a busybox image in a local
   ``docker-registry``, ``image: 127.0.0.1:PORT/lattice/app:1``); both of the latter go
   Pending -> Staging -> Running: the agent runs the prologue (uenv: look up and verify
   the image in its node cache; OCI: resolve the tag at the registry, find the digest in
   its cache, pin it), reports ``staged`` with an immediate heartbeat, and the quorum
   makes it Running. One warm-up job of each kind first fills the node's caches, so every
   measured job is a *cached* one. Then ``--runs`` rounds, each submitting one job of
   every kind (the order rotates per round, so drift hits all kinds alike), one job at a
   time, waiting for each to end before the next. A sample is the quorum's own
   ``started_at - submitted_at`` (both server clocks: the API's at submit, the
   scheduler's / quorum's at Running; polling granularity does not count). Also
   reported per kind: the client's view (just before the REST POST -> the first
   ``/watch`` line that says Running), when Staging was first seen, and the agent's
   "prologue done in" time from its log. ``uenv_added_ms`` = median(uenv) -
   median(bare), ``oci_added_ms`` = median(oci) - median(bare).

2. Agent CPU (``agent_cpu_64``). Nodes are exclusive in Lattice (the quorum refuses a
   second allocation on an owned node), so a real quorum cannot put 64 allocations on
   one node. Instead one real ``lattice_agent.main`` process, started with exactly the
   dev cluster's flags (cgroup scope per allocation, ``--run-as agent``, 10 s
   heartbeats: the production default), talks to a minimal NodeService in this
   process (RegisterNode, Heartbeat, WatchDesiredState over real gRPC on loopback)
   whose desired state puts 64 Running allocations (``sleep``) on that node. The
   agent's utime + stime (/proc, its threads included, not its children) is measured
   over a window of ``--cpu-window`` seconds with 0 allocations (``agent_cpu_idle``)
   and with all 64 running (``agent_cpu_64``); both in percent of one core (1 s slices
   and the machine's busy cores in ``agent_cpu_detail``; ``/proc`` counts 10 ms ticks,
   so a 30 s window resolves 0.03 %). Also: CPU seconds the agent spent starting the 64
   (desired state pushed -> all 64 ``sleep`` processes exist; checked afterwards: the next
   heartbeat reports all 64 running) and stopping them (desired state emptied -> no reports left), and its RSS.
   ``--profile DIR`` also samples the agent with py-spy in the 64-allocation window.

    uv run python scripts/bench/prologue.py [--runs N] [--quick] [--cpu-window S]

OCI needs root and crun, skopeo, umoci, docker-registry, busybox-static, tini; uenv
needs mksquashfs. Without them the kind is skipped (``*_added_ms``: null, the reason in
``skipped``) instead of failing.

Goals (issue "Node runtime"): a cached uenv adds < 100 ms, a cached OCI image < 1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    TERMINAL,
    CpuMeter,
    PySpy,
    cluster_procs,
    cpu_seconds,
    dev_cluster,
    emit,
    job_body,
    log,
    machine_busy_jiffies,
    median,
    parser,
    percentile,
    r,
    rest_headers,
    runs_of,
    stop_cluster,
)

KINDS = ("bare", "uenv", "oci")
UENV_REF = "env/1.0:v1"
GOALS_MS = {"uenv": 100, "oci": 1000}
CONCURRENT = 64


# --- images -------------------------------------------------------------------------------


def uenv_registry(root: Path) -> str | None:
    """A uenv registry directory with one small SquashFS image; None if it cannot be built
    (the reason is logged)."""
    if shutil.which("mksquashfs") is None:
        log("uenv: mksquashfs not found (package squashfs-tools); uenv jobs skipped")
        return None
    from lattice_test_harness.uenv_images import build_squashfs, index_entry

    reg = root / "registry"
    try:
        image = build_squashfs(reg / "env.sqfs", {"bin/hello": "#!/bin/sh\necho hello\n"})
    except subprocess.CalledProcessError as e:
        log(
            f"uenv: mksquashfs failed: {e.stderr.decode(errors='replace')[-500:]}; uenv jobs skipped"
        )
        return None
    index = {UENV_REF: index_entry(image)}
    (reg / "index.json").write_text(json.dumps(index))
    return str(reg)


def oci_unavailable() -> str | None:
    try:
        from lattice_test_harness.oci_registry import missing_oci_tools
    except ImportError as e:
        return f"lattice_test_harness.oci_registry not importable: {e}"
    missing = missing_oci_tools()
    if missing:
        return "missing " + ", ".join(missing)
    if os.geteuid() != 0:
        return "OCI containers (crun, umoci) need root"
    return None


# --- 1. submit -> Running latency ------------------------------------------------------------


async def one_job(session: Any, base: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Submit, follow /watch to the end. Client times are seconds from before the POST."""
    t0 = time.perf_counter()
    async with session.post(base + "/api/v1/allocations", json=body) as resp:
        if resp.status != 201:
            raise RuntimeError(f"submit failed: {resp.status} {(await resp.text())[:500]}")
        alloc = await resp.json()
    seen: dict[str, float] = {}
    last: dict[str, Any] = alloc
    deadline = time.monotonic() + timeout
    async with session.get(base + f"/api/v1/allocations/{alloc['id']}/watch") as resp:
        if resp.status != 200:
            raise RuntimeError(f"watch failed: {resp.status} {(await resp.text())[:500]}")
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"{body.get('name')} {alloc['id']} still {last['state']} after {timeout:.0f}s"
                )
            try:
                line = await asyncio.wait_for(resp.content.readline(), left)
            except TimeoutError:
                continue
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
        "server": server,
        "client": seen.get("Running"),
        "staging_seen": seen.get("Staging"),
        "final_state": last["state"],
        "reason": last.get("reason", ""),
    }


_PROLOGUE_DONE = re.compile(r"allocation (\S+): prologue done in ([0-9.]+)s")


def prologue_times(cluster: Any) -> dict[str, float]:
    """allocation id -> the agent's "prologue done in" seconds (its log)."""
    out: dict[str, float] = {}
    for a in cluster.agents:
        with contextlib.suppress(OSError):
            for line in (
                cluster.log_path(f"agent-{a.node_id}").read_text(errors="replace").splitlines()
            ):
                if "prologue done" not in line:
                    continue
                with contextlib.suppress(ValueError, KeyError):
                    m = _PROLOGUE_DONE.search(json.loads(line)["msg"])
                    if m:
                        out[m.group(1)] = float(m.group(2))
    return out


async def warm_up(
    cluster: Any, kinds: dict[str, dict[str, Any]], pause: float, skipped: dict[str, str]
) -> None:
    """One job of each kind fills the node's caches (and warms the first fork/exec paths,
    imports and connections). A kind whose warm-up job never gets Running is dropped."""
    import aiohttp

    async with aiohttp.ClientSession(headers=rest_headers(cluster.tenant)) as s:
        for kind, extra in list(kinds.items()):
            body = job_body(cluster, "true", name=f"bench-prologue-warmup-{kind}", **extra)
            t = time.perf_counter()
            w = await one_job(s, cluster.rest_url, body, timeout=180)
            log(
                f"warm-up {kind}: {w['final_state']} after {time.perf_counter() - t:.2f}s"
                + (f" ({w['reason']})" if w["reason"] else "")
            )
            if w["server"] is None:  # never Running: nothing to measure
                skipped[kind] = f"warm-up job ended {w['final_state']}: {w['reason']}"
                log(f"{kind}: {skipped[kind]}; not measured")
                kinds.pop(kind)
            elif w["final_state"] != "Completed":  # ran, but failed afterwards
                log(f"{kind}: warning: the job reached Running but ended {w['final_state']}")
            await asyncio.sleep(pause)
    if "bare" not in kinds:
        raise RuntimeError(f"bare jobs do not run: {skipped.get('bare')}")


async def latency_rounds(
    cluster: Any, kinds: dict[str, dict[str, Any]], rounds: int, pause: float
) -> dict[str, list[dict[str, Any]]]:
    import aiohttp

    out: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    order = list(kinds)
    async with aiohttp.ClientSession(headers=rest_headers(cluster.tenant)) as s:
        for i in range(rounds):
            shift = i % len(order)
            line = []
            for kind in order[shift:] + order[:shift]:
                body = job_body(cluster, "true", name=f"bench-prologue-{kind}", **kinds[kind])
                smp = await one_job(s, cluster.rest_url, body, timeout=60)
                out[kind].append(smp)
                ms = "-" if smp["server"] is None else f"{1000 * smp['server']:.0f}"
                line.append(f"{kind} {ms} ms")
                if smp["final_state"] != "Completed":
                    line[-1] += f" ({smp['final_state']}: {smp['reason']})"
                await asyncio.sleep(pause)  # idle again: the node's release settles
            log(f"round {i + 1}/{rounds}: " + ", ".join(line))
    return out


def latency_phase(args: argparse.Namespace, rounds: int, tmp: Path) -> dict[str, Any]:
    skipped: dict[str, str] = {}
    kinds: dict[str, dict[str, Any]] = {"bare": {}}
    env: dict[str, str] = {}
    reg_dir = uenv_registry(tmp / "uenv")
    if reg_dir:
        env["LATTICE_NODE_AGENT__UENV_REGISTRY"] = reg_dir
        kinds["uenv"] = {"uenv": UENV_REF}
    else:
        skipped["uenv"] = "mksquashfs missing or failed"
    why_not_oci = oci_unavailable()
    if why_not_oci:
        skipped["oci"] = why_not_oci
        log(f"oci: {why_not_oci}; oci jobs skipped (oci_added_ms: null)")

    with contextlib.ExitStack() as stack:
        if not why_not_oci:
            from lattice_test_harness.oci_registry import LocalRegistry, build_image

            t = time.perf_counter()
            try:
                reg = stack.enter_context(LocalRegistry())
                ref = build_image(reg, "lattice/app", "1", {"/etc/motd": "bench\n"})
            except Exception as e:
                skipped["oci"] = f"local registry or image build failed: {e}"
                log(f"oci: {skipped['oci']}; oci jobs skipped (oci_added_ms: null)")
            else:
                log(f"oci: pushed {ref} in {time.perf_counter() - t:.1f}s")
                kinds["oci"] = {"image": ref}
        cluster = stack.enter_context(
            dev_cluster(
                members=1,
                agents=1,
                cycle_interval=args.cycle_interval,
                keep=args.keep,
                env=env,
            )
        )
        asyncio.run(warm_up(cluster, kinds, args.pause, skipped))
        pids = {n: p.pid for n, p in cluster_procs(cluster).items()}
        with (
            CpuMeter(pids) as meter,
            PySpy(args.profile, pids) as spy,
        ):
            samples = asyncio.run(latency_rounds(cluster, kinds, rounds, args.pause))
        prologue = prologue_times(cluster)

    per_kind: dict[str, Any] = {}
    for kind, smps in samples.items():
        server = [s["server"] for s in smps if s["server"] is not None]
        client = [s["client"] for s in smps if s["client"] is not None]
        staging = [s["staging_seen"] for s in smps if s["staging_seen"] is not None]
        prol = [prologue[s["id"]] for s in smps if s["id"] in prologue]
        per_kind[kind] = {
            "median_ms": r(1000 * median(server)),
            "p95_ms": r(1000 * percentile(server, 95)),
            "min_ms": r(1000 * min(server)) if server else None,
            "max_ms": r(1000 * max(server)) if server else None,
            "samples": len(server),
            "client_running_seen_median_ms": r(1000 * median(client)),
            "client_staging_seen_median_ms": r(1000 * median(staging)) if staging else None,
            "agent_prologue_median_ms": r(1000 * median(prol)) if prol else None,
            "final_states": dict(Counter(s["final_state"] for s in smps)),
        }
    return {"per_kind": per_kind, "skipped": skipped, "cpu": meter.result, "profile": spy.summary}


# --- 2. agent CPU with 64 allocations on its node ---------------------------------------------


def _fake_node_service() -> Any:
    """A NodeService that accepts one agent's registration and heartbeats and serves it a
    desired state this script sets (``set_desired``)."""
    from lattice_common.proto.lattice import v1
    from lattice_common.types import AllocationReport
    from lattice_common.wire import from_message, to_message

    class FakeNodeService(v1.NodeServiceBase):
        def __init__(self) -> None:
            self.generation = 1
            self.desired: list[Any] = []
            self.changed = asyncio.Condition()
            self.registered = asyncio.Event()
            self.reports: dict[str, str] = {}  # allocation id -> phase, from the last heartbeat
            self.heartbeats = 0
            self.beat = asyncio.Condition()

        async def set_desired(self, allocs: list[Any]) -> None:
            async with self.changed:
                self.generation += 1
                self.desired = list(allocs)
                self.changed.notify_all()

        async def register_node(self, message: v1.RegisterNodeRequest) -> v1.RegisterNodeResponse:
            self.registered.set()
            return v1.RegisterNodeResponse(node=message.node)

        async def heartbeat(self, message: v1.HeartbeatRequest) -> v1.HeartbeatResponse:
            reports = [from_message(x, AllocationReport) for x in message.allocations]
            async with self.beat:
                self.reports = {x.allocation_id: x.phase for x in reports}
                self.heartbeats += 1
                self.beat.notify_all()
            return v1.HeartbeatResponse(generation=self.generation)

        async def watch_desired_state(self, message: v1.WatchDesiredStateRequest) -> Any:
            sent = -1
            while True:
                async with self.changed:
                    await self.changed.wait_for(lambda s=sent: self.generation != s)
                    sent, allocs = self.generation, list(self.desired)
                yield v1.DesiredState(
                    node_id=message.node_id,
                    generation=sent,
                    allocations=[to_message(a, v1.Allocation) for a in allocs],
                )

        async def wait_reports(self, pred: Any, timeout: float, what: str) -> None:
            async with self.beat:
                try:
                    await asyncio.wait_for(self.beat.wait_for(lambda: pred(self.reports)), timeout)
                except TimeoutError:
                    raise TimeoutError(
                        f"agent CPU phase: timed out after {timeout:.0f}s waiting for {what} "
                        f"(last heartbeat: {Counter(self.reports.values())})"
                    ) from None

    return FakeNodeService()


def _rss_mb(pid: int) -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


async def _agent_cpu(
    cluster: Any, n: int, window: float, heartbeat: float, profile: str | None
) -> dict[str, Any]:
    from grpclib.server import Server
    from lattice_common.types import Allocation, AllocationSpec, AllocationState

    svc = _fake_node_service()
    server = Server([svc])
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    cluster.members[0].grpc_port = port  # the agent's --quorum-endpoint
    agent = cluster.agents[0]
    try:
        cluster.start_agent(agent)
        pid = agent.proc.pid
        try:
            await asyncio.wait_for(svc.registered.wait(), 60)
        except TimeoutError:
            raise TimeoutError("agent CPU phase: the agent did not register within 60 s") from None
        await svc.wait_reports(lambda _: svc.heartbeats > 0, 60, "the first heartbeat")
        await asyncio.sleep(2.0)  # start-up settles (imports done, first beat sent)

        async def measure(seconds: float) -> dict[str, Any]:
            """CPU over ``seconds``, also per 1 s slice (clock ticks: 10 ms resolution)."""
            c0, t0, m0 = cpu_seconds(pid), time.perf_counter(), machine_busy_jiffies()
            slices, prev = [], c0
            while (left := t0 + seconds - time.perf_counter()) > 0:
                await asyncio.sleep(min(1.0, left))
                now = cpu_seconds(pid)
                if now is None or prev is None:
                    raise RuntimeError("agent CPU phase: the agent process went away")
                slices.append(round(1000 * (now - prev)))
                prev = now
            c1, t1, m1 = cpu_seconds(pid), time.perf_counter(), machine_busy_jiffies()
            assert c0 is not None and c1 is not None
            return {
                "cpu_s": r(c1 - c0, 3),
                "wall_s": r(t1 - t0),
                "pct_of_one_core": r(100 * (c1 - c0) / (t1 - t0), 3),
                "cpu_ms_per_second": slices,
                # the whole machine, other users included: is the box busy?
                "machine_busy_cores": r(
                    (os.cpu_count() or 1) * (m1[0] - m0[0]) / max(1, m1[1] - m0[1])
                ),
            }

        log(f"agent CPU: idle agent, {window:.0f}s window")
        beats0 = svc.heartbeats
        idle = await measure(window)
        idle["heartbeats"] = svc.heartbeats - beats0
        now = time.time()
        # a duration unique to this run, to count exactly its processes
        command = ["sleep", str(86400 + uuid.uuid4().int % 10000)]
        allocs = [
            Allocation(
                id=str(uuid.uuid4()),
                spec=AllocationSpec(
                    entrypoint=" ".join(command),
                    tenant=cluster.tenant,
                    vcluster=cluster.vclusters[0],
                    walltime_seconds=2 * 86400,
                    name=f"bench-agent-cpu-{i}",
                    user="bench",
                ),
                state=AllocationState.RUNNING,
                assigned_nodes=[agent.node_id],
                submitted_at=now,
                started_at=now,
            )
            for i in range(n)
        ]
        ids = {a.id for a in allocs}
        c0, t0 = cpu_seconds(pid), time.perf_counter()
        await svc.set_desired(allocs)
        deadline = t0 + 60
        while (procs := _count_processes(command)) < n:
            if time.perf_counter() > deadline:
                raise TimeoutError(f"agent CPU phase: only {procs}/{n} allocations started in 60s")
            await asyncio.sleep(0.05)
        start = {
            "cpu_s": r(cpu_seconds(pid) - c0, 3),
            "until_all_processes_exist_s": r(time.perf_counter() - t0),
        }
        await asyncio.sleep(1.0)  # the last starts settle (scopes, log tails, state file)
        log(f"agent CPU: {n} allocations running ({procs} processes); {window:.0f}s window")
        beats1 = svc.heartbeats
        spy = PySpy(profile, {f"agent-with-{n}-allocations": pid})
        await asyncio.to_thread(spy.__enter__)  # py-spy attaches (1 s); gRPC keeps serving
        try:
            busy = await measure(window)
        finally:
            await asyncio.to_thread(spy.__exit__)
        busy["heartbeats"] = svc.heartbeats - beats1
        # a start is not pushed at once (only exits are): the regular heartbeat tells
        await svc.wait_reports(
            lambda rep: sum(1 for i in ids if rep.get(i) == "running") == n,
            30 + 2 * heartbeat,
            f"{n} allocations reported running",
        )
        rss = _rss_mb(pid)
        c0, t0 = cpu_seconds(pid), time.perf_counter()
        await svc.set_desired([])
        await svc.wait_reports(
            lambda rep: not (ids & rep.keys()), 60 + 2 * heartbeat, "all allocations gone"
        )
        stop = {
            "cpu_s": r(cpu_seconds(pid) - c0, 3),
            "until_none_reported_s": r(time.perf_counter() - t0),
        }
        log(
            f"agent CPU: idle {idle['pct_of_one_core']}%, with {n}: {busy['pct_of_one_core']}% "
            f"of one core; start {start['cpu_s']} CPU s, stop {stop['cpu_s']} CPU s"
        )
        return {
            "idle": idle,
            "busy": busy,
            "start": start,
            "stop": stop,
            "per_allocation_pct_of_one_core": r(
                (busy["pct_of_one_core"] - idle["pct_of_one_core"]) / n, 4
            ),
            "rss_mb_with_64": r(rss, 1),
            "heartbeat_interval_s": heartbeat,
            "tail_note": "each running allocation's stdout/stderr files are polled every "
            "0.1 s (lattice_agent.logtail.TAIL_INTERVAL)",
            "heartbeats_idle_to_stop": svc.heartbeats - beats0,
            "allocation_processes": procs,
            "profile": spy.summary or None,
        }
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 5)


def _count_processes(argv: list[str]) -> int:
    """Processes whose command line is ``argv`` (the allocations' commands)."""
    want = [x.encode() for x in argv]
    n = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if (d / "cmdline").read_bytes().split(b"\0")[: len(want)] == want:
                n += 1
    return n


def agent_cpu_phase(args: argparse.Namespace, window: float) -> dict[str, Any]:
    from lattice_cli.devcluster import LocalCluster

    base = Path(tempfile.mkdtemp(prefix="lattice-bench-"))
    # only the layout and the agent's flags of a dev cluster: no server is started
    cluster = LocalCluster(base / "cluster", members=1, agents=1)
    log(f"agent CPU: 1 real agent against an in-process NodeService, in {base}")
    try:
        return asyncio.run(
            _agent_cpu(cluster, CONCURRENT, window, cluster.heartbeat_interval, args.profile)
        )
    except BaseException:
        with contextlib.suppress(OSError):
            tail = cluster.log_path("agent-node-001").read_text(errors="replace").splitlines()
            log("--- agent log (last 30 lines) ---\n" + "\n".join(tail[-30:]))
        raise
    finally:
        a = cluster.agents[0]
        if a.proc is not None and a.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(a.proc.pid, signal.SIGTERM)
            try:
                a.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(a.proc.pid, signal.SIGKILL)
                a.proc.wait(5)
        stop_cluster(cluster)  # the workloads and cgroup scopes it left, if any
        if args.keep:
            log(f"agent CPU files kept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)


# --- main ---------------------------------------------------------------------------------------


def main() -> None:
    p = parser(__doc__.split("\n\n")[0], default_runs=15)
    p.add_argument("--cycle-interval", type=float, default=5.0, help="scheduler cycle (s)")
    p.add_argument("--pause", type=float, default=0.2, help="idle seconds between jobs")
    p.add_argument(
        "--cpu-window", type=float, default=None, help="agent CPU window in s (30; quick 10)"
    )
    p.add_argument("--no-agent-cpu", action="store_true", help="latency only")
    args = p.parse_args()
    rounds = runs_of(args, quick_runs=5)
    window = args.cpu_window or (10.0 if args.quick else 30.0)

    tmp = Path(tempfile.mkdtemp(prefix="lattice-bench-images-"))
    try:
        lat = latency_phase(args, rounds, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    cpu = None if args.no_agent_cpu else agent_cpu_phase(args, window)

    pk = lat["per_kind"]
    bare = pk["bare"]["median_ms"]

    def added(kind: str) -> float | None:
        k = pk.get(kind)
        if k is None or k["median_ms"] is None or bare is None:
            return None
        return r(k["median_ms"] - bare)

    out: dict[str, Any] = {
        "bare_ms": bare,
        "uenv_added_ms": added("uenv"),
        "oci_added_ms": added("oci"),
        "agent_cpu_64": cpu["busy"]["pct_of_one_core"] if cpu else None,
        "agent_cpu_64_unit": "percent of one core",
        "agent_cpu_idle": cpu["idle"]["pct_of_one_core"] if cpu else None,
        "uenv_ms": pk.get("uenv", {}).get("median_ms"),
        "oci_ms": pk.get("oci", {}).get("median_ms"),
        "runs": rounds,
        "per_kind": pk,
        "skipped": lat["skipped"],
        "latency_method": "quorum started_at - submitted_at per job, median per kind; one "
        "job at a time, kinds interleaved (order rotates per round), each waits for the "
        "previous to end; 1 server + 1 agent dev cluster; caches warmed by one job of each "
        f"kind; scheduler cycle {args.cycle_interval:g}s (submits poke it)",
        "agent_cpu_64_method": (
            "one real agent (dev cluster flags, heartbeat every 10s) served by an "
            f"in-process NodeService whose desired state puts {CONCURRENT} Running "
            f"`sleep` allocations on its node (a real quorum keeps nodes exclusive); "
            f"agent utime+stime over {window:g}s with all {CONCURRENT} running, % of "
            f"one core"
        ),
        "agent_cpu_detail": cpu,
        "goals_added_ms": GOALS_MS,
        "cpu_count": os.cpu_count(),
        "cpu_latency_phase": lat["cpu"],
    }
    if lat["profile"]:
        out["profile"] = lat["profile"]
    emit(out)


if __name__ == "__main__":
    main()
