"""End to end through real processes: submit -> schedule -> run -> report -> logs.

One module-scoped cluster (1 quorum member, 2 agents, fast heartbeats); each test
starts and ends with both nodes free.
"""

from __future__ import annotations

import time

import pytest
from e2e_helpers import (
    cancel_quietly,
    pgid_of,
    procs_with,
    sleep_marker,
    wait_idle,
)
from lattice_test_harness.cluster import process_group_alive

pytestmark = pytest.mark.cluster


@pytest.fixture
def h(lattice_cluster):
    wait_idle(lattice_cluster)
    yield lattice_cluster


def test_echo_runs_pending_running_completed_within_5s_and_logs_show_output(h):
    t0 = time.monotonic()
    a = h.submit("echo hello; sleep 1", walltime="1m")
    seen = [a["state"]]
    for s in h.states_seen(a["id"], timeout=30):
        if s != seen[-1]:
            seen.append(s)
    elapsed = time.monotonic() - t0

    assert seen == ["Pending", "Running", "Completed"], seen
    assert elapsed < 5.0, f"submit -> Completed took {elapsed:.2f}s on an idle cluster"
    done = h.get(a["id"])
    assert done["exit_code"] == 0
    assert done["started_at"] >= done["submitted_at"]
    assert done["finished_at"] - done["started_at"] >= 1.0  # the sleep really ran

    # `lattice logs ID` through the real CLI
    r = h.cli("logs", a["id"])
    assert r.returncode == 0, r.stderr
    assert "hello" in r.stdout, r.stdout
    # and the REST endpoint behind it
    assert h.logs(a["id"]) == ["hello"]


def test_walltime_exceeded_fails_and_kills_the_process_group(h):
    n = sleep_marker()
    marker = f"sleep {n}"
    a = h.submit(f"sleep {n} & wait", walltime="2s")
    running = h.wait_state(a["id"], "Running", timeout=20)
    node = running["assigned_nodes"][0]
    pgid = pgid_of(h, a["id"], node)
    h.wait_for("the workload process", lambda: procs_with(marker), timeout=10)
    assert process_group_alive(pgid)
    try:
        # walltime 2 s + SIGTERM grace 1 s (+ heartbeat); generous for a busy machine
        done = h.wait_state(a["id"], ("Completed", "Failed", "Cancelled"), timeout=30)
    finally:
        cancel_quietly(h, a["id"])
    assert done["state"] == "Failed", done
    assert done["reason"] == "walltime_exceeded", done
    assert done["exit_code"] != 0
    assert done["finished_at"] - done["started_at"] >= 2.0
    # nothing of the job is left: neither the group nor the `sleep` inside it
    h.wait_for("process group gone", lambda: not process_group_alive(pgid), timeout=10)
    assert procs_with(marker) == []
    # and the node is free again
    h.wait_for("node freed", lambda: not h.node(node)["owner"], timeout=10)


def test_cancel_kills_processes_and_frees_the_node_for_the_next_job(h):
    m1, m2 = sleep_marker(), sleep_marker()
    long1 = h.submit(f"sleep {m1} & wait", walltime="10m")
    long2 = h.submit(f"sleep {m2} & wait", walltime="10m")
    ids = [long1["id"], long2["id"]]
    try:
        r1 = h.wait_state(long1["id"], "Running", timeout=20)
        r2 = h.wait_state(long2["id"], "Running", timeout=20)
        node1, node2 = r1["assigned_nodes"][0], r2["assigned_nodes"][0]
        assert {node1, node2} == {a.node_id for a in h.cluster.agents}
        pgid1 = pgid_of(h, long1["id"], node1)
        pgid2 = pgid_of(h, long2["id"], node2)
        h.wait_for("long job 1 processes", lambda: procs_with(f"sleep {m1}"), timeout=10)

        third = h.submit("echo third", walltime="1m")
        ids.append(third["id"])
        # both nodes are busy: the third job waits (at least two scheduling cycles)
        time.sleep(2.5)
        assert h.get(third["id"])["state"] == "Pending"

        cancelled = h.cancel(long1["id"])
        assert cancelled["state"] == "Cancelled"

        # its processes are killed ...
        h.wait_for("cancelled group gone", lambda: not process_group_alive(pgid1), timeout=15)
        assert procs_with(f"sleep {m1}") == []
        # ... the other long job is untouched ...
        assert procs_with(f"sleep {m2}")
        assert h.get(long2["id"])["state"] == "Running"
        # ... and the pending job runs on the freed node
        done = h.wait_state(third["id"], ("Completed", "Failed", "Cancelled"), timeout=20)
        assert done["state"] == "Completed", done
        assert done["assigned_nodes"] == [node1]
        assert done["started_at"] >= cancelled["finished_at"]
        assert h.logs(third["id"]) == ["third"]
    finally:
        cancel_quietly(h, *ids)
    h.wait_for("long job 2 group gone", lambda: not process_group_alive(pgid2), timeout=15)
