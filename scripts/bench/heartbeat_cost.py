"""Leader CPU per heartbeat: one Heartbeat call per node against coalesced BatchHeartbeat.

The real lattice-server gRPC service (``lattice_test_harness.local_api``: the servers
over an in-process quorum, agent-token authentication) runs in a thread of its own;
``--nodes`` registered nodes each heartbeat as the simulated agents do (one running
allocation, a health summary) over real HTTP/2 connections from this process's main
thread. The CPU time of the server's thread alone (its thread clock, nanoseconds) is
divided by the heartbeats handled, so the figure does not depend on what else the
machine runs. Heartbeats go out in rounds of ``--nodes``: one call each (64 in flight,
as agents do), then ``BatchHeartbeat`` calls of ``--batch`` heartbeats (4 in flight;
the simulated agents' batch at 10,000 nodes, 4 processes and a 0.1 s window is 25).
``pct_of_core_at_10s``: what it makes for ``--at-nodes`` nodes heartbeating every 10 s.
Median of ``--runs``.

    uv run python scripts/bench/heartbeat_cost.py [--nodes 2000] [--batch 25] [--quick]

Last line of stdout: ``{"single_ms_per_heartbeat", "batch_ms_per_heartbeat",
"single_pct_of_core_at_10s", "batch_pct_of_core_at_10s", "speedup", ...}``.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, log, median, parser, r, runs_of

TOKEN = "bench-agent-token"


def _args() -> Any:
    p = parser(__doc__.split("\n\n")[0], default_runs=3)
    p.add_argument("--nodes", type=int, default=None, help="registered nodes (2000)")
    p.add_argument("--batch", type=int, default=25, help="heartbeats per BatchHeartbeat")
    p.add_argument("--rounds", type=int, default=None, help="heartbeats per node and mode (3)")
    p.add_argument("--at-nodes", type=int, default=10_000, help="nodes for the % figure")
    a = p.parse_args()
    a.nodes = a.nodes or (300 if a.quick else 2000)
    a.rounds = a.rounds or (1 if a.quick else 3)
    return a


def thread_cpu(ident: int) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


async def _measure(api: Any, ident: int, args: Any) -> dict[str, float]:
    from grpclib.client import Channel
    from lattice_common.proto.lattice import v1
    from lattice_common.rpc import auth_metadata

    host, port = api.grpc_address.rsplit(":", 1)
    channels = [Channel(host, int(port)) for _ in range(4)]
    stubs = [v1.NodeServiceStub(ch, metadata=auth_metadata(TOKEN)) for ch in channels]
    nodes = [f"hb-{i:05d}" for i in range(args.nodes)]
    seq = dict.fromkeys(nodes, 0)

    def beat(node: str) -> v1.HeartbeatRequest:
        seq[node] += 1
        return v1.HeartbeatRequest(
            node_id=node,
            sequence=seq[node],
            allocations=[
                v1.AllocationReport(
                    allocation_id=f"a-{node}", phase="running", pid=1, started_at=time.time()
                )
            ],
            generation=1,
            timestamp=time.time(),
            health=v1.HealthSummary(conformance_fingerprint="fp-0", telemetry_sources=["proc"]),
        )

    async def single_round() -> int:
        sem = asyncio.Semaphore(64)
        errors = 0

        async def one(i: int, node: str) -> None:
            nonlocal errors
            async with sem:
                out = await stubs[i % len(stubs)].heartbeat(beat(node))
                errors += bool(out.reregister)

        await asyncio.gather(*(one(i, n) for i, n in enumerate(nodes)))
        return errors

    async def batch_round() -> int:
        sem = asyncio.Semaphore(4)
        errors = 0

        async def one(i: int, chunk: list[str]) -> None:
            nonlocal errors
            async with sem:
                req = v1.BatchHeartbeatRequest(heartbeats=[beat(n) for n in chunk])
                out = await stubs[i % len(stubs)].batch_heartbeat(req)
                errors += sum(1 for x in out.results if x.error is not None or x.reregister)

        b = max(1, args.batch)
        chunks = [nodes[k : k + b] for k in range(0, len(nodes), b)]
        await asyncio.gather(*(one(i, c) for i, c in enumerate(chunks)))
        return errors

    async def reconnect(known: dict[str, int] | None) -> tuple[float, dict[str, int]]:
        """Every node opens its desired-state stream at once (as after a failover),
        telling ``known`` generations or none; the server CPU until it is idle again."""
        from grpclib.const import Cardinality

        chans = [Channel(host, int(port)) for _ in range(len(nodes) // 50 + 1)]
        gens: dict[str, int] = {}
        opened = 0
        close = asyncio.Event()
        all_open = asyncio.Event()

        async def one(i: int, node: str) -> None:
            nonlocal opened
            async with chans[i // 50].request(
                "/lattice.v1.NodeService/WatchDesiredState",
                Cardinality.UNARY_STREAM,
                v1.WatchDesiredStateRequest,
                v1.DesiredState,
                metadata=auth_metadata(TOKEN),
            ) as stream:
                req = v1.WatchDesiredStateRequest(
                    node_id=node, known_generation=(known or {}).get(node, 0)
                )
                await stream.send_message(req, end=True)
                if known is None:
                    first = await stream.recv_message()
                    assert first is not None and first.allocations, node
                    gens[node] = first.generation
                opened += 1
                if opened == len(nodes):
                    all_open.set()
                await close.wait()
                await stream.cancel()

        c0 = thread_cpu(ident)
        tasks = [asyncio.create_task(one(i, n)) for i, n in enumerate(nodes)]
        await all_open.wait()
        last = thread_cpu(ident)
        while True:  # the server is done when its thread stops using CPU
            await asyncio.sleep(0.3)
            now = thread_cpu(ident)
            if now - last < 0.002:
                break
            last = now
        used = last - c0
        close.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for ch in chans:
            ch.close()
        await asyncio.sleep(0.5)  # the server drops the streams
        return 1000.0 * used / len(nodes), gens

    out: dict[str, float] = {}
    try:
        out["reconnect_full"], gens = await reconnect(None)
        out["reconnect_known"], _ = await reconnect(gens)
        await single_round()  # warm-up: connections, first sequence numbers
        await batch_round()
        for name, round_ in (("single", single_round), ("batch", batch_round)):
            c0 = thread_cpu(ident)
            bad = 0
            for _ in range(args.rounds):
                bad += await round_()
            used = thread_cpu(ident) - c0
            if bad:
                raise RuntimeError(f"{bad} heartbeats refused in the {name} rounds")
            out[name] = 1000.0 * used / (args.rounds * args.nodes)
    finally:
        for ch in channels:
            ch.close()
    return out


def one_run(args: Any) -> dict[str, float]:
    from lattice_test_harness.local_api import ThreadedLocalApi

    server = ThreadedLocalApi(agent_token=TOKEN)
    api = server.start()
    try:
        from lattice_common.types import AllocationSpec

        api.add_tenant("bench")
        api.add_vcluster("default")
        spec = AllocationSpec(
            entrypoint="sleep infinity",
            tenant="bench",
            vcluster="default",
            user="u",
            walltime_seconds=86400,
        )
        for i in range(args.nodes):  # every node running one allocation, as at scale
            api.add_node(f"hb-{i:05d}")
            api.start(api.submit(spec).id, [f"hb-{i:05d}"])
        assert server._thread is not None and server._thread.ident is not None
        return asyncio.run(_measure(api, server._thread.ident, args))
    finally:
        server.stop()


def main() -> None:
    args = _args()
    runs = runs_of(args, quick_runs=1)
    single: list[float] = []
    batch: list[float] = []
    full: list[float] = []
    known: list[float] = []
    for i in range(runs):
        res = one_run(args)
        single.append(res["single"])
        batch.append(res["batch"])
        full.append(res["reconnect_full"])
        known.append(res["reconnect_known"])
        log(
            f"run {i + 1}/{runs}: {res['single']:.3f} ms per Heartbeat call, "
            f"{res['batch']:.3f} ms per heartbeat in batches of {args.batch}; "
            f"stream reopened {res['reconnect_full']:.3f} ms (set sent), "
            f"{res['reconnect_known']:.3f} ms (known generation)"
        )
    s, b = median(single), median(batch)
    rf, rk = median(full), median(known)
    rate = args.at_nodes / 10.0  # heartbeats per second at a 10 s interval
    emit(
        {
            "nodes": args.nodes,
            "batch": args.batch,
            "rounds": args.rounds,
            "single_ms_per_heartbeat": r(s, 4),
            "batch_ms_per_heartbeat": r(b, 4),
            "at_nodes": args.at_nodes,
            "single_pct_of_core_at_10s": r(s * rate / 10.0),
            "batch_pct_of_core_at_10s": r(b * rate / 10.0),
            "speedup": r(s / b if b > 0 else None),
            # server CPU per desired-state stream reopened at once (a failover): the
            # node's set sent again, or not (the agent's known generation is current)
            "reconnect_ms_per_stream_full": r(rf, 4),
            "reconnect_ms_per_stream_known": r(rk, 4),
            "reconnect_s_at_nodes_full": r(rf * args.at_nodes / 1000.0),
            "reconnect_s_at_nodes_known": r(rk * args.at_nodes / 1000.0),
            "single_runs": [r(x, 4) for x in single],
            "batch_runs": [r(x, 4) for x in batch],
            "runs": runs,
        }
    )


if __name__ == "__main__":
    main()
