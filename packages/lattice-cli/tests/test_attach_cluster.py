"""``lattice attach`` on a real local cluster, driven through a PTY with pexpect: the
window size and its changes, Ctrl-C to a remote `sleep`, the exit status, nothing of
the session left afterwards, another user refused, the 6th concurrent attach refused
with the specification's message, and piped (non-interactive) use."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from lattice_test_harness.cluster import ClusterHandle
from lattice_test_harness.plugin import make_cluster

pexpect = pytest.importorskip("pexpect")

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    h = make_cluster(tmp_path_factory.mktemp("attach"), members=1, agents=1)
    yield h
    h.cluster.stop()


@pytest.fixture(scope="module")
def alloc_id(cluster: ClusterHandle) -> str:
    a = cluster.submit("sleep 300")
    cluster.wait_state(a["id"], "Running", timeout=30)
    return str(a["id"])


def _spawn(cluster: ClusterHandle, *args: str, user: str | None = None) -> pexpect.spawn:
    env = cluster.cli_env()
    env["SHELL"] = "/bin/sh"  # ours; the remote shell is the agent's $SHELL
    if user:
        env["USER"] = user
    child = pexpect.spawn(
        sys.executable,
        ["-m", "lattice_cli.main", "attach", *args],
        env=env,
        dimensions=(24, 80),
        timeout=20,
    )
    return child


def _shells_of(alloc_id: str) -> list[int]:
    """Processes whose environment says they belong to an attach of ``alloc_id``:
    started by the agent with LATTICE_ALLOC_ID, in a session other than the job's."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        mine = f"LATTICE_ALLOC_ID={alloc_id}".encode() in env
        job = b"sleep\x00300" in cmd or b"sleep 300" in cmd or b"lattice-wrapper" in cmd
        if mine and not job:
            out.append(int(name))
    return out


def _marker(child: pexpect.spawn, n: int) -> None:
    child.expect(f"MK{n}")


def test_interactive_attach(cluster: ClusterHandle, alloc_id: str) -> None:
    child = _spawn(cluster, alloc_id, "--command", "/bin/sh")
    child.sendline("stty size; echo MK$((1+1))")
    child.expect(r"24 80\s+MK2")
    child.setwinsize(40, 132)  # SIGWINCH here -> resize there
    time.sleep(0.5)
    child.sendline("stty size; echo MK$((2+1))")
    child.expect(r"40 132\s+MK3")
    child.sendline("sleep 30")
    time.sleep(0.7)
    t0 = time.monotonic()
    child.sendcontrol("c")  # raw mode here: ^C travels as a byte; the remote PTY signals
    child.sendline("echo rc=$?; echo MK$((3+1))")
    child.expect(r"rc=130\s+MK4", timeout=10)
    assert time.monotonic() - t0 < 10
    child.sendline("echo $LATTICE_ALLOC_ID; exit 3")
    child.expect(alloc_id)
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 3
    # nothing of the session is left
    deadline = time.monotonic() + 5
    while _shells_of(alloc_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _shells_of(alloc_id) == []


def test_default_shell_and_terminal_restored(cluster: ClusterHandle, alloc_id: str) -> None:
    child = _spawn(cluster, alloc_id)
    child.sendline("echo MK$((4+1))")
    child.expect("MK5")
    child.sendline("exit 0")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_another_user_is_refused(cluster: ClusterHandle, alloc_id: str) -> None:
    child = _spawn(cluster, alloc_id, user="mallory")
    child.expect(pexpect.EOF)
    child.close()
    text = child.before.decode(errors="replace")
    assert child.exitstatus == 1
    assert "only its owner may attach" in text, text


def test_sixth_concurrent_attach_is_refused(cluster: ClusterHandle, alloc_id: str) -> None:
    children = []
    try:
        for i in range(5):
            c = _spawn(cluster, alloc_id, "--command", "/bin/sh")
            c.sendline(f"echo MK$((10+{i}))")
            c.expect(f"MK{10 + i}")
            children.append(c)
        sixth = _spawn(cluster, alloc_id, "--command", "/bin/sh")
        sixth.expect(pexpect.EOF)
        sixth.close()
        text = re.sub(r"\s+", " ", sixth.before.decode(errors="replace"))
        assert sixth.exitstatus == 1
        assert (
            "maximum concurrent sessions reached (5/5). Close an existing session to open "
            "a new one." in text
        ), text
    finally:
        for c in children:
            c.sendline("exit")
            c.expect(pexpect.EOF)
            c.close()
    # the slots are free again
    again = _spawn(cluster, alloc_id, "--command", "/bin/sh")
    again.sendline("exit 7")
    again.expect(pexpect.EOF)
    again.close()
    assert again.exitstatus == 7


def test_piped_stdin_runs_without_a_tty(cluster: ClusterHandle, alloc_id: str) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "lattice_cli.main",
            "attach",
            alloc_id,
            "--",
            "sh",
            "-c",
            "tr a-z A-Z; test -t 0 || echo no-tty >&2; exit 2",
        ],
        input="hello\n",
        capture_output=True,
        text=True,
        env=cluster.cli_env(),
        timeout=30,
    )
    assert (r.stdout, r.stderr.strip(), r.returncode) == ("HELLO\n", "no-tty", 2)


def test_killed_cli_hangs_the_session_up(cluster: ClusterHandle, alloc_id: str) -> None:
    child = _spawn(cluster, alloc_id, "--command", "/bin/sh")
    child.sendline("echo MK$((20+1))")
    child.expect("MK21")
    assert _shells_of(alloc_id)
    child.kill(15)  # SIGTERM: the terminal is restored, the socket closed
    child.expect(pexpect.EOF)
    child.close()
    deadline = time.monotonic() + 10
    while _shells_of(alloc_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _shells_of(alloc_id) == []
