"""``lattice session`` on a real local cluster, through a PTY with pexpect: it queues an
allocation, waits for it, opens a shell in it; leaving the shell keeps the session;
``lattice session list`` shows it and ``lattice session delete`` ends it. (Who may end
whose session is tested with signed identities in lattice-api's test_sessions_api.py:
a local cluster treats every caller as an administrator.)"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import pytest
from lattice_test_harness.cluster import ClusterHandle
from lattice_test_harness.plugin import make_cluster

pexpect = pytest.importorskip("pexpect")

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    h = make_cluster(tmp_path_factory.mktemp("session"), members=1, agents=1)
    yield h
    h.cluster.stop()


def test_session_opens_a_shell_in_its_allocation_and_outlives_it(cluster: ClusterHandle) -> None:
    env = cluster.cli_env()
    env["SHELL"] = "/bin/sh"
    child = pexpect.spawn(
        sys.executable,
        ["-m", "lattice_cli.main", "session", "-N", "1", "-t", "30m"],
        env=env,
        dimensions=(24, 80),
        timeout=30,
    )
    child.expect(r"Session (\S+): allocation (\S+) queued")
    session_id = child.match.group(1).decode()
    alloc_id = child.match.group(2).decode()
    child.expect("running on")
    child.sendline("echo inside-$LATTICE_ALLOC_ID; exit 4")
    child.expect(f"inside-{alloc_id}")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 4  # the shell's status; the session goes on
    assert cluster.get(alloc_id)["state"] == "Running"

    r = cluster.cli("session", "list", "-o", "json")
    rows = json.loads(r.stdout)
    assert [(s["id"], s["state"]) for s in rows] == [(session_id, "Running")]
    r = cluster.cli("session", "delete", session_id)
    assert r.returncode == 0 and f"Session {session_id} ended" in r.stdout
    cluster.wait_state(alloc_id, "Cancelled", timeout=30)
    r = cluster.cli("session", "delete", session_id)
    assert r.returncode == 1 and "already ended" in r.stderr


def test_salloc_runs_its_command_in_a_session_and_releases_it(cluster: ClusterHandle) -> None:
    env = cluster.cli_env()
    env["SHELL"] = "/bin/sh"
    child = pexpect.spawn(
        sys.executable,
        [
            "-m",
            "lattice_cli.main",
            "salloc",
            "-N",
            "1",
            "-t",
            "10:00",
            "sh",
            "-c",
            "echo in-$SLURM_JOB_ID; exit 5",
        ],
        env=env,
        dimensions=(24, 80),
        timeout=30,
    )
    child.expect(r"Granted job allocation (\S+)")
    alloc_id = child.match.group(1).decode()
    child.expect(f"in-{alloc_id}")
    child.expect("Relinquishing job allocation")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 5
    cluster.wait_state(alloc_id, "Cancelled", timeout=30)
