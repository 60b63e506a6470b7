"""Direct mpirun (escape hatch): Hydra starts its remote proxies through the agents, not ssh.

Inside an allocation the agent sets ``HYDRA_LAUNCHER=ssh``,
``HYDRA_LAUNCHER_EXEC=lattice-mpi-launcher`` and ``HYDRA_HOST_FILE``; Hydra then
runs ``lattice-mpi-launcher -x HOST "/usr/bin/hydra_pmi_proxy" --control-port ...``
for every host, and the launcher asks its node's agent (over the allocation's Unix
socket) to start the proxy on HOST. Unit tests of the launcher and the socket first,
then a 2-agent cluster whose job runs a plain ``mpirun -np 4`` with real MPICH.
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpclib
import pytest
from grpclib.client import Channel
from grpclib.const import Status
from lattice_agent import mpi_launcher
from lattice_agent.hydra import HydraSockets
from lattice_agent.mpi_launcher import LauncherError, connectable_path, parse_ssh_argv
from lattice_agent.pmi.fence import FenceRegistry
from lattice_agent.pmi.launches import LaunchManager
from lattice_agent.spawn import environment
from lattice_agent.spawn import mpi_launcher as launcher_path
from lattice_common.agents import AgentChannels
from lattice_common.proto.lattice import v1
from lattice_common.types import Allocation, AllocationState
from lattice_test_harness import builders as b
from lattice_test_harness.cluster import ClusterHandle
from lattice_test_harness.plugin import make_cluster
from lattice_test_harness.processes import NoSsh
from mpi_programs import compile_mpi, needs_mpicc

pytestmark = pytest.mark.timeout(240)

#: what MPICH 4.0.2's Hydra runs for host node-1 (seen with a launcher logging its argv)
HYDRA_ARGV = [
    "-x", "node-1", '"/usr/bin/hydra_pmi_proxy"', "--control-port", "vm:45953", "--rmk",
    "user", "--launcher", "ssh", "--launcher-exec", "/x/lattice-mpi-launcher", "--demux",
    "poll", "--pgid", "0", "--retries", "10", "--usize", "-2", "--pmi-port", "0",
    "--gpus-per-proc", "-2", "--proxy-id", "1",
]  # fmt: skip


# ---------------------------------------------------------------- the launcher's argv


def test_parses_hydras_argv_like_ssh() -> None:
    host, command = parse_ssh_argv(HYDRA_ARGV)
    assert host == "node-1"
    assert command == " ".join(HYDRA_ARGV[2:])
    assert command.startswith('"/usr/bin/hydra_pmi_proxy" --control-port vm:45953 ')


@pytest.mark.parametrize(
    ("argv", "host", "command"),
    [
        (["-q", "-o", "BatchMode=yes", "-p", "22", "n1", "echo", "a b"], "n1", "echo a b"),
        (["-xq", "-p22", "-oStrict=no", "user@n2", "true"], "n2", "true"),
        (["--", "n3", "sh", "-c", "'exit 3'"], "n3", "sh -c 'exit 3'"),
        (["-l", "me", "n4", "hostname"], "n4", "hostname"),
    ],
)
def test_skips_ssh_options(argv: list[str], host: str, command: str) -> None:
    assert parse_ssh_argv(argv) == (host, command)


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        ([], "no host given"),
        (["-x"], "no host given"),
        (["-p"], "option -p needs an argument"),
        (["-Z", "n1", "true"], "unknown option -Z"),
        (["n1"], "no command given"),
    ],
)
def test_bad_argv(argv: list[str], error: str) -> None:
    with pytest.raises(LauncherError, match=error):
        parse_ssh_argv(argv)
    assert mpi_launcher.main(argv) == 255


def test_outside_an_allocation_a_clear_error_and_sshs_status() -> None:
    exe = launcher_path()
    assert exe, "lattice-mpi-launcher is not installed (uv sync --all-packages)"
    env = {k: v for k, v in os.environ.items() if k not in ("LATTICE_AGENT_SOCKET",)}
    r = subprocess.run(
        [exe, "-x", "node-1", "hostname"], env=env, capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 255
    assert r.stderr.startswith(
        "lattice-mpi-launcher: not inside a Lattice allocation (LATTICE_AGENT_SOCKET unset). Hint: "
    )


def test_allocation_environment_points_hydra_at_the_launcher(tmp_path: Path) -> None:
    alloc = b.allocation(state=AllocationState.RUNNING, user="u")
    env = environment(alloc, ["n0", "n1"], "n0", str(tmp_path), tmp_path / alloc.id)
    assert env["HYDRA_LAUNCHER"] == "ssh"
    assert env["HYDRA_LAUNCHER_EXEC"] == launcher_path()
    assert os.path.isabs(env["HYDRA_LAUNCHER_EXEC"])
    assert env["HYDRA_HOST_FILE"] == str(tmp_path / alloc.id / "hydra-hosts")
    assert env["LATTICE_AGENT_SOCKET"] == str(tmp_path / alloc.id / "agent.sock")


def test_long_socket_paths_go_through_proc(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    path, fd = connectable_path(str(deep / "agent.sock"))
    assert fd is not None and path == f"/proc/self/fd/{fd}/agent.sock"
    os.close(fd)
    assert connectable_path("/tmp/x.sock") == ("/tmp/x.sock", None)


# ---------------------------------------------------------------- the allocation socket


class Node:
    """One in-process agent side: a LaunchManager and its allocation sockets."""

    def __init__(self, tmp: Path, alloc: Allocation) -> None:
        self.alloc = alloc
        self.channels = AgentChannels()
        self.launches = LaunchManager(
            "n0",
            allocation=lambda aid: alloc if aid == alloc.id else None,
            work_dir=tmp / "work",
            log_dir=tmp / "logs",
            channels=self.channels,
            fences=FenceRegistry(),
            retain_seconds=30.0,
        )

        async def address_of(node: str) -> str:
            raise grpclib.GRPCError(Status.NOT_FOUND, f"node {node} not found")

        self.sockets = HydraSockets(
            "n0",
            work_dir=tmp / "work",
            launches=self.launches,
            channels=self.channels,
            address_of=address_of,
            allocation=lambda aid: alloc if aid == alloc.id else None,
            watch_grace=WATCH_GRACE,
        )


#: how long the tests' allocation sockets wait for a launcher to watch its launch
WATCH_GRACE = 2.0


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    alloc = b.allocation(state=AllocationState.RUNNING, user="u", submit_dir=str(tmp_path))
    alloc.assigned_nodes = ["n0", "n1"]
    n = Node(tmp_path, alloc)
    await n.sockets.sync({alloc.id: alloc})
    yield n
    await n.sockets.close()
    await n.launches.close()
    n.channels.close()


async def test_socket_is_the_allocations_own(node: Node) -> None:
    sock = node.sockets.path(node.alloc.id)
    assert stat.S_ISSOCK(sock.stat().st_mode)
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert (sock.parent / "hydra-hosts").read_text() == "n0\nn1\n"

    path, fd = connectable_path(str(sock))
    ch = Channel(path=path)
    stub = v1.NodeAgentServiceStub(ch)
    req = v1.LaunchProcessesRequest(
        task_id="t1", argv=["true"], local_tasks=1, world_size=1, mpi="none", node_ids=["n0"],
        ranks_per_node=[1],
    )  # fmt: skip
    try:
        for other in ("someone-elses-allocation", ""):
            req.allocation_id = other
            with pytest.raises(grpclib.GRPCError) as e:
                await stub.launch_processes(req)
            assert e.value.status == Status.PERMISSION_DENIED
            assert f"serves allocation {node.alloc.id} only" in (e.value.message or "")
            with pytest.raises(grpclib.GRPCError) as e:
                watch = v1.WatchLaunchRequest(allocation_id=other, task_id="t1")
                _ = [ev async for ev in stub.watch_launch(watch)]
            assert e.value.status == Status.PERMISSION_DENIED
        # a node outside the allocation, peers (they would receive the token), other RPCs
        req.allocation_id = node.alloc.id
        req.node_ids = ["n9"]
        with pytest.raises(grpclib.GRPCError) as e:
            await stub.launch_processes(req)
        assert e.value.status == Status.PERMISSION_DENIED
        req.node_ids = ["n0"]
        req.peer_agents = ["evil.example:1"]
        with pytest.raises(grpclib.GRPCError) as e:
            await stub.launch_processes(req)
        assert e.value.status == Status.PERMISSION_DENIED
        with pytest.raises(grpclib.GRPCError) as e:
            await stub.abort(v1.AbortRequest(allocation_id=node.alloc.id, task_id="t1"))
        assert e.value.status == Status.PERMISSION_DENIED
        with pytest.raises(grpclib.GRPCError) as e:
            _ = [ln async for ln in stub.stream_logs(v1.LogRequest(allocation_id=node.alloc.id))]
        assert e.value.status == Status.PERMISSION_DENIED
    finally:
        ch.close()
        if fd is not None:
            os.close(fd)

    # a new node list (a requeued allocation) rewrites the host file
    node.alloc.assigned_nodes = ["n0", "n2"]
    await node.sockets.sync({node.alloc.id: node.alloc})
    assert (sock.parent / "hydra-hosts").read_text() == "n0\nn2\n"
    # the allocation leaves the node: its socket goes
    await node.sockets.sync({})
    assert not sock.exists()


async def test_the_server_starts_with_the_first_connection(node: Node) -> None:
    """Most jobs never run mpirun: their socket listens from the start (a launcher can
    connect at once) but no server runs until one does, and that first one is served."""
    sock = node.sockets.path(node.alloc.id)
    assert stat.S_ISSOCK(sock.stat().st_mode)
    assert not node.sockets.serving(node.alloc.id)
    # two launchers at once: both wait in the backlog while the server starts
    codes = await asyncio.gather(
        mpi_launcher.run(str(sock), node.alloc.id, "n0", "exit 7"),
        mpi_launcher.run(str(sock), node.alloc.id, "n0", "exit 8"),
    )
    assert codes == [7, 8]
    assert node.sockets.serving(node.alloc.id)


async def test_an_unused_socket_leaves_nothing_behind(tmp_path: Path) -> None:
    alloc = b.allocation(state=AllocationState.RUNNING, user="u", submit_dir=str(tmp_path))
    alloc.assigned_nodes = ["n0"]
    n = Node(tmp_path, alloc)
    fds = len(os.listdir("/proc/self/fd"))
    try:
        for _ in range(20):  # a stream of plain jobs
            await n.sockets.sync({alloc.id: alloc})
            assert n.sockets.path(alloc.id).exists()
            assert not n.sockets.serving(alloc.id)
            await n.sockets.sync({})
            assert not n.sockets.path(alloc.id).exists()
        assert len(os.listdir("/proc/self/fd")) == fds
    finally:
        await n.sockets.close()
        await n.launches.close()
        n.channels.close()


async def test_launcher_runs_a_command_through_the_socket(
    node: Node, capfdbinary: pytest.CaptureFixture[bytes]
) -> None:
    sock = str(node.sockets.path(node.alloc.id))
    code = await mpi_launcher.run(
        sock,
        node.alloc.id,
        "n0",
        'echo out; echo err >&2; echo "rank=${LATTICE_RANK-unset} procid=${SLURM_PROCID-unset}"; '
        "exit 3",
    )
    assert code == 3
    out, err = capfdbinary.readouterr()
    assert out == b"out\nrank=unset procid=unset\n"
    assert err == b"err\n"


async def test_launcher_for_an_unknown_node_fails_like_ssh(node: Node) -> None:
    sock = str(node.sockets.path(node.alloc.id))
    with pytest.raises(LauncherError, match="n1: cannot look up node n1"):
        await mpi_launcher.run(sock, node.alloc.id, "n1", "true")


async def test_launcher_going_away_kills_the_command(node: Node, tmp_path: Path) -> None:
    sock = str(node.sockets.path(node.alloc.id))
    marker = tmp_path / "started"
    task = asyncio.create_task(
        mpi_launcher.run(sock, node.alloc.id, "n0", f"touch {marker}; exec sleep 300")
    )
    deadline = time.monotonic() + 10
    while not marker.exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert marker.exists()
    (al,) = node.launches._launches.values()
    assert al.local is not None
    (pid,) = al.local.pids.values()
    task.cancel()
    deadline = time.monotonic() + 10
    while not al.finished and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert al.finished and al.result is not None and al.result.aborted
    assert "lattice-mpi-launcher went away" in al.result.reason
    assert not Path(f"/proc/{pid}").exists() or _state(pid) == "Z"


async def test_a_launch_its_launcher_never_watches_is_ended_after_the_grace(
    node: Node, tmp_path: Path
) -> None:
    """A launcher killed between starting its command and watching it (the window
    the stream's end does not cover): the command does not outlive it for long."""
    marker = tmp_path / "started"
    path, _ = connectable_path(str(node.sockets.path(node.alloc.id)))
    channel = Channel(path=path)
    try:
        await v1.NodeAgentServiceStub(channel).launch_processes(
            v1.LaunchProcessesRequest(
                allocation_id=node.alloc.id,
                task_id="never-watched",
                argv=["/bin/sh", "-c", f"touch {marker}; exec sleep 300"],
                local_tasks=1,
                world_size=1,
                mpi="none",
                node_ids=["n0"],
                ranks_per_node=[1],
            ),
            timeout=10,
        )
    finally:
        channel.close()  # gone without a WatchLaunch
    t0 = time.monotonic()
    (al,) = node.launches._launches.values()
    assert al.local is not None
    deadline = t0 + WATCH_GRACE + 10
    while not al.finished and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert al.finished and al.result is not None and al.result.aborted
    assert al.result.reason == "lattice-mpi-launcher went away before watching it"
    assert time.monotonic() - t0 >= WATCH_GRACE - 0.1  # not before the grace
    assert marker.exists()


# ---------------------------------------------------------------- real cluster, real mpirun

#: every rank reports size 4 and sum(rank) = 6; ``node`` is the node whose agent started
#: the rank's Hydra proxy (its parent), since Hydra gives every rank mpirun's environment
#: (so $LATTICE_NODE_ID in the rank is the head node's)
RANK_SUM = r"""
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
static const char *proxy_node(void) {
    static char buf[65536];
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/environ", (int)getppid());
    FILE *f = fopen(path, "r");
    if (!f) return "?";
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    for (size_t i = 0; i < n; i += strlen(buf + i) + 1)
        if (strncmp(buf + i, "LATTICE_NODE_ID=", 16) == 0) return buf + i + 16;
    return "?";
}
int main(int argc, char **argv) {
    int rank, size, sum = -1;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Allreduce(&rank, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    printf("rank=%d size=%d sum=%d node=%s env_node=%s\n", rank, size, sum, proxy_node(),
           getenv("LATTICE_NODE_ID"));
    fflush(stdout);
    MPI_Finalize();
    return 0;
}
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    h = make_cluster(tmp_path_factory.mktemp("hydra"), members=1, agents=2)
    yield h
    h.cluster.stop()


@pytest.mark.cluster
@needs_mpicc
def test_mpirun_in_a_job_starts_remote_ranks_through_the_agents(
    cluster: ClusterHandle, tmp_path: Path
) -> None:
    prog = compile_mpi(tmp_path, "hydrasum", RANK_SUM)
    with NoSsh() as watch:
        a = cluster.submit(f"mpirun -np 4 {prog}", nodes=2)
        done = cluster.wait_state(a["id"], ("Completed", "Failed", "Cancelled"), timeout=120)
    lines = cluster.logs(a["id"])
    assert done["state"] == "Completed", "\n".join(lines)
    ranks = sorted(ln for ln in lines if ln.startswith("rank="))
    assert len(ranks) == 4, "\n".join(lines)
    head = done["assigned_nodes"][0]
    for rank, line in enumerate(ranks):
        assert line.startswith(f"rank={rank} size=4 sum=6 node=")
        assert line.endswith(f" env_node={head}")  # Hydra passes mpirun's environment on
    nodes = {ln.split("node=")[1].split()[0] for ln in ranks}
    assert nodes == set(done["assigned_nodes"])  # proxies on both nodes, via their agents
    assert watch.samples > 5 and watch.seen == []


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
