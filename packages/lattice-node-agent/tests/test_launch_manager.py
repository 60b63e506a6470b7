"""LaunchManager across several in-process agents talking real gRPC on loopback.

Each "agent" is a grpclib server with NodeAgentService and its own LaunchManager,
FenceRegistry and AgentChannels; the launch is sent to all of them as the API does.
Covers the two-level fence tree with real MPICH ranks, abort spreading, validation
of the layout, PMIx refusal and the agent token.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpclib
import pytest
from grpclib.server import Server
from lattice_agent.pmi.fence import FenceRegistry
from lattice_agent.pmi.launches import LaunchManager
from lattice_agent.runtime import ProcessRuntime
from lattice_agent.service import NodeAgentService, require_token
from lattice_common.agents import AgentChannels
from lattice_common.proto.lattice import v1
from lattice_common.rpc import decode_grpc_error
from lattice_common.types import AllocationState
from lattice_test_harness import builders as b
from mpi_programs import compile_mpi, needs_mpicc

pytestmark = pytest.mark.timeout(120)

RANK_SUM = r"""
#include <mpi.h>
#include <stdio.h>
int main(int argc, char **argv) {
    int rank, size, sum = -1;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Allreduce(&rank, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    printf("rank=%d size=%d sum=%d\n", rank, size, sum);
    MPI_Finalize();
    return 0;
}
"""


class Agents:
    """N agents named n0..n{N-1}; ``alloc`` runs on all of them."""

    def __init__(self, tmp: Path, n: int, token: str | None = None, fanout: int = 128) -> None:
        self.alloc = b.allocation(state=AllocationState.RUNNING, user="u", submit_dir=str(tmp))
        self.alloc.assigned_nodes = [f"n{i}" for i in range(n)]
        self.tmp = tmp
        self.n = n
        self.token = token
        self.fanout = fanout
        self.servers: list[Server] = []
        self.managers: list[LaunchManager] = []
        self.channels: list[AgentChannels] = []
        self.addresses: list[str] = []
        self.client = AgentChannels(token)

    async def start(self) -> None:
        for i in range(self.n):
            node = f"n{i}"
            ch = AgentChannels(self.token)
            fences = FenceRegistry()
            mgr = LaunchManager(
                node,
                allocation=lambda aid: self.alloc if aid == self.alloc.id else None,
                work_dir=self.tmp / node / "work",
                log_dir=self.tmp / node / "logs",
                channels=ch,
                fences=fences,
                fence_timeout=10.0,
                tree_fanout=self.fanout,
                retain_seconds=30.0,
                peer_lost_after=1.0,
            )
            runtime = ProcessRuntime(
                node_id=node,
                work_dir=self.tmp / node / "work",
                log_dir=self.tmp / node / "logs",
                state_file=self.tmp / node / "state.json",
            )
            server = Server(
                [NodeAgentService(node, runtime, self.tmp, fences=fences, launches=mgr)]
            )
            require_token(server, self.token)
            await server.start("127.0.0.1", 0)
            port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self.servers.append(server)
            self.managers.append(mgr)
            self.channels.append(ch)
            self.addresses.append(f"127.0.0.1:{port}")

    async def close(self) -> None:
        for mgr in self.managers:
            await mgr.close()
        for s in self.servers:
            s.close()
        for ch in (*self.channels, self.client):
            ch.close()

    def requests(
        self, argv: list[str], per_node: list[int], task_id: str = "t1", mpi: str = ""
    ) -> list[v1.LaunchProcessesRequest]:
        nodes = [f"n{i}" for i in range(len(per_node))]
        return [
            v1.LaunchProcessesRequest(
                allocation_id=self.alloc.id,
                task_id=task_id,
                argv=argv,
                first_rank=sum(per_node[:i]),
                local_tasks=per_node[i],
                world_size=sum(per_node),
                mpi=mpi,
                peer_agents=self.addresses[: len(per_node)],
                node_ids=nodes,
                ranks_per_node=per_node,
            )
            for i in range(len(per_node))
        ]

    async def launch(self, reqs: list[v1.LaunchProcessesRequest]) -> list[list[v1.LaunchEvent]]:
        await asyncio.gather(
            *(self.client.stub(self.addresses[i]).launch_processes(r) for i, r in enumerate(reqs))
        )
        return await asyncio.gather(*(self.events(i, reqs[i].task_id) for i in range(len(reqs))))

    async def events(self, i: int, task_id: str) -> list[v1.LaunchEvent]:
        req = v1.WatchLaunchRequest(allocation_id=self.alloc.id, task_id=task_id)
        return [ev async for ev in self.client.stub(self.addresses[i]).watch_launch(req)]


@contextlib.asynccontextmanager
async def agents(tmp: Path, n: int, **kw: object) -> AsyncIterator[Agents]:
    a = Agents(tmp, n, **kw)  # type: ignore[arg-type]
    await a.start()
    try:
        yield a
    finally:
        await a.close()


def _output(events: list[list[v1.LaunchEvent]]) -> list[str]:
    return sorted(e.output.line for evs in events for e in evs if e.output is not None)


def _done(events: list[v1.LaunchEvent]) -> v1.LaunchDone:
    assert events[-1].node_done is not None
    return events[-1].node_done


@needs_mpicc
@pytest.mark.parametrize(("nodes", "fanout"), [(2, 128), (3, 2), (5, 2)])
async def test_mpich_across_agents_star_and_tree(tmp_path: Path, nodes: int, fanout: int) -> None:
    prog = compile_mpi(tmp_path, "ranksum", RANK_SUM)
    async with agents(tmp_path, nodes, fanout=fanout) as a:
        per_node = [2] * nodes
        size = sum(per_node)
        events = await a.launch(a.requests([str(prog)], per_node))
    want = sorted(f"rank={r} size={size} sum={size * (size - 1) // 2}" for r in range(size))
    assert _output(events) == want
    for evs in events:
        assert evs[0].start is not None and list(evs[0].start.ranks_per_node) == per_node
        assert _done(evs).exit_status == 0 and not _done(evs).aborted


async def test_failed_rank_aborts_every_node_with_its_status(tmp_path: Path) -> None:
    script = '[ "$LATTICE_RANK" = 2 ] && { sleep 0.3; exit 9; }; exec sleep 60'
    async with agents(tmp_path, 2) as a:
        events = await asyncio.wait_for(
            a.launch(a.requests(["/bin/sh", "-c", script], [2, 2], mpi="none")), 30
        )
    for evs in events:
        done = _done(evs)
        assert done.aborted and done.exit_status == 9
        assert done.failed_rank == 2 and done.failed_node == "n1"
        assert done.reason == "rank 2 exited with code 9"
    codes = {**events[0][-1].node_done.rank_exit_codes, **events[1][-1].node_done.rank_exit_codes}
    assert codes == {0: 137, 1: 137, 2: 9, 3: 137}


async def test_lost_peer_aborts_the_launch(tmp_path: Path) -> None:
    async with agents(tmp_path, 2) as a:
        reqs = a.requests(["sleep", "60"], [1, 1], mpi="none")
        await asyncio.gather(
            *(a.client.stub(a.addresses[i]).launch_processes(r) for i, r in enumerate(reqs))
        )
        # the second agent vanishes without a word: its server and connections go away
        a.servers[1].close()
        await a.servers[1].wait_closed()
        a.channels[0].close()
        events = await asyncio.wait_for(a.events(0, "t1"), 20)
    done = _done(events)
    assert done.aborted and done.failed_node == "n1"
    assert done.reason.startswith("node n1 lost: its agent stopped answering")


async def test_layout_is_checked_and_nothing_starts(tmp_path: Path) -> None:
    async with agents(tmp_path, 2) as a:
        stub = a.client.stub(a.addresses[0])
        bad = a.requests(["true"], [1, 1])[0]
        bad.first_rank = 1  # n0 holds ranks 0.. in the layout
        with pytest.raises(grpclib.GRPCError) as e:
            await stub.launch_processes(bad)
        assert "do not match the layout" in decode_grpc_error(e.value).message
        other = a.requests(["true"], [1])[0]
        other.allocation_id = "not-here"
        with pytest.raises(grpclib.GRPCError) as e:
            await stub.launch_processes(other)
        assert e.value.status == grpclib.const.Status.NOT_FOUND
        pmix = a.requests(["true"], [1], mpi="pmix")[0]
        with pytest.raises(grpclib.GRPCError) as e:
            await stub.launch_processes(pmix)
        err = decode_grpc_error(e.value)
        assert e.value.status == grpclib.const.Status.UNIMPLEMENTED
        assert "OpenPMIx" in err.message + err.hint and "--pmi=pmi2" in err.hint
        assert a.managers[0]._launches == {}


def test_pmix_refusal_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import ctypes.util

    from lattice_agent.pmi.launches import pmix_refusal

    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    err = pmix_refusal("n0")
    assert "libpmix) is not installed" in err.message and "libpmix-dev" in err.hint
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "libpmix.so.2")
    err = pmix_refusal("n0")
    assert "has OpenPMIx (libpmix.so.2" in err.message and "no PMIx sidecar" in err.message
    assert "--pmi=pmi2" in err.hint


async def test_agent_refuses_calls_without_its_token(tmp_path: Path) -> None:
    async with agents(tmp_path, 1, token="s3cret") as a:
        anonymous = AgentChannels(None)
        try:
            req = a.requests(["true"], [1])[0]
            with pytest.raises(grpclib.GRPCError) as e:
                await anonymous.stub(a.addresses[0]).launch_processes(req)
            assert e.value.status == grpclib.const.Status.UNAUTHENTICATED
            assert "s3cret" not in (e.value.message or "")
            events = await a.launch([req])  # with the token it runs
            assert _done(events[0]).exit_status == 0
        finally:
            anonymous.close()


async def test_environment_of_ranks(tmp_path: Path) -> None:
    script = (
        'echo "$LATTICE_ALLOC_ID $LATTICE_NODELIST $LATTICE_NNODES $LATTICE_NPROCS '
        "$LATTICE_LOCAL_RANK $LATTICE_LOCAL_SIZE $SLURM_PROCID $SLURM_LOCALID $SLURM_NPROCS "
        '$SLURM_NODELIST ${PMI_FD:+fd} $PMI_RANK $PMI_SIZE $PMI_SPAWNED $FOO"'
    )
    async with agents(tmp_path, 2) as a:
        reqs = a.requests(["/bin/sh", "-c", script], [1, 2])
        for r in reqs:
            r.env = {"FOO": "bar"}
        events = await a.launch(reqs)
    aid = a.alloc.id
    assert _output(events) == sorted(
        [
            f"{aid} n0,n1 2 3 0 1 0 0 3 n0,n1 fd 0 3 0 bar",
            f"{aid} n0,n1 2 3 0 2 1 0 3 n0,n1 fd 1 3 0 bar",
            f"{aid} n0,n1 2 3 1 2 2 1 3 n0,n1 fd 2 3 0 bar",
        ]
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


async def test_running_ranks_are_measured_with_their_allocation(tmp_path: Path) -> None:
    """Telemetry counts a launch's ranks on every node, also where the allocation's batch
    script does not run: ProcCollector over the manager's process groups."""
    from lattice_agent.telemetry.loop import running_targets
    from lattice_agent.telemetry.proc import ProcCollector

    busy = "end=$(( $(date +%s) + 3 )); while [ $(date +%s) -lt $end ]; do :; done"
    async with agents(tmp_path, 2) as a:
        reqs = a.requests(["/bin/sh", "-c", busy], [1, 2], mpi="none")
        await asyncio.gather(
            *(a.client.stub(a.addresses[i]).launch_processes(r) for i, r in enumerate(reqs))
        )
        groups = a.managers[1].process_groups()
        assert len(groups[a.alloc.id]) == 2  # the second node's two ranks
        targets = running_targets("n1", {a.alloc.id: a.alloc}, [], None, groups)
        collector = ProcCollector()
        collector.collect(targets)
        await asyncio.sleep(1.0)
        values = collector.collect(targets)[a.alloc.id]
        assert values["cpu_utilization"] > 20  # two busy ranks: well above idle
        await asyncio.gather(*(a.events(i, "t1") for i in range(2)))
        assert a.managers[1].process_groups() == {}  # ended: nothing left to measure
