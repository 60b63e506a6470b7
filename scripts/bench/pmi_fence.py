"""Latency of the cross-node PMI fence (star) and of the launch fan-out, over real gRPC.

Fence: one real ``NodeAgentService`` (with a ``FenceRegistry``) serves on loopback. For
N in 2, 16, 64, 128 simulated agents: a ``FenceCoordinator`` for N nodes is registered,
N client channels each send one ``PmiFenceRequest`` per epoch, all N are fired at once,
and the latency of one fence is the time from the first send to the last response.
Each N runs ``--runs`` epochs (after one unmeasured warm-up epoch); the median is
reported. The default payload is what MPICH's PMI-1 puts per fence: one business card
per rank (~100-200 hex characters), 4 ranks per node, so 4 keys of 160 characters per
node (``--keys-per-node``, ``--value-bytes`` show a payload-bound case). Every node
re-puts the same keys each epoch, so each answer holds keys-per-node * N keys.
The server and all N clients share one process and one event loop, so the figure
includes the clients' encoding/decoding as well (real agents do that in parallel).

Fan-out: 256 simulated agents (grpclib servers, each a ``NodeAgentService`` whose
LaunchProcesses answers at once with pids) run in ``--server-procs`` child processes
(default 1: the servers do not share the client's loop, and on a 2-core machine one
core is left to the client). The client is the API's real code path,
``LaunchOps._fan_out`` over ``AgentChannels``, with the requests ``launch_tasks``
builds (4 ranks per node, all 256 peer addresses and node ids in each). The first
call is cold (connections opened), then ``--runs`` warm calls; the median is reported.

    uv run python scripts/bench/pmi_fence.py [--runs N] [--quick]
        [--keys-per-node K] [--value-bytes B] [--server-procs P]

Goals: fence < 10 ms at N=128; fan-out to 256 agents < 100 ms.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, emit, log, median, parser, r, runs_of

for pkg in ("lattice-node-agent", "lattice-common", "lattice-quorum", "lattice-api"):
    sys.path.insert(0, str(REPO / "packages" / pkg / "src"))

from grpclib.client import Channel  # noqa: E402
from grpclib.server import Server  # noqa: E402
from lattice_agent.pmi.fence import FenceCoordinator, FenceRegistry  # noqa: E402
from lattice_agent.pmi.wire import decode_kvs, encode_kvs  # noqa: E402
from lattice_agent.service import NodeAgentService  # noqa: E402
from lattice_common.proto.lattice import v1  # noqa: E402

SIZES = (2, 16, 64, 128)
QUICK_SIZES = (2, 16)
KEYS_PER_NODE = 4  # one business card per rank, 4 ranks per node
VALUE_BYTES = 160  # hex characters of one MPICH business card (~100-200)
FANOUT_AGENTS = 256
RANKS_PER_NODE = 4
SERVE_FLAG = "--serve-agents"


def node_kvs(node: str, keys: int, value_bytes: int) -> dict[str, str]:
    return {
        f"{node}-card-{k}": os.urandom(value_bytes // 2 + 1).hex()[:value_bytes]
        for k in range(keys)
    }


async def fence_size(
    port: int, registry: FenceRegistry, n: int, epochs: int, keys: int, value_bytes: int
) -> float:
    nodes = [f"node{i:04d}" for i in range(n)]
    task = f"launch-{n}"
    registry.register("bench", task, FenceCoordinator(nodes, timeout=60))
    channels = [Channel("127.0.0.1", port) for _ in nodes]
    try:
        stubs = [v1.NodeAgentServiceStub(ch) for ch in channels]
        kvs = {node: node_kvs(node, keys, value_bytes) for node in nodes}
        samples: list[float] = []
        for epoch in range(epochs + 1):  # epoch 0: warm-up (connections, first encode)
            reqs = [
                v1.PmiFenceRequest(
                    allocation_id="bench",
                    task_id=task,
                    epoch=epoch,
                    node_id=nd,
                    kvs_json=encode_kvs(kvs[nd]),
                )
                for nd in nodes
            ]
            t0 = time.perf_counter()
            replies = await asyncio.gather(
                *(stub.pmi_fence(req) for stub, req in zip(stubs, reqs, strict=True))
            )
            dt = time.perf_counter() - t0
            assert all(len(decode_kvs(rep.kvs_json)) == n * keys for rep in replies)
            if epoch:
                samples.append(dt)
        return median(samples) * 1000
    finally:
        for ch in channels:
            ch.close()
        registry.remove("bench", task)


async def fence_all(
    epochs: int, sizes: tuple[int, ...], keys: int, value_bytes: int
) -> dict[str, float | None]:
    registry = FenceRegistry()
    service = NodeAgentService("head", cast(Any, None), Path("."), fences=registry)
    server = Server([service])
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        out: dict[str, float | None] = {}
        for n in sizes:
            ms = await fence_size(port, registry, n, epochs, keys, value_bytes)
            log(f"fence N={n:4d}: median {ms:.2f} ms over {epochs} epochs")
            out[str(n)] = r(ms)
        return out
    finally:
        server.close()
        await server.wait_closed()


# --- fan-out: simulated agents (child process) --------------------------------------------


class InstantAgent(NodeAgentService):
    """LaunchProcesses answers at once with made-up pids; nothing is started."""

    async def launch_processes(
        self, message: v1.LaunchProcessesRequest
    ) -> v1.LaunchProcessesResponse:
        first = 10_000 + message.first_rank
        return v1.LaunchProcessesResponse(
            task_id=message.task_id, pids=list(range(first, first + message.local_tasks))
        )


async def serve_agents(count: int) -> None:
    """Child process: ``count`` agents on loopback; their ports as one JSON line on
    stdout; they serve until stdin closes."""
    servers = []
    ports = []
    for i in range(count):
        server = Server([InstantAgent(f"sim{i:04d}", cast(Any, None), Path("."))])
        await server.start("127.0.0.1", 0)
        servers.append(server)
        ports.append(server._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    print(json.dumps(ports), flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)
    for server in servers:
        server.close()
    for server in servers:
        await server.wait_closed()


def start_agents(count: int, procs: int) -> tuple[list[subprocess.Popen[str]], list[int]]:
    children: list[subprocess.Popen[str]] = []
    ports: list[int] = []
    try:
        for p in range(procs):
            share = count // procs + (1 if p < count % procs else 0)
            children.append(
                subprocess.Popen(
                    [sys.executable, __file__, SERVE_FLAG, str(share)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for child in children:
            assert child.stdout is not None
            line = child.stdout.readline()
            if not line:
                raise RuntimeError(f"simulated agents (pid {child.pid}) did not start")
            ports.extend(json.loads(line))
    except BaseException:
        stop_agents(children)
        raise
    return children, ports


def stop_agents(children: list[subprocess.Popen[str]]) -> None:
    for child in children:
        if child.stdin is not None:
            child.stdin.close()
    for child in children:
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(5)


async def fanout(ports: list[int], runs: int) -> dict[str, Any]:
    """LaunchOps._fan_out to every agent: cold (first call), then ``runs`` warm calls."""
    from lattice_api.ops.launches import LaunchOps
    from lattice_common.agents import AgentChannels

    agents = AgentChannels()
    ops = LaunchOps(cast(Any, None), agents)  # _fan_out only uses ops.agents
    n = len(ports)
    nodes = [f"node{i:04d}" for i in range(n)]
    peers = [f"127.0.0.1:{p}" for p in ports]
    layout = [RANKS_PER_NODE] * n

    def request(task_id: str) -> v1.LaunchProcessesRequest:
        return v1.LaunchProcessesRequest(
            allocation_id="bench-alloc",
            task_id=task_id,
            argv=["./a.out", "--steps", "100"],
            world_size=n * RANKS_PER_NODE,
            env={"OMP_NUM_THREADS": "8"},
            working_dir="/home/bench/run",
            mpi="pmi1",
            peer_agents=peers,
            node_ids=nodes,
            ranks_per_node=layout,
        )

    samples: list[float] = []
    cpu: list[float] = []
    cold = float("nan")
    try:
        for run in range(runs + 1):
            template = request(f"task-{run}")
            c0, t0 = time.process_time(), time.perf_counter()
            await ops._fan_out(template)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if run == 0:
                cold = dt
            else:
                samples.append(dt)
                cpu.append(dc)
    finally:
        agents.close()
    warm = median(samples) * 1000
    log(
        f"fan-out to {n} agents: cold {cold * 1000:.1f} ms, warm median {warm:.1f} ms "
        f"over {runs} runs (client CPU {median(cpu) * 1000:.1f} ms per call)"
    )
    return {
        "warm_ms": r(warm),
        "cold_ms": r(cold * 1000),
        "client_cpu_ms": r(median(cpu) * 1000),
    }


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == SERVE_FLAG:
        asyncio.run(serve_agents(int(sys.argv[2])))
        return
    p = parser(__doc__.splitlines()[0], default_runs=20)
    p.add_argument("--keys-per-node", type=int, default=KEYS_PER_NODE)
    p.add_argument("--value-bytes", type=int, default=VALUE_BYTES, help="characters per value")
    p.add_argument("--server-procs", type=int, default=1, help="processes for the 256 agents")
    args = p.parse_args()
    epochs = runs_of(args, quick_runs=2)
    sizes = QUICK_SIZES if args.quick and args.runs is None else SIZES
    fence_ms = asyncio.run(fence_all(epochs, sizes, args.keys_per_node, args.value_bytes))
    children, ports = start_agents(FANOUT_AGENTS, max(1, args.server_procs))
    try:
        fan = asyncio.run(fanout(ports, epochs))
    finally:
        stop_agents(children)
    emit(
        {
            "fence_ms": fence_ms,
            "epochs": epochs,
            "keys_per_node": args.keys_per_node,
            "value_bytes": args.value_bytes,
            "fanout_256_ms": fan["warm_ms"],
            "fanout_256_cold_ms": fan["cold_ms"],
            "fanout_256_client_cpu_ms": fan["client_cpu_ms"],
            "fanout_server_procs": max(1, args.server_procs),
            "cpus": os.cpu_count(),
        }
    )


if __name__ == "__main__":
    main()
