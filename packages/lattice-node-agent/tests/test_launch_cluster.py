"""``lattice launch`` on a real local cluster: 2 agents, real MPICH, no ssh.

The agents are the process manager: the API fans LaunchProcesses out to both, each
agent serves PMI-1 to its ranks over PMI_FD, and MPI_Init's barriers cross the nodes
through PmiFence between the agents. Fence timeout, MPI_Abort and the death of an
agent end the launch on every node.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from lattice_test_harness.cluster import ClusterHandle
from lattice_test_harness.plugin import make_cluster
from lattice_test_harness.processes import NoSsh
from mpi_programs import compile_mpi, needs_mpicc

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240), needs_mpicc]

#: the issue's check: every rank reports size N and sum(rank) = N(N-1)/2
RANK_SUM = r"""
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
int main(int argc, char **argv) {
    int rank, size, sum = -1;
    if (argc > 1 && atoi(getenv("PMI_RANK")) == atoi(argv[1])) sleep(600);
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Allreduce(&rank, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    printf("rank=%d size=%d sum=%d node=%s %s\n", rank, size, sum, getenv("LATTICE_NODE_ID"),
           sum == size * (size - 1) / 2 ? "ok" : "WRONG");
    fflush(stdout);
    if (argc > 2) sleep(atoi(argv[2]));
    MPI_Finalize();
    return 0;
}
"""

ABORT7 = r"""
#include <mpi.h>
#include <stdio.h>
#include <unistd.h>
int main(int argc, char **argv) {
    int rank, x = 0;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    printf("rank=%d pid=%d\n", rank, (int)getpid());
    fflush(stdout);
    if (rank == 3) MPI_Abort(MPI_COMM_WORLD, 7);
    MPI_Recv(&x, 1, MPI_INT, 3, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    MPI_Finalize();
    return 0;
}
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    env = {"LATTICE_NODE_AGENT__PMI_FENCE_TIMEOUT_SECONDS": "3"}
    h = make_cluster(tmp_path_factory.mktemp("mpi"), members=1, agents=2, env=env)
    yield h
    h.cluster.stop()


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("mpi-bin")
    return {"sum": compile_mpi(d, "ranksum", RANK_SUM), "abort": compile_mpi(d, "abort7", ABORT7)}


def _two_node_allocation(c: ClusterHandle) -> str:
    a = c.submit("sleep 300", nodes=2)
    c.wait_state(a["id"], "Running", timeout=30)
    return a["id"]


def _events(stdout: str) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_two_agents_two_ranks_each_real_mpich(
    cluster: ClusterHandle, programs: dict[str, Path]
) -> None:
    alloc = _two_node_allocation(cluster)
    try:
        with NoSsh() as watch:
            r = cluster.cli(
                "launch", f"--alloc={alloc}", "-n", "4", "--tasks-per-node", "2", "--label",
                "--", str(programs["sum"]),
            )  # fmt: skip
        assert r.returncode == 0, r.stderr + r.stdout
        lines = sorted(r.stdout.splitlines())
        assert len(lines) == 4, r.stdout
        for rank, line in enumerate(lines):
            assert line.startswith(f"[{rank}] rank={rank} size=4 sum=6 ")
            assert line.endswith(" ok")
        nodes = {ln.split("node=")[1].split()[0] for ln in lines}
        assert len(nodes) == 2  # ranks 0,1 on one agent, 2,3 on the other
        assert watch.samples > 5 and watch.seen == []

        # the same launch as JSON events: layout first, four rank exits, done last
        r = cluster.cli("-o", "json", "launch", f"--alloc={alloc}", "--tasks-per-node", "2",
                        "--", str(programs["sum"]))  # fmt: skip
        evs = _events(r.stdout)
        assert evs[0]["type"] == "start" and evs[0]["world_size"] == 4
        assert evs[0]["ranks_per_node"] == [2, 2]
        assert sorted(e["rank"] for e in evs if e["type"] == "rank_exit") == [0, 1, 2, 3]
        assert evs[-1]["type"] == "done" and evs[-1]["exit_status"] == 0
        assert evs[-1]["rank_exit_codes"] == {"0": 0, "1": 0, "2": 0, "3": 0}
    finally:
        cluster.cancel(alloc)


def test_mpi_abort_ends_every_rank_with_its_code(
    cluster: ClusterHandle, programs: dict[str, Path]
) -> None:
    alloc = _two_node_allocation(cluster)
    try:
        r = cluster.cli("-o", "json", "launch", f"--alloc={alloc}", "-n", "4",
                        "--tasks-per-node", "2", "--", str(programs["abort"]))  # fmt: skip
        assert r.returncode == 7, r.stderr + r.stdout
        evs = _events(r.stdout)
        done = evs[-1]
        assert done["type"] == "done" and done["aborted"] and done["exit_status"] == 7
        assert done["failed_rank"] == 3
        node_done = [e for e in evs if e["type"] == "node_done"]
        assert len(node_done) == 2 and all(e["exit_status"] == 7 for e in node_done)
        assert done["rank_exit_codes"]["3"] != 0
        assert _alive("abort7") == []  # no rank left on either node
        # the text form names the rank and the node
        r = cluster.cli("launch", f"--alloc={alloc}", "-n", "4", "--tasks-per-node", "2",
                        "--", str(programs["abort"]))  # fmt: skip
        assert r.returncode == 7
        assert "failed at rank 3 on node" in r.stderr
    finally:
        cluster.cancel(alloc)


def test_fence_timeout_aborts_the_launch(cluster: ClusterHandle, programs: dict[str, Path]) -> None:
    alloc = _two_node_allocation(cluster)
    try:
        # rank 3 never reaches MPI_Init: the first barrier cannot complete
        t0 = time.monotonic()
        r = cluster.cli("-o", "json", "launch", f"--alloc={alloc}", "-n", "4",
                        "--tasks-per-node", "2", "--", str(programs["sum"]), "3")  # fmt: skip
        took = time.monotonic() - t0
        assert r.returncode == 1, r.stderr + r.stdout
        done = _events(r.stdout)[-1]
        assert done["aborted"] and done["reason"].startswith("PMI fence timeout")
        assert took < 30
        assert set(done["rank_exit_codes"]) == {"0", "1", "2", "3"}
    finally:
        cluster.cancel(alloc)


def test_agent_death_aborts_the_launch(cluster: ClusterHandle, programs: dict[str, Path]) -> None:
    alloc = _two_node_allocation(cluster)
    victim = None
    try:
        holder: dict[str, object] = {}

        def run() -> None:
            holder["r"] = cluster.cli("-o", "json", "launch", f"--alloc={alloc}", "-n", "4",
                                      "--tasks-per-node", "2", "--", str(programs["sum"]),
                                      "-1", "120")  # fmt: skip

        t = threading.Thread(target=run)
        t.start()
        # every rank is past MPI_Init (it printed), then the second node's agent dies
        a = cluster.get(alloc)
        second = a["assigned_nodes"][1]
        victim = next(ag for ag in cluster.cluster.agents if ag.node_id == second)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not _ranks_running(second):
            time.sleep(0.1)
        # a launch that failed before its ranks ran says why on stderr
        assert _ranks_running(second), holder.get("r") or "no ranks and no answer in 30 s"
        time.sleep(1.0)
        victim.proc.send_signal(signal.SIGKILL)
        t.join(60)
        r = holder["r"]
        assert r.returncode == 1, r.stderr + r.stdout  # type: ignore[attr-defined]
        done = _events(r.stdout)[-1]  # type: ignore[attr-defined]
        assert done["aborted"] and done["failed_node"] == second
        assert f"node {second} lost" in done["reason"]
        time.sleep(0.5)
        assert not _ranks_running(second), "ranks of the dead agent survived it"
        assert not _ranks_running(a["assigned_nodes"][0])
    finally:
        if victim is not None:
            cluster.cluster.start_agent(victim)
        cluster.cancel(alloc)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _alive(comm: str, node_id: str = "") -> list[int]:
    """Live (not zombie) processes named ``comm``, on ``node_id`` when given."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name != comm or _state(int(pid)) in ("Z", "gone"):
            continue
        if not node_id or f"LATTICE_NODE_ID={node_id}".encode() in env:
            found.append(int(pid))
    return found


def _ranks_running(node_id: str) -> bool:
    return bool(_alive("ranksum", node_id))


@pytest.fixture(scope="module")
def fabric() -> Iterator[tuple[object, asyncio.AbstractEventLoop]]:
    """The fake fabric manager on its own loop in a thread (the cluster is other processes)."""
    from lattice_test_harness.fake_fabric import FakeFabricManager

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    fake = FakeFabricManager(token="fm-token")
    asyncio.run_coroutine_threadsafe(fake.start(), loop).result(10)
    yield fake, loop
    asyncio.run_coroutine_threadsafe(fake.stop(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def test_cxi_credentials_per_launch(
    tmp_path_factory: pytest.TempPathFactory, fabric: tuple[object, object]
) -> None:
    fake, _ = fabric
    env = {
        "LATTICE_NETWORK__FABRIC_MANAGER_URL": fake.url,  # type: ignore[attr-defined]
        "LATTICE_FABRIC_MANAGER_TOKEN": "fm-token",
    }
    c = make_cluster(tmp_path_factory.mktemp("cxi"), members=1, agents=2, env=env)
    try:
        alloc = _two_node_allocation(c)
        script = 'echo "$FI_PROVIDER $FI_CXI_DEFAULT_VNI $FI_CXI_AUTH_KEY"'
        r = c.cli("-o", "json", "launch", f"--alloc={alloc}", "--pmi", "none",
                  "--", "/bin/sh", "-c", script)  # fmt: skip
        assert r.returncode == 0, r.stderr + r.stdout
        evs = _events(r.stdout)
        lines = {e["line"] for e in evs if e["type"] == "output"}
        task_id = evs[0]["task_id"]
        revoked = fake.revoked  # type: ignore[attr-defined]
        deadline = time.monotonic() + 10
        while not revoked and time.monotonic() < deadline:  # revoked when the launch ends
            time.sleep(0.05)
        assert len(revoked) == 1
        live = fake.services.values()  # type: ignore[attr-defined]
        records = [s for s in live if s["launch_id"] == task_id]
        created = [p for m, p in fake.requests if m == "POST"]  # type: ignore[attr-defined]
        assert len(created) == 1
        assert records == []  # no longer live
        # every rank saw the same credentials the fabric manager handed out
        assert len(lines) == 1
        provider, vni, key = next(iter(lines)).split()
        assert provider == "cxi" and int(vni) >= 1000 and len(key) == 64
    finally:
        c.cluster.stop()
