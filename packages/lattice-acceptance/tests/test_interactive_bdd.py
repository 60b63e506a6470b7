"""Steps for features/interactive.feature: `lattice session`, `lattice attach` and
`lattice salloc` in a real PTY (pexpect) against a real local cluster (one agent).

The module's cluster is shared; the ``world`` fixture closes terminals and cancels what
the scenario started."""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from lattice_test_harness.cluster import ClusterHandle
from lattice_test_harness.plugin import make_cluster
from pytest_bdd import given, parsers, scenarios, then, when

pexpect = pytest.importorskip("pexpect")

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

scenarios("interactive.feature")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    h = make_cluster(tmp_path_factory.mktemp("interactive"), members=1, agents=1)
    yield h
    h.cluster.stop()


@dataclass
class World:
    cluster: ClusterHandle
    workdir: Path
    child: Any = None
    session_id: str = ""
    alloc_id: str = ""
    started: list[str] = field(default_factory=list)
    t0: float = 0.0  # when Ctrl-C was pressed

    def spawn(self, *args: str, user: str | None = None, rows: int = 24, cols: int = 80) -> Any:
        env = self.cluster.cli_env()
        env["SHELL"] = "/bin/sh"
        if user:
            env["USER"] = user
        self.child = pexpect.spawn(
            sys.executable,
            ["-m", "lattice_cli.main", *args],
            env=env,
            dimensions=(rows, cols),
            timeout=30,
            cwd=str(self.workdir),
        )
        return self.child

    def finish(self) -> None:
        self.child.expect(pexpect.EOF)
        self.child.close()


@pytest.fixture
def world(cluster: ClusterHandle, tmp_path: Path) -> Iterator[World]:
    w = World(cluster, tmp_path)
    yield w
    if w.child is not None and w.child.isalive():
        w.child.terminate(force=True)
    for aid in [*w.started, w.alloc_id]:
        if aid and cluster.get(aid)["state"] not in ("Completed", "Failed", "Cancelled"):
            cluster.cancel(aid)


@given(parsers.parse("a running Lattice cluster with {n:d} node for interactive work"))
def cluster_ready(world: World, n: int) -> None:
    world.cluster.wait_for(
        "the node Ready", lambda: sum(x["state"] == "Ready" for x in world.cluster.nodes()) == n
    )


@given("a running allocation of mine")
def running_allocation(world: World) -> None:
    a = world.cluster.submit("sleep 300")
    world.cluster.wait_state(a["id"], "Running", timeout=30)
    world.alloc_id = a["id"]


# --- sessions ---------------------------------------------------------------------


@when("I start lattice session -N 1 -t 30m in a terminal")
def start_session(world: World) -> None:
    world.spawn("session", "-N", "1", "-t", "30m")
    world.child.expect(r"Session (\S+): allocation (\S+) queued")
    world.session_id = world.child.match.group(1).decode()
    world.alloc_id = world.child.match.group(2).decode()


@then("a shell opens in the session's allocation")
def shell_opens(world: World) -> None:
    world.child.expect("running on")
    world.child.sendline("echo in-$LATTICE_ALLOC_ID")
    world.child.expect(f"in-{world.alloc_id}")


@when(parsers.parse("I leave the shell with exit {code:d}"))
def leave_shell(world: World, code: int) -> None:
    world.child.sendline(f"exit {code}")
    world.finish()


@then(
    parsers.parse("lattice session exits with status {code:d} and its allocation is still Running")
)
def session_exit(world: World, code: int) -> None:
    assert world.child.exitstatus == code
    assert world.cluster.get(world.alloc_id)["state"] == "Running"


@then("lattice session list shows the session Running")
def session_listed(world: World) -> None:
    rows = json.loads(world.cluster.cli("session", "list", "-o", "json").stdout)
    assert (world.session_id, "Running") in [(r["id"], r["state"]) for r in rows], rows


@when("I delete the session with lattice session delete")
def delete_session(world: World) -> None:
    r = world.cluster.cli("session", "delete", world.session_id)
    assert r.returncode == 0, r.stderr


@then("its allocation ends Cancelled")
@then("the allocation ends Cancelled")
def ends_cancelled(world: World) -> None:
    world.cluster.wait_state(world.alloc_id, "Cancelled", timeout=30)


# --- attach -------------------------------------------------------------------------


@when(parsers.parse("I attach to it with lattice attach in a {rows:d}x{cols:d} terminal"))
def attach(world: World, rows: int, cols: int) -> None:
    world.spawn("attach", world.alloc_id, "--command", "/bin/sh", rows=rows, cols=cols)


@then(parsers.parse('stty size in the remote shell says "{size}"'))
def stty_size(world: World, size: str) -> None:
    world.child.sendline("echo SZ-$(stty size)-END")
    world.child.expect(f"SZ-{size}-END")


@when(parsers.parse("the local window becomes {rows:d}x{cols:d}"))
def resize(world: World, rows: int, cols: int) -> None:
    world.child.setwinsize(rows, cols)
    time.sleep(0.3)  # SIGWINCH -> resize message -> the remote PTY


@when("I run sleep 30 remotely and press Ctrl-C")
def ctrl_c(world: World) -> None:
    world.child.sendline("sleep 30; echo AFTER-$?")
    time.sleep(0.5)
    world.t0 = time.monotonic()
    world.child.sendcontrol("c")


@then(parsers.parse("the remote shell prompt comes back within {seconds:d} seconds"))
def prompt_back(world: World, seconds: int) -> None:
    world.child.sendline("echo BACK-$((1+1))")
    world.child.expect("BACK-2", timeout=seconds)
    assert time.monotonic() - world.t0 < seconds


@then(parsers.parse("lattice attach exits with status {code:d}"))
def attach_exit(world: World, code: int) -> None:
    assert world.child.exitstatus == code


@when(parsers.parse('"{user}" runs lattice attach on it'))
def other_user_attach(world: World, user: str) -> None:
    world.spawn("attach", world.alloc_id, user=user)
    world.finish()


@then(parsers.parse('the attach is refused with "{text}"'))
def attach_refused(world: World, text: str) -> None:
    assert world.child.exitstatus == 1
    assert text in world.child.before.decode(errors="replace")


# --- salloc -------------------------------------------------------------------------


@when("I run lattice salloc -N 1 -t 10:00 with a command printing $SLURM_JOB_ID")
def salloc(world: World) -> None:
    world.spawn("salloc", "-N", "1", "-t", "10:00", "sh", "-c", "echo in-$SLURM_JOB_ID; exit 6")
    world.child.expect(r"Granted job allocation (\S+)")
    world.alloc_id = world.child.match.group(1).decode()


@then("the command printed the allocation's id")
def printed_id(world: World) -> None:
    world.child.expect(f"in-{re.escape(world.alloc_id)}")


@then("salloc says it relinquished the allocation and exits with the command's status")
def relinquished(world: World) -> None:
    world.child.expect("Relinquishing job allocation")
    world.finish()
    assert world.child.exitstatus == 6
