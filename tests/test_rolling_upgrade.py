"""A rolling restart as the upgrade chapter describes it (spec: Upgrades and Rollouts):
quorum members, then the scheduler, then the node agents restarted one at a time while
work runs and users keep submitting. Nothing running is disturbed: the long jobs keep
their process (same process group, never requeued) and complete once; every submission
made during the roll is acknowledged and completes."""

from __future__ import annotations

import signal
import threading
import time

import pytest
from e2e_helpers import pgid_of, unique
from lattice_test_harness.cluster import ApiError, process_group_alive

pytestmark = pytest.mark.cluster

TERMINAL = ("Completed", "Failed", "Cancelled")


def test_members_scheduler_and_agents_restarted_one_at_a_time(cluster_factory) -> None:
    h = cluster_factory(members=3, agents=3, heartbeat_timeout=30.0, grace_period=60.0)
    cl = h.cluster
    tenant = unique("roll")
    h.request("POST", "/api/v1/tenants", {"name": tenant})
    # two long jobs (a node each) and the third node for the trickle of short jobs
    longs = [h.submit("sleep 45; echo long-done", tenant=tenant, walltime="5m") for _ in range(2)]
    running = [h.wait_state(a["id"], ("Running",), timeout=30) for a in longs]
    nodes = {a["id"]: a["assigned_nodes"][0] for a in running}
    pgids = {aid: pgid_of(h, aid, node) for aid, node in nodes.items()}

    acked: list[str] = []
    errors: list[str] = []
    stop = threading.Event()

    def trickle() -> None:  # a user submitting through the roll, retrying as a CLI would
        i = 0
        while not stop.is_set():
            i += 1
            deadline = time.monotonic() + 30
            rid = f"{tenant}-short-{i}"  # a retried submission is the same submission
            while time.monotonic() < deadline:
                try:
                    got = h.submit(f"echo short-{i}", tenant=tenant, walltime="1m", request_id=rid)
                    acked.append(got["id"])
                    break
                except (ApiError, OSError) as e:
                    if isinstance(e, ApiError) and e.status < 500:
                        errors.append(f"short-{i}: {e}")
                        break
                    time.sleep(0.2)
            else:
                errors.append(f"short-{i}: never acknowledged")
            stop.wait(1.0)

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        for m in cl.members:  # followers first, the leader last (one election only)
            if m is cl.leader():
                continue
            _restart_member(h, m)
        _restart_member(h, cl.leader())
        for vc, proc in list(cl.schedulers.items()):
            proc.send_signal(signal.SIGTERM)
            proc.wait(15)
            cl.start_scheduler(vc)
        for a in cl.agents:
            cl.stop_agent(a, signal.SIGTERM)
            cl.start_agent(a)
            h.wait_for(
                f"{a.node_id} Ready again",
                lambda a=a: h.node(a.node_id)["state"] == "Ready",
                timeout=30,
            )
    finally:
        stop.set()
        t.join(40)

    assert errors == []
    assert len(acked) >= 2, "the trickle kept submitting through the roll"
    for aid, pgid in pgids.items():
        assert process_group_alive(pgid) or h.get(aid)["state"] == "Completed"
    for a in longs:
        done = h.wait_state(a["id"], TERMINAL, timeout=90)
        assert done["state"] == "Completed", done
        assert done["exit_code"] == 0
        assert done.get("requeue_count", 0) == 0
        assert done["assigned_nodes"] == [nodes[a["id"]]] or done["assigned_nodes"] == []
        assert "long-done" in "\n".join(h.logs(a["id"]))
    for aid in acked:
        assert h.wait_state(aid, TERMINAL, timeout=90)["state"] == "Completed", aid
    states = {a["id"]: a["state"] for a in h.allocations(all="true", tenant=tenant)}
    assert set(acked) | {a["id"] for a in longs} == set(states)


def _restart_member(h, m) -> None:
    cl = h.cluster
    cl.stop_member(m, signal.SIGTERM)
    cl.leader(timeout=30)  # the other two keep (or elect) a leader
    cl.start_member(m)

    def caught_up() -> bool:
        try:
            mine = h.request("GET", "/healthz", url=m.rest_url)["revision"]
            lead = h.request("GET", "/healthz", url=cl.leader().rest_url)["revision"]
        except (ApiError, OSError):
            return False
        return mine >= lead > 0

    h.wait_for(f"member {m.id} back and caught up", caught_up, timeout=40, interval=0.2)
