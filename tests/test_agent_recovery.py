"""Agent failures with real processes (spec "Failure Modes and Recovery", "Node
Lifecycle"): an agent restart reattaches to running work; a node that stays silent
goes Degraded, then Down, and its batch work is requeued elsewhere.

Module cluster: 1 member, 2 agents, heartbeat every 0.5 s, timeout 3 s, grace 3 s.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
from e2e_helpers import StatePoller, agent_of, cancel_quietly, pgid_of, wait_idle
from lattice_test_harness.cluster import TERMINAL, process_group_alive

pytestmark = pytest.mark.cluster


@pytest.fixture
def h(lattice_cluster):
    wait_idle(lattice_cluster)
    yield lattice_cluster
    # whatever a test did to the agents, leave both running and their nodes Ready
    for a in lattice_cluster.cluster.agents:
        if a.proc is None or a.proc.poll() is not None:
            lattice_cluster.cluster.start_agent(a)
    wait_idle(lattice_cluster, timeout=60)


def _lines(path) -> list[str]:
    with contextlib.suppress(FileNotFoundError):
        return path.read_text().splitlines()
    return []


def test_agent_kill9_and_restart_reattaches_running_job(h, tmp_path):
    trace = tmp_path / "trace.log"
    a = h.submit(
        'echo "start $LATTICE_NODE_ID" >> "$TRACE"; sleep 3; echo done >> "$TRACE"',
        walltime="1m",
        env={"TRACE": str(trace)},
    )
    with StatePoller(h, a["id"]) as poll:
        try:
            running = h.wait_state(a["id"], "Running", timeout=20)
            node = running["assigned_nodes"][0]
            agent = agent_of(h, node)
            pgid = pgid_of(h, a["id"], node)
            h.wait_for("job started", lambda: _lines(trace), timeout=10)

            h.cluster.stop_agent(agent, signal.SIGKILL)
            time.sleep(0.5)
            assert process_group_alive(pgid), "the job must outlive its agent"
            assert h.get(a["id"])["state"] == "Running"
            h.cluster.start_agent(agent)

            done = h.wait_state(a["id"], TERMINAL, timeout=30)
        finally:
            cancel_quietly(h, a["id"])
        time.sleep(0.5)  # would catch a second run or a late state change
    final = h.get(a["id"])
    assert final["state"] == "Completed", final
    assert final["exit_code"] == 0
    assert final["requeue_count"] == 0
    assert final["assigned_nodes"] == [node]
    assert done["finished_at"] == final["finished_at"]
    assert _lines(trace) == [f"start {node}", "done"]  # ran once, not restarted
    seen = poll.seen[1:] if poll.seen[:1] == ["Pending"] else poll.seen
    assert seen == ["Running", "Completed"], poll.seen
    assert not process_group_alive(pgid)


def test_silent_node_goes_degraded_then_down_and_its_job_is_requeued(h, tmp_path):
    trace = tmp_path / "trace.log"
    a = h.submit(
        'echo "start $LATTICE_NODE_ID" >> "$TRACE"; sleep 4; echo "done $LATTICE_NODE_ID" >> "$TRACE"',
        walltime="1m",
        env={"TRACE": str(trace)},
    )
    try:
        running = h.wait_state(a["id"], "Running", timeout=20)
        node = running["assigned_nodes"][0]
        other = next(x.node_id for x in h.cluster.agents if x.node_id != node)
        agent = agent_of(h, node)
        pgid = pgid_of(h, a["id"], node)
        h.wait_for("job started", lambda: _lines(trace), timeout=10)

        # the node dies: its agent and the workload with it
        h.cluster.stop_agent(agent, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        died = time.monotonic()

        states: list[str] = []
        alloc_states: list[str] = []

        def node_down() -> bool:
            st = h.node(node)["state"]
            if not states or states[-1] != st:
                states.append(st)
            al = h.get(a["id"])["state"]
            if not alloc_states or alloc_states[-1] != al:
                alloc_states.append(al)
            return st == "Down"

        # heartbeat_timeout 3 s + grace 3 s, checked once a second by the monitor
        h.wait_for(f"{node} Down", node_down, timeout=30, interval=0.05)
        down_after = time.monotonic() - died
        assert states == ["Ready", "Degraded", "Down"], states
        assert down_after >= 3.0 + 3.0 - 0.5, f"Down after only {down_after:.1f}s"
        # a Degraded node keeps its work; only Down requeues it
        assert alloc_states[0] == "Running"

        done = h.wait_state(a["id"], TERMINAL, timeout=30)
        assert done["state"] == "Completed", done
        assert done["requeue_count"] == 1
        assert done["submitted_at"] == running["submitted_at"]
        assert done["assigned_nodes"] == [other]
        assert done["exit_code"] == 0
        assert _lines(trace) == [f"start {node}", f"start {other}", f"done {other}"]
    finally:
        cancel_quietly(h, a["id"])
    # the agent comes back: its node re-registers Ready and holds nothing
    h.cluster.start_agent(agent)
    h.wait_for(f"{node} Ready again", lambda: h.node(node)["state"] == "Ready", timeout=30)
    assert not h.node(node)["owner"]


def test_node_silent_less_than_grace_returns_to_ready_without_disruption(h, tmp_path):
    """A hung agent (SIGSTOP, like a partition) is Degraded after heartbeat_timeout; when
    it answers again within the grace period the node is Ready and its job undisturbed."""
    trace = tmp_path / "trace.log"
    a = h.submit(
        'echo start >> "$TRACE"; sleep 6; echo done >> "$TRACE"',
        walltime="1m",
        env={"TRACE": str(trace)},
    )
    stopped = None
    try:
        running = h.wait_state(a["id"], "Running", timeout=20)
        node = running["assigned_nodes"][0]
        agent = agent_of(h, node)
        h.wait_for("job started", lambda: _lines(trace), timeout=10)

        agent.proc.send_signal(signal.SIGSTOP)
        stopped = agent
        h.wait_for(f"{node} Degraded", lambda: h.node(node)["state"] == "Degraded", timeout=15)
        degraded = h.node(node)
        assert degraded["owner"] == a["id"]
        assert h.get(a["id"])["state"] == "Running"
        agent.proc.send_signal(signal.SIGCONT)
        stopped = None

        h.wait_for(f"{node} Ready again", lambda: h.node(node)["state"] == "Ready", timeout=10)
        done = h.wait_state(a["id"], TERMINAL, timeout=30)
    finally:
        if stopped is not None:
            stopped.proc.send_signal(signal.SIGCONT)
        cancel_quietly(h, a["id"])
    assert done["state"] == "Completed", done
    assert done["requeue_count"] == 0
    assert done["assigned_nodes"] == [node]
    assert _lines(trace) == ["start", "done"]
