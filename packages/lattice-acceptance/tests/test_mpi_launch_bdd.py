"""Steps for features/mpi_launch.feature: ``lattice launch`` with the agents as the MPI
process manager, real MPICH programs (compiled with the installed ``mpicc``), no ssh.

The scenarios share the module's real local cluster (2 agents; PMI fence timeout 3 s
through ``LATTICE_NODE_AGENT__PMI_FENCE_TIMEOUT_SECONDS``). Users act through the real
``lattice`` CLI (the identity is ``$USER``). The ``world`` fixture cancels the
scenario's allocations afterwards.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from lattice_acceptance.world import assert_hint_line, assert_rejected, show
from lattice_test_harness.cluster import ClusterHandle
from lattice_test_harness.plugin import make_cluster
from lattice_test_harness.processes import NoSsh
from pytest_bdd import given, parsers, scenarios, then, when

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(shutil.which("mpicc") is None, reason="mpicc not installed (mpich)"),
]

scenarios("mpi_launch.feature")

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
    printf("size=%d sum=%d node=%s\n", size, sum, getenv("LATTICE_NODE_ID"));
    fflush(stdout);
    MPI_Finalize();
    return 0;
}
"""

ABORT7 = r"""
#include <mpi.h>
#include <stdio.h>
int main(int argc, char **argv) {
    int rank, x = 0;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank == 3) MPI_Abort(MPI_COMM_WORLD, 7);
    MPI_Recv(&x, 1, MPI_INT, 3, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    MPI_Finalize();
    return 0;
}
"""


@pytest.fixture(scope="module")
def mpi_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    env = {"LATTICE_NODE_AGENT__PMI_FENCE_TIMEOUT_SECONDS": "3"}
    h = make_cluster(tmp_path_factory.mktemp("mpi-bdd"), members=1, agents=2, env=env)
    yield h
    h.cluster.stop()


@pytest.fixture(scope="module")
def binaries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("mpi-bdd-bin")
    out = {}
    for name, src in (("ranksum", RANK_SUM), ("abort7", ABORT7)):
        (d / f"{name}.c").write_text(src)
        subprocess.run(["mpicc", str(d / f"{name}.c"), "-o", str(d / name)], check=True)
        out[name] = d / name
    return out


