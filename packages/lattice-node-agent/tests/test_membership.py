"""Membership changes told to a real job: ``$LATTICE_NODES_FILE`` and SIGUSR2 to the
processes of its group that handle it (lattice_agent.membership)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from lattice_agent import membership
from lattice_agent.membership import Membership, plan
from lattice_agent.procgroup import group_members
from lattice_common.types import Allocation, AllocationReport, AllocationState
from lattice_test_harness import builders


def alloc(nodes: list[str], state: AllocationState = AllocationState.RUNNING) -> Allocation:
    a = builders.allocation(id="a1", state=state, nodes=4, min_nodes=2)
    a.assigned_nodes = nodes
    return a


def test_plan_writes_first_and_tells_only_of_changes() -> None:
    a = alloc(["n0", "n1"])
    assert plan("n0", {"a1": a}, {}, ["a1"]) == [membership.Update("a1", ("n0", "n1"), False)]
    assert plan("n0", {"a1": a}, {"a1": ("n0", "n1")}, ["a1"]) == []
    grown = alloc(["n0", "n1", "n2"])
    assert plan("n0", {"a1": grown}, {"a1": ("n0", "n1")}, ["a1"]) == [
        membership.Update("a1", ("n0", "n1", "n2"), True)
    ]
    # not running here yet: written, nobody to tell
    assert plan("n0", {"a1": grown}, {"a1": ("n0", "n1")}, []) == [
        membership.Update("a1", ("n0", "n1", "n2"), False)
    ]
    # only the head node writes; a preempted allocation's list is left alone
    assert plan("n1", {"a1": grown}, {}, ["a1"]) == []
    assert plan("n0", {"a1": alloc(["n0"], AllocationState.CHECKPOINTING)}, {}, ["a1"]) == []


def wait_for(fn, timeout: float = 10.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := fn():
            return got
        time.sleep(0.05)
    raise AssertionError("timed out")


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_a_real_job_reads_the_file_on_sigusr2_and_others_are_left_alone(tmp_path: Path) -> None:
    m = Membership("n0", tmp_path)
    nodes_file = m.path("a1")
    out = tmp_path / "out.txt"
    m.sync({"a1": alloc(["n0", "n1"])}, [])  # before the job starts: the file exists
    assert nodes_file.read_text() == "n0\nn1\n"
    job = (
        f'trap \'echo "$(tr "\\n" " " < {nodes_file})" >> {out}\' USR2; '
        f"echo ready >> {out}; "
        # a child that does not handle SIGUSR2 (it would die of it); the shell waits
        # for it (a trapped signal ends each wait) rather than forking a sleep every
        # moment: a child caught between fork and exec still has the shell's handler
        # and would be signalled too
        "sleep 300 & "
        "while true; do wait; done"
    )
    p = subprocess.Popen(["/bin/sh", "-c", job], start_new_session=True)
    try:
        wait_for(lambda: out.exists() and "ready" in out.read_text())
        # the sleep has exec'd (before, the shell's fork still has its handler)
        wait_for(lambda: any(cmdline(pid).startswith(b"sleep") for pid, _ in group_members(p.pid)))
        report = AllocationReport(allocation_id="a1", phase="running", pid=p.pid)
        m.sync({"a1": alloc(["n0", "n1", "n2"])}, [report])
        assert nodes_file.read_text() == "n0\nn1\nn2\n"
        wait_for(lambda: "n0 n1 n2" in out.read_text())
        m.sync({"a1": alloc(["n0", "n1", "n2"])}, [report])  # no change: no signal
        m.sync({"a1": alloc(["n0", "n2"])}, [report])
        wait_for(lambda: out.read_text().splitlines()[-1].strip() == "n0 n2")
        assert out.read_text().count("n0") == 2
        assert m.signalled == 2
        # the background sleep (no handler) is alive: nothing was killed
        members = [pid for pid, st in group_members(p.pid) if st.state != "Z"]
        assert len(members) >= 2 and p.poll() is None
        # a restarted agent compares with the file on disk and still tells the job
        again = Membership("n0", tmp_path)
        again.sync({"a1": alloc(["n0", "n2", "n3"])}, [report])
        wait_for(lambda: out.read_text().splitlines()[-1].strip() == "n0 n2 n3")
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def test_the_releasing_file_lists_the_nodes_a_pending_scale_down_releases(tmp_path: Path) -> None:
    from lattice_common.types import ScalingStatus

    m = Membership("n0", tmp_path)
    path = tmp_path / "a1" / "releasing"
    a = alloc(["n0", "n1", "n2"])
    m.sync({"a1": a}, [])
    assert not path.exists()  # nothing pending
    a.scaling_status = ScalingStatus(target=2, releasing=["n2"], release_at=1.0, release_by=9.0)
    m.sync({"a1": a}, [])
    assert path.read_text() == "n2\n"
    other = Membership("n1", tmp_path / "n1")  # only the head node keeps it
    other.sync({"a1": a}, [])
    assert not (tmp_path / "n1" / "a1" / "releasing").exists()
    # released: the nodes file says so and the releasing file is gone
    done = alloc(["n0", "n1"])
    done.scaling_status = ScalingStatus(target=2)
    m.sync({"a1": done}, [])
    assert not path.exists()
    assert m.path("a1").read_text() == "n0\nn1\n"
