"""Defects the chaos suite found, each pinned by the smallest cluster that shows it."""

from __future__ import annotations

import time

import pytest
from chaoscluster import start_chaos_cluster
from faults import kill_group

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def test_an_agent_restarted_while_a_follower_serves_its_registration_is_not_refused(tmp_path):
    """Agents register through the first member that answers (member 1 here); a
    registration resets the heartbeat sequence only on that member. With another member
    leading, the restarted agent's heartbeats (counting from its new start) were refused
    as replays until they passed the old process's count, keeping the node out of the
    pool for as many heartbeat intervals."""
    h = start_chaos_cluster(tmp_path / "c", agents=1)
    cl = h.cluster
    try:
        while cl.leader(timeout=30).id == 1:  # a follower must serve the registration
            m1 = cl.members[0]
            kill_group(m1.proc)
            h.wait_for("another leader", lambda: cl.leader(timeout=30).id != 1, timeout=30)
            cl.start_member(m1)
        leader = cl.leader()
        agent = cl.agents[0]
        m1 = cl.members[0]
        h.wait_for("member 1 answers", lambda: h.request("GET", "/healthz", url=m1.rest_url))
        time.sleep(8)  # ~16 heartbeats accepted from the first agent process
        leader_log = cl.log_path(f"member-{leader.id}")
        offset = leader_log.stat().st_size
        before = h.nodes()[0]["agent_address"]
        kill_group(agent.proc)
        cl.start_agent(agent)
        # the new process registered (it listens on a new port)...
        h.wait_for(
            "the restarted agent's registration",
            lambda: h.nodes()[0]["agent_address"] not in ("", before),
            timeout=60,
            interval=0.2,
        )
        # ...and its heartbeats keep the node Ready
        h.wait_for("the node Ready", lambda: h.nodes()[0]["state"] == "Ready", timeout=30)
        time.sleep(4)
        with leader_log.open("rb") as f:
            f.seek(offset)
            refused = [
                ln for ln in f.read().decode(errors="replace").splitlines() if "replayed" in ln
            ]
        assert cl.leader().id == leader.id, "leadership moved: the test saw nothing"
        assert refused == []
        assert h.nodes()[0]["state"] == "Ready"
    finally:
        cl.stop()


def test_submissions_taken_by_a_partitioned_leader_are_never_acked_with_another_id(tmp_path):
    """Found by scripts/chaos --seed 42 --duration 1800 (5 lost acknowledgements, each
    while the Raft leader was partitioned). The old leader keeps claiming leadership,
    takes submissions on its REST port and cannot commit them; when the partition heals
    quickly (before its commit timeout) the waiting clients got 201 with the allocation
    of whatever the majority committed at the same log positions: pysyncobj committed a
    follower's own unverified entries during a snapshot transfer (fixed in
    lattice_quorum.raft; the exact message: test_raft_follower_commit.py). Compaction
    every few entries makes the new leader send the old one a snapshot."""
    from faults import Firewall
    from loaddriver import http

    h = start_chaos_cluster(
        tmp_path / "c",
        agents=0,
        env={
            "LATTICE_QUORUM__LOG_COMPACTION_MIN_ENTRIES": "5",
            "LATTICE_QUORUM__LOG_COMPACTION_MIN_TIME": "1",
        },
    )
    cl = h.cluster
    fw = Firewall(f"reg{tmp_path.name[-12:]}")
    fw.setup()

    def body(rid: str) -> dict:
        return {
            "entrypoint": "true",
            "tenant": cl.tenant,
            "vcluster": "default",
            "walltime": "1m",
            "request_id": rid,
        }

    try:
        for i in range(30):
            h.submit("true", walltime="1m", request_id=f"warm-{i}")
        time.sleep(3)
        leader = cl.leader()
        others = [m for m in cl.members if m is not leader]
        fw.isolate(
            [leader.raft_port, leader.grpc_port],
            cl.member_gid(leader.id),
            [p.raft_port for p in others] + [p.grpc_port for p in others],
        )
        answers: dict[str, tuple[int, dict]] = {}

        def send(url: str, rid: str) -> None:
            try:
                answers[rid] = http("POST", url + "/api/v1/allocations", body(rid), timeout=30)
            except OSError as e:
                answers[rid] = (0, {"error": repr(e)})

        import threading

        minority = [
            threading.Thread(target=send, args=(leader.rest_url, f"minority-{i}")) for i in range(4)
        ]
        for t in minority:
            t.start()
        time.sleep(0.5)
        for i in range(12):  # the majority elects a leader and commits meanwhile
            send(others[0].rest_url, f"majority-{i}")
        time.sleep(0.2)
        fw.flush()  # heal before the old leader's commit timeout
        for t in minority:
            t.join()
        time.sleep(3)
        allocs = h.request("GET", "/api/v1/allocations?all=true", url=others[0].rest_url)[
            "allocations"
        ]
        holds = {a["id"]: a["spec"]["request_id"] for a in allocs}
        wrong = {
            rid: (data["id"], holds.get(data["id"]))
            for rid, (status, data) in answers.items()
            if rid.startswith("minority") and status == 201 and holds.get(data["id"]) != rid
        }
        assert wrong == {}, f"acknowledged with another submission's id: {wrong}"
    finally:
        fw.teardown()
        cl.stop()
