"""Observability costs: live log streams on the API, telemetry ingest, the agent's own
CPU with telemetry on, and eBPF's overhead on a CPU-bound job.

* ``log_streams_100_cpu_pct``: a 1-member dev cluster with one agent runs a job that
  prints a line every 100 ms; 100 concurrent REST log streams (``/logs/stream``, aiohttp,
  one connection each) follow it for the window; the lattice-server process's CPU over
  the window, as a percentage of one core (goal < 5 %). Every stream must have received
  lines (``log_streams_receiving``).
* ``agent_cpu_pct``: the same cluster's agent (telemetry on: 1 s collection, windows
  pushed to the cluster's VictoriaMetrics) while 4 jobs run, percent of one core.
* ``ingest_latency_p99_ms`` / ``pusher_cpu_pct_100_nodes``: 100 simulated nodes in this
  process, each the agent's real ``VictoriaPusher`` offering 10 metrics per second to a
  real VictoriaMetrics for the window. A marker series counts seconds; the latency is
  from a second's samples being collected to that second being visible to a query
  (includes the pusher's 1 s minimum age that VictoriaMetrics needs); the CPU is this
  process's, i.e. what 100 nodes' pushing costs in total.
* ``ebpf_overhead_pct``: the agent's own overhead gauge (lattice_agent_ebpf_overhead_percent)
  over a CPU-bound job run with the eBPF programs attached, next to the job's slowdown
  against a run without them (``ebpf_slowdown_pct``); null with the reason when eBPF
  cannot run here.

    uv run python scripts/bench/observability.py [--runs N] [--quick]
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    CpuMeter,
    cluster_procs,
    dev_cluster,
    emit,
    job_body,
    log,
    median,
    parser,
    percentile,
    r,
    rest_headers,
    runs_of,
    wait_until,
)

STREAMS = 100
SIM_NODES = 100
METRICS_PER_NODE = 10


# --- log streams and the agent's CPU ------------------------------------------------------------


def _post(cluster: Any, body: dict[str, Any]) -> str:
    import json
    import urllib.request

    req = urllib.request.Request(
        cluster.rest_url + "/api/v1/allocations",
        data=json.dumps(body).encode(),
        headers=rest_headers(cluster.tenant),
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return str(json.loads(resp.read())["id"])


def _state(cluster: Any, alloc_id: str) -> str:
    import json
    import urllib.request

    req = urllib.request.Request(
        f"{cluster.rest_url}/api/v1/allocations/{alloc_id}", headers=rest_headers(cluster.tenant)
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return str(json.loads(resp.read())["state"])


async def _follow(url: str, window: float) -> tuple[int, float]:
    """(lines received in ``window``, seconds to the first line) of N concurrent streams."""
    import aiohttp

    received = [0] * STREAMS
    first = [0.0] * STREAMS
    t0 = time.perf_counter()

    async def one(i: int, session: Any) -> None:
        with contextlib.suppress(asyncio.TimeoutError, aiohttp.ClientError):
            async with asyncio.timeout(window), session.get(url) as resp:
                async for _ in resp.content:
                    received[i] += 1
                    if not first[i]:
                        first[i] = time.perf_counter() - t0

    sessions = [
        aiohttp.ClientSession(headers=rest_headers(), connector=aiohttp.TCPConnector(limit=1))
        for _ in range(STREAMS)
    ]
    try:
        await asyncio.gather(*(one(i, s) for i, s in enumerate(sessions)))
    finally:
        for s in sessions:
            await s.close()
    return sum(1 for n in received if n > 0), max(first)


def cluster_run(window: float) -> dict[str, Any]:
    with dev_cluster(members=1, agents=1, tsdb=True) as cluster:
        procs = {n: p.pid for n, p in cluster_procs(cluster).items()}
        server = next(n for n in procs if n.startswith("server"))
        agent = next(n for n in procs if n.startswith("agent"))
        # 4 jobs: one prints every 100 ms (the streams follow it), three sleep
        printer = _post(
            cluster,
            job_body(cluster, "i=0; while :; do echo line $i; i=$((i+1)); sleep 0.1; done"),
        )
        for _ in range(3):
            _post(cluster, job_body(cluster, "sleep 600"))
        wait_until("the printing job runs", lambda: _state(cluster, printer) == "Running", 60)
        # the agent's CPU with telemetry on and four allocations, nothing else going on
        time.sleep(2.0)
        with CpuMeter({agent: procs[agent]}) as idle:
            time.sleep(window)
        url = f"{cluster.rest_url}/api/v1/allocations/{printer}/logs/stream"
        with CpuMeter({server: procs[server]}) as meter:
            receiving, first_s = asyncio.run(_follow(url, window))
    return {
        "log_streams_100_cpu_pct": 100 * (meter.result[server].get("cpu_s") or 0.0) / window,
        "log_streams_receiving": receiving,
        "log_streams_first_line_s": first_s,
        "agent_cpu_pct": 100 * (idle.result[agent].get("cpu_s") or 0.0) / window,
    }


# --- telemetry ingest ------------------------------------------------------------------------------


async def _ingest(vm_url: str, window: float) -> dict[str, Any]:
    from lattice_agent.telemetry.push import VictoriaPusher
    from lattice_agent.telemetry.samples import Sample

    pushers = [VictoriaPusher(vm_url) for _ in range(SIM_NODES)]
    tasks = [asyncio.create_task(p.run()) for p in pushers]
    names = [f"bench_metric_{k}" for k in range(METRICS_PER_NODE)]
    collected: dict[int, float] = {}  # second -> wall time its samples were collected
    seen: dict[int, float] = {}

    async def poll() -> None:
        import aiohttp

        async with aiohttp.ClientSession() as s:
            while True:
                params = {"query": "max(last_over_time(bench_marker[1m]))", "nocache": "1"}
                with contextlib.suppress(aiohttp.ClientError, KeyError, IndexError, ValueError):
                    async with s.get(vm_url + "/api/v1/query", params=params) as resp:
                        body = await resp.json()
                    k = int(float(body["data"]["result"][0]["value"][1]))
                    now = time.time()
                    for sec in range(k + 1):
                        seen.setdefault(sec, now)
                await asyncio.sleep(0.05)

    await _warm_marker(vm_url)
    poller = asyncio.create_task(poll())
    cpu0 = time.process_time()
    t0 = time.time()
    second = 0
    try:
        while time.time() - t0 < window:
            now = time.time()
            ts = int(now * 1000)
            collected[second] = now
            for i, p in enumerate(pushers):
                labels = (("alloc_id", f"a{i}"), ("node_id", f"sim-{i:03d}"), ("agg", "raw"))
                p.offer(Sample(n, labels, float(second), ts) for n in names)
            pushers[0].offer([Sample("bench_marker", (("node_id", "sim-000"),), second, ts)])
            second += 1
            await asyncio.sleep(max(0.0, t0 + second - time.time()))
        deadline = time.time() + 15
        while len(seen) < second and time.time() < deadline:
            await asyncio.sleep(0.1)
    finally:
        cpu = time.process_time() - cpu0
        poller.cancel()
        for t in tasks:
            t.cancel()
        await asyncio.gather(poller, *tasks, return_exceptions=True)
        for p in pushers:
            await p.close()
    lat = [seen[s] - collected[s] for s in collected if s in seen]
    return {
        "ingest_latency_p99_ms": 1000 * percentile(lat, 99) if lat else None,
        "ingest_latency_p50_ms": 1000 * percentile(lat, 50) if lat else None,
        "ingest_seconds_visible": f"{len(lat)}/{len(collected)}",
        "pusher_cpu_pct_100_nodes": 100 * cpu / (time.time() - t0),
        "samples_per_s": SIM_NODES * METRICS_PER_NODE,
        "push_failures": sum(p.failures for p in pushers),
    }


async def _warm_marker(vm_url: str) -> None:
    """Create the marker series before measuring: VictoriaMetrics hides a series that
    was queried before it existed for several seconds, which is not ingest latency."""
    import aiohttp

    line = f'bench_marker{{node_id="sim-000"}} -1 {int((time.time() - 5) * 1000)}\n'
    query = {"query": "max(last_over_time(bench_marker[1m]))", "nocache": "1"}
    async with aiohttp.ClientSession() as s:
        async with s.post(vm_url + "/api/v1/import/prometheus", data=line) as resp:
            resp.raise_for_status()
        async with s.get(vm_url + "/internal/force_flush") as resp:
            resp.raise_for_status()
        for _ in range(300):
            async with s.get(vm_url + "/api/v1/query", params=query) as resp:
                if (await resp.json())["data"]["result"]:
                    return
            await asyncio.sleep(0.1)
    raise RuntimeError("the marker series never became visible")


def ingest_run(window: float) -> dict[str, Any]:
    from lattice_test_harness.victoria import VictoriaMetrics

    with VictoriaMetrics() as vm:
        return asyncio.run(_ingest(vm.url, window))


# --- eBPF overhead -----------------------------------------------------------------------------------

BUSY = "import time; t=time.perf_counter(); s=0\nfor i in range(30_000_000): s+=i\nprint(time.perf_counter()-t)"


def _busy_seconds() -> float:
    out = subprocess.run([sys.executable, "-c", BUSY], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def ebpf_run(runs: int) -> dict[str, Any]:
    """Paired runs of the CPU-bound job, without and then with the eBPF programs attached
    (a fresh source each time, closed after: detached). ``ebpf_overhead_pct`` is what the
    agent exports as lattice_agent_ebpf_overhead_percent over the job (the programs'
    kernel run time + dispatch + collection CPU, percent of the node); the slowdown of
    the job itself is reported next to it (noisy on a shared 2-core machine)."""
    try:
        from lattice_agent.telemetry import ebpf
    except ImportError as e:
        return {"ebpf_overhead_pct": None, "ebpf_reason": f"no eBPF source: {e}"}
    ok, reason = ebpf.probe()
    if not ok:
        return {"ebpf_overhead_pct": None, "ebpf_reason": reason}
    without, with_ebpf, gauge = [], [], []
    for _ in range(runs):
        without.append(_busy_seconds())
        source = ebpf.EbpfSource()
        try:
            source.collect([])  # compiles and attaches the programs
            source.measure_overhead()  # the mark the next measurement is taken from
            with_ebpf.append(_busy_seconds())
            source.collect([])
            value = source.measure_overhead()
            if value is not None:
                gauge.append(value)
        finally:
            source.close()
    a, b = median(without), median(with_ebpf)
    return {
        "ebpf_overhead_pct": median(gauge) if gauge else None,
        "ebpf_slowdown_pct": 100 * (b - a) / a,
        "busy_s_without": a,
        "busy_s_with": b,
    }


def main() -> None:
    p = parser(__doc__.split("\n\n")[0], default_runs=3)
    args = p.parse_args()
    n = runs_of(args)
    window = 5.0 if args.quick else 15.0
    clusters, ingests = [], []
    for i in range(n):
        clusters.append(cluster_run(window))
        log(f"run {i + 1}/{n} cluster: {clusters[-1]}")
        ingests.append(ingest_run(window))
        log(f"run {i + 1}/{n} ingest: {ingests[-1]}")
    try:
        eb = ebpf_run(3 if args.quick else 5)
    except Exception as e:  # the source failed to load: report why, keep the rest
        eb = {"ebpf_overhead_pct": None, "ebpf_reason": f"{type(e).__name__}: {e}"}
    log(f"ebpf: {eb}")

    def med(rows: list[dict[str, Any]], key: str, nd: int = 2) -> float | None:
        vals = [x[key] for x in rows if x.get(key) is not None]
        return r(median(vals), nd) if vals else None

    emit(
        {
            "runs": n,
            "window_s": window,
            "cpu_count": os.cpu_count(),
            "log_streams": STREAMS,
            "log_streams_receiving": min(x["log_streams_receiving"] for x in clusters),
            "agent_jobs": 4,
            "sim_nodes": SIM_NODES,
            "metrics_per_node_per_s": METRICS_PER_NODE,
            "pusher_cpu_pct_100_nodes": med(ingests, "pusher_cpu_pct_100_nodes"),
            "ingest_seconds_visible": ingests[-1]["ingest_seconds_visible"],
            "ingest_latency_p50_ms": med(ingests, "ingest_latency_p50_ms"),
            "push_failures": sum(x["push_failures"] for x in ingests),
            **{k: r(v, 3) if isinstance(v, float) else v for k, v in eb.items()},
            "log_streams_100_cpu_pct": med(clusters, "log_streams_100_cpu_pct"),
            "ingest_latency_p99_ms": med(ingests, "ingest_latency_p99_ms"),
            "agent_cpu_pct": med(clusters, "agent_cpu_pct"),
            "ebpf_overhead_pct": r(eb.get("ebpf_overhead_pct"), 3),
        }
    )


if __name__ == "__main__":
    main()
