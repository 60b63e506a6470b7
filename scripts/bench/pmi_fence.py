"""Latency of the cross-node PMI fence through the head agent (star), over real gRPC.

One real ``NodeAgentService`` (with a ``FenceRegistry``) serves on loopback. For N in
2, 16, 64, 128 simulated agents: a ``FenceCoordinator`` for N nodes is registered,
N client channels each send one ``PmiFenceRequest`` per epoch carrying 4 keys with
~400 hex-character values (what MPICH's allgather of business cards puts), all N are
fired at once, and the latency of one fence is the time from the first send to the
last response. Each N runs ``--runs`` epochs (after one unmeasured warm-up epoch);
the median is reported. Every node re-puts the same 4 keys each epoch, so the merged
key space (and each answer) holds 4*N keys, as after MPI_Init.

The server and all N clients share one process and one event loop, so the figure
includes the clients' encoding/decoding as well (real agents do that in parallel).

    uv run python scripts/bench/pmi_fence.py [--runs N] [--quick]

Goal: < 10 ms at N=128. The fan-out half (LaunchProcesses to 256 agents) is not
measured: that RPC is not built yet.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, emit, log, median, parser, r, runs_of

for pkg in ("lattice-node-agent", "lattice-common"):
    sys.path.insert(0, str(REPO / "packages" / pkg / "src"))

from grpclib.client import Channel  # noqa: E402
from grpclib.server import Server  # noqa: E402
from lattice_agent.pmi.fence import FenceCoordinator, FenceRegistry  # noqa: E402
from lattice_agent.service import NodeAgentService  # noqa: E402
from lattice_common.proto.lattice import v1  # noqa: E402

SIZES = (2, 16, 64, 128)
KEYS_PER_NODE = 4
VALUE_HEX = 400


def node_kvs(node: str) -> dict[str, str]:
    return {f"{node}-card-{k}": os.urandom(VALUE_HEX // 2).hex() for k in range(KEYS_PER_NODE)}


async def fence_size(port: int, registry: FenceRegistry, n: int, epochs: int) -> float:
    nodes = [f"node{i:04d}" for i in range(n)]
    task = f"launch-{n}"
    registry.register("bench", task, FenceCoordinator(nodes, timeout=60))
    channels = [Channel("127.0.0.1", port) for _ in nodes]
    try:
        stubs = [v1.NodeAgentServiceStub(ch) for ch in channels]
        kvs = {node: node_kvs(node) for node in nodes}
        samples: list[float] = []
        for epoch in range(epochs + 1):  # epoch 0: warm-up (connections, first encode)
            reqs = [
                v1.PmiFenceRequest(
                    allocation_id="bench", task_id=task, epoch=epoch, node_id=nd, kvs=kvs[nd]
                )
                for nd in nodes
            ]
            t0 = time.perf_counter()
            replies = await asyncio.gather(
                *(stub.pmi_fence(req) for stub, req in zip(stubs, reqs, strict=True))
            )
            dt = time.perf_counter() - t0
            assert all(len(rep.kvs) == n * KEYS_PER_NODE for rep in replies)
            if epoch:
                samples.append(dt)
        return median(samples) * 1000
    finally:
        for ch in channels:
            ch.close()
        registry.remove("bench", task)


async def main_async(epochs: int, sizes: tuple[int, ...]) -> dict[str, Any]:
    registry = FenceRegistry()
    service = NodeAgentService("head", cast(Any, None), Path("."), fences=registry)
    server = Server([service])
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        out: dict[str, float | None] = {}
        for n in sizes:
            ms = await fence_size(port, registry, n, epochs)
            log(f"N={n:4d}: median fence {ms:.2f} ms over {epochs} epochs")
            out[str(n)] = r(ms)
        return out
    finally:
        server.close()
        await server.wait_closed()


def main() -> None:
    args = parser(__doc__.splitlines()[0], default_runs=20).parse_args()
    epochs = runs_of(args, quick_runs=2)
    fence_ms = asyncio.run(main_async(epochs, SIZES))
    emit(
        {
            "fence_ms": fence_ms,
            "epochs": epochs,
            "keys_per_node": KEYS_PER_NODE,
            "value_hex_chars": VALUE_HEX,
            "fanout_256_ms": None,
            "note": "fan-out needs LaunchProcesses (not built yet)",
        }
    )


if __name__ == "__main__":
    main()
