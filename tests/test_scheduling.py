"""Scheduling decisions on a real cluster: live weights, backfill around a reservation,
and two vCluster schedulers competing for the same nodes."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.cluster


def _set_weights(h, **weights: float) -> None:
    args = [f"--{k.replace('_', '-')}={v}" for k, v in weights.items()]
    out = h.cli("admin", "vcluster", "set-weights", "--name", "default", *args)
    assert out.returncode == 0, out.stderr
    shown = h.cli("admin", "vcluster", "show", "default")
    assert shown.returncode == 0, shown.stderr
    for k, v in weights.items():
        assert (
            f"Weight {k}:" in shown.stdout
            and f" {v:g}" in shown.stdout.split(f"Weight {k}:")[1].splitlines()[0]
        )


def _first_to_start(h, weights: dict[str, float]) -> str:
    _set_weights(h, **weights)
    blocker = h.submit("sleep 2", preemption_class=9)  # nothing below class 10 preempts it
    h.wait_state(blocker["id"], "Running")
    old_low = h.submit("true", preemption_class=2, name="old-low")
    time.sleep(1.0)
    new_high = h.submit("true", preemption_class=8, name="new-high")
    done = [h.wait_state(a["id"], "Completed", timeout=30) for a in (old_low, new_high)]
    # A class-8 job may preempt the class-2 one that started first (as it should); a
    # preempted job was running before the other, whatever its final start time says.
    first = [a for a in done if a["preempted_count"]] or done
    return min(first, key=lambda a: a["started_at"])["spec"]["name"]


def test_set_weights_changes_the_next_cycles_order(cluster_factory) -> None:
    h = cluster_factory(members=1, agents=1)
    zero = {k: 0.0 for k in ("fair_share", "topology", "data_readiness", "backlog", "conformance")}
    assert _first_to_start(h, {"priority": 0.0, "wait_time": 1.0, **zero}) == "old-low"
    assert _first_to_start(h, {"priority": 1.0, "wait_time": 0.0, **zero}) == "new-high"


def test_backfill_uses_the_gap_without_delaying_the_reservation(cluster_factory) -> None:
    h = cluster_factory(members=1, agents=2)
    long_running = h.submit("sleep 60", preemption_class=9, walltime="10m")
    h.wait_state(long_running["id"], "Running")
    big = h.submit("true", nodes=2, preemption_class=7, walltime="5m")
    short = h.submit("true", preemption_class=1, walltime="2m")
    too_long = h.submit("true", preemption_class=1, walltime="30m")
    # the short job ends before the big job's reservation: it runs in the gap now
    assert h.wait_state(short["id"], "Completed", timeout=20)["state"] == "Completed"
    # the long one would hold the free node past the reservation: it must wait
    time.sleep(2.5)
    assert h.get(too_long["id"])["state"] == "Pending"
    assert h.get(big["id"])["state"] == "Pending"
    h.cancel(long_running["id"])
    assert h.wait_state(big["id"], "Completed", timeout=20)["state"] == "Completed"
    big_done = h.get(big["id"])
    after = h.wait_state(too_long["id"], "Completed", timeout=20)
    assert after["started_at"] >= big_done["started_at"]


def test_two_vcluster_schedulers_never_double_assign(cluster_factory) -> None:
    h = cluster_factory(members=1, agents=3, vclusters=("default", "other"))
    jobs = []
    for i in range(30):
        jobs.append(h.submit("sleep 0.2", vcluster="default" if i % 2 else "other"))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        running = h.allocations(state="running")
        nodes = [n for a in running for n in a["assigned_nodes"]]
        assert len(nodes) == len(set(nodes)), f"a node is held twice: {running}"
        if all(h.get(j["id"])["state"] == "Completed" for j in jobs[-4:]):
            break
        time.sleep(0.05)
    final = [h.wait_state(j["id"], "Completed", timeout=60) for j in jobs]
    assert all(a["state"] == "Completed" for a in final)


def test_vcluster_borrows_idle_nodes_and_the_home_vcluster_reclaims_them(cluster_factory) -> None:
    h = cluster_factory(members=1, agents=2, vclusters=("a", "b"), agent_homes=("a", "b"))
    # b has one node of its own; its second job borrows a's idle node
    b_jobs = [h.submit("sleep 30", vcluster="b", walltime="10m") for _ in range(2)]
    running = [h.wait_state(j["id"], "Running", timeout=20) for j in b_jobs]
    assert sorted(n for r in running for n in r["assigned_nodes"]) == ["node-001", "node-002"]
    borrower = next(r for r in running if r["assigned_nodes"] == ["node-001"])
    assert h.node("node-001")["owner_vcluster"] == "b"
    assert h.node("node-001")["home_vcluster"] == "a"
    # a needs its node back: the borrower is preempted (whatever its class) and requeued
    mine = h.submit("echo reclaimed", vcluster="a", preemption_class=1, walltime="5m")
    done = h.wait_state(mine["id"], "Completed", timeout=30)
    assert done["assigned_nodes"] == ["node-001"]
    back = h.get(borrower["id"])
    assert back["preempted_count"] == 1 and back["submitted_at"] == borrower["submitted_at"]
    for j in b_jobs:
        h.cancel(j["id"])


def test_node_range_starts_with_what_is_free(cluster_factory) -> None:
    h = cluster_factory(members=1, agents=3)
    blocker = h.submit("sleep 30", walltime="10m", preemption_class=9)
    h.wait_state(blocker["id"], "Running")
    out = h.cli("submit", "--nodes=3", "--min-nodes=1", "--walltime=5m", "-o", "json", "--", "true")
    assert out.returncode == 0, out.stderr
    import json

    alloc = json.loads(out.stdout)
    done = h.wait_state(alloc["id"], "Completed", timeout=20)
    assert len(done["assigned_nodes"]) == 2  # 2 of 3 free: within {1, 3}
    bad = h.cli("submit", "--nodes=2", "--min-nodes=3", "--walltime=5m", "--", "true")
    assert bad.returncode != 0 and "Hint:" in bad.stderr
    h.cancel(blocker["id"])