@dataclass
class World:
    cluster: ClusterHandle
    bins: dict[str, Path]
    workdir: Path
    alloc: str = ""
    pending: str = ""
    program: str = ""
    last: subprocess.CompletedProcess[str] | None = None
    took: float = 0.0
    ssh_seen: list[str] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)

    def launch(self, user: str, *args: str) -> subprocess.CompletedProcess[str]:
        env = self.cluster.cli_env()
        env["USER"] = user
        t0 = time.monotonic()
        self.last = subprocess.run(
            [sys.executable, "-m", "lattice_cli.main", "launch", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            cwd=self.workdir,
        )
        self.took = time.monotonic() - t0
        return self.last


@pytest.fixture
def world(mpi_cluster: ClusterHandle, binaries: dict[str, Path], tmp_path: Path) -> Iterator[World]:
    w = World(mpi_cluster, binaries, tmp_path)
    yield w
    for alloc_id in w.ids:
        try:
            mpi_cluster.cancel(alloc_id)
        except Exception:
            pass


# --------------------------------------------------------------------------- given


@given(parsers.parse("a running Lattice cluster with {count:d} nodes for MPI"))
def cluster_ready(world: World, count: int) -> None:
    world.cluster.wait_for(
        f"{count} Ready nodes",
        lambda: sum(n["state"] == "Ready" for n in world.cluster.nodes()) == count,
    )


@given(parsers.parse('a Running allocation of {n:d} nodes submitted by "{user}"'))
def running_allocation(world: World, n: int, user: str) -> None:
    world.cluster.user = user
    a = world.cluster.submit("sleep 600", nodes=n)
    world.ids.append(a["id"])
    world.cluster.wait_state(a["id"], "Running", timeout=30)
    world.alloc = a["id"]


@given(
    parsers.parse(
        'a Pending allocation of {n:d} nodes submitted by "{user}" that waits for capacity'
    )
)
def pending_allocation(world: World, n: int, user: str) -> None:
    world.cluster.user = user
    a = world.cluster.submit("sleep 600", nodes=n, wait_for_capacity=True)
    world.ids.append(a["id"])
    assert world.cluster.get(a["id"])["state"] == "Pending"
    world.pending = a["id"]


# --------------------------------------------------------------------------- when


@when(
    parsers.parse(
        '"{user}" runs the MPI rank-sum program with lattice launch -n 4 --tasks-per-node 2 --label'
    )
)
def run_rank_sum(world: World, user: str) -> None:
    with NoSsh() as watch:
        world.launch(user, f"--alloc={world.alloc}", "-n", "4", "--tasks-per-node", "2",
                     "--label", "--", str(world.bins["ranksum"]))  # fmt: skip
    world.ssh_seen = watch.seen


@when(
    parsers.parse(
        '"{user}" runs the MPI program whose rank 3 calls MPI_Abort with 7, 4 ranks on 2 nodes'
    )
)
def run_abort(world: World, user: str) -> None:
    world.program = "abort7"
    world.launch(user, f"--alloc={world.alloc}", "-n", "4", "--tasks-per-node", "2",
                 "--", str(world.bins["abort7"]))  # fmt: skip


@when(
    parsers.parse(
        '"{user}" runs the MPI rank-sum program with rank 3 held before MPI_Init, 4 ranks on 2 nodes'
    )
)
def run_held(world: World, user: str) -> None:
    world.program = "ranksum"
    world.launch(user, f"--alloc={world.alloc}", "-n", "4", "--tasks-per-node", "2",
                 "--", str(world.bins["ranksum"]), "3")  # fmt: skip


@when(
    parsers.parse(
        '"{user}" runs "{command}" with lattice launch --pmi none --tasks-per-node 2 --label'
    )
)
def run_plain(world: World, user: str, command: str) -> None:
    world.launch(user, f"--alloc={world.alloc}", "--pmi", "none", "--tasks-per-node", "2",
                 "--label", "--", "/bin/sh", "-c", command)  # fmt: skip


@when(parsers.parse('"{user}" runs "{command}" with lattice launch in alice\'s allocation'))
def run_in_others(world: World, user: str, command: str) -> None:
    world.launch(user, f"--alloc={world.alloc}", "--", "/bin/sh", "-c", command)


@when(
    parsers.parse('"{user}" runs "{command}" with lattice launch -n {n:d} --tasks-per-node {k:d}')
)
def run_layout(world: World, user: str, command: str, n: int, k: int) -> None:
    world.launch(user, f"--alloc={world.alloc}", "-n", str(n), "--tasks-per-node", str(k),
                 "--", "/bin/sh", "-c", command)  # fmt: skip


@when(parsers.parse('"{user}" runs "{command}" with lattice launch in the Pending allocation'))
def run_in_pending(world: World, user: str, command: str) -> None:
    world.launch(user, f"--alloc={world.pending}", "--", "/bin/sh", "-c", command)


# --------------------------------------------------------------------------- then


@then(parsers.parse("the launch exits with status {code:d}"))
def exits_with(world: World, code: int) -> None:
    assert world.last is not None and world.last.returncode == code, show(world.last)


@then(parsers.parse("the launch exits with status {code:d} within {seconds:d} seconds"))
def exits_within(world: World, code: int, seconds: int) -> None:
    exits_with(world, code)
    assert world.took < seconds


@then(
    parsers.parse(
        "every rank reports size {size:d} and the sum of all ranks {total:d}, prefixed with its rank"
    )
)
def ranks_report(world: World, size: int, total: int) -> None:
    assert world.last is not None
    lines = sorted(world.last.stdout.splitlines())
    assert [ln.split(" node=")[0] for ln in lines] == [
        f"[{r}] size={size} sum={total}" for r in range(size)
    ], show(world.last)


@then("ranks 0 and 1 ran on one node and ranks 2 and 3 on the other")
def rank_nodes(world: World) -> None:
    assert world.last is not None
    node = {int(ln[1]): ln.split("node=")[1] for ln in world.last.stdout.splitlines()}
    assert node[0] == node[1] and node[2] == node[3] and node[0] != node[2], node


@then("no ssh process existed while the launch ran")
def no_ssh(world: World) -> None:
    assert world.ssh_seen == []


@then("lattice launch says it failed at rank 3 on the node of rank 3")
def says_rank3(world: World) -> None:
    assert world.last is not None
    nodes = world.cluster.get(world.alloc)["assigned_nodes"]
    assert f"failed at rank 3 on node {nodes[1]} (exit 7)" in world.last.stderr, show(world.last)


@then(parsers.parse('lattice launch says "{text}"'))
def says(world: World, text: str) -> None:
    assert world.last is not None and text in world.last.stderr, show(world.last)


@then("no rank of the launch is still running on either node")
def no_rank_left(world: World) -> None:
    name = world.program
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        assert not (comm == name and stat != "Z"), f"rank {pid} ({name}) still runs"


@then(parsers.parse('the output is "{a}", "{b}", "{c}" and "{d}"'))
def output_is(world: World, a: str, b: str, c: str, d: str) -> None:
    assert world.last is not None
    assert sorted(world.last.stdout.splitlines()) == [a, b, c, d], show(world.last)


@then(parsers.parse('the launch is refused with "{text}"'))
def refused(world: World, text: str) -> None:
    assert world.last is not None
    assert_rejected(world.last, text)


@then("the refusal has a hint")
def refusal_hint(world: World) -> None:
    assert world.last is not None
    assert_hint_line(world.last)


@then("nothing was started")
def nothing_started(world: World) -> None:
    assert not (world.workdir / "pwned").exists()
