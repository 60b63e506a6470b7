"""A 3-member quorum of real lattice-server processes: leader loss under load, and a
full stop/restart from the members' Raft journals and snapshots."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from e2e_helpers import create_vcluster_without_scheduler, pgid_of, unique
from lattice_test_harness.cluster import process_group_alive

pytestmark = pytest.mark.cluster

N_SUBMISSIONS = 50


def _post(url: str, body: dict, timeout: float) -> tuple[int, dict]:
    req = urllib.request.Request(
        url + "/api/v1/allocations",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "x-lattice-user": "tester"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"raw": raw.decode(errors="replace")}


def _is_leader(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=0.5) as r:
            return bool(json.loads(r.read()).get("is_leader"))
    except (OSError, ValueError):
        return False


def wait_members_caught_up(h) -> None:
    """Followers answer reads from their own applied state: wait until every member
    has applied what the leader has (the cluster fixture only waits for a leader)."""
    cl = h.cluster

    def caught_up() -> bool:
        revs = [h.request("GET", "/healthz", url=m.rest_url)["revision"] for m in cl.members]
        return len(set(revs)) == 1 and revs[0] > 0

    h.wait_for("all members at the same revision", caught_up, timeout=30, interval=0.05)


def test_leader_killed_during_50_submissions(cluster_factory):
    h = cluster_factory(members=3, agents=0)
    cl = h.cluster
    leader = cl.leader()
    wait_members_caught_up(h)
    urls = [m.rest_url for m in cl.members]
    acked: dict[str, str] = {}  # request_id -> allocation id (answered 201)
    attempts: Counter[str] = Counter()
    failures: list[str] = []
    lock = threading.Lock()
    enough_acked = threading.Event()
    release = threading.Event()
    log: list = []

    def submit(i: int) -> None:
        rid = f"failover-{uuid.uuid4()}"
        body = {
            "entrypoint": f"echo {i}",
            "tenant": cl.tenant,
            "vcluster": cl.vclusters[0],
            "walltime": "1m",
            "request_id": rid,
        }
        if i >= 15:
            release.wait(30)  # these are in flight when (or just after) the leader dies
        deadline = time.monotonic() + 60
        k = i
        while time.monotonic() < deadline:
            url = urls[k % len(urls)]
            k += 1
            with lock:
                attempts[rid] += 1
            t_a = time.monotonic()
            try:
                status, data = _post(url, body, timeout=10)
            except OSError as e:
                with lock:
                    log.append((i, url, repr(e), round(time.monotonic() - t_a, 2)))
                time.sleep(0.05)
                continue  # dead member or lost connection: same request_id elsewhere
            if status == 201:
                with lock:
                    acked[rid] = data["id"]
                    if len(acked) >= 15:
                        enough_acked.set()
                return
            if status >= 500:
                with lock:
                    log.append((i, url, status, data, round(time.monotonic() - t_a, 2)))
                time.sleep(0.05)
                continue
            with lock:
                failures.append(f"{rid}: {status} {data}")
            return
        with lock:
            failures.append(f"{rid}: never acknowledged")

    with ThreadPoolExecutor(max_workers=16) as pool:
        futures = [pool.submit(submit, i) for i in range(N_SUBMISSIONS)]
        if not enough_acked.wait(30):
            release.set()
            errors = [f.exception(timeout=60) for f in futures]
            pytest.fail(f"first submissions not acknowledged: {failures} {errors[:3]} {log[:20]}")
        release.set()
        time.sleep(0.02)
        with lock:
            acked_before_kill = len(acked)
        leader.proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        survivors = [m for m in cl.members if m is not leader]
        new_leader = None
        while time.monotonic() - killed_at < 30 and new_leader is None:
            for m in survivors:
                if _is_leader(m.rest_url):
                    new_leader = m
                    break
            else:
                time.sleep(0.02)
        elected_after = time.monotonic() - killed_at
        for f in futures:
            f.result()
    leader.proc.wait(5)

    retried = sum(1 for n in attempts.values() if n > 1)
    print(
        f"new leader after {elected_after:.3f}s; {acked_before_kill} acked before the kill, {retried} retried"
    )
    assert acked_before_kill < N_SUBMISSIONS, "submissions were not in flight at the kill"
    assert new_leader is not None, "no new leader among the survivors within 30s"
    assert elected_after < 5.0, f"new leader after {elected_after:.2f}s"
    assert failures == []
    assert len(acked) == N_SUBMISSIONS

    # Every acknowledged submission is there, on the new leader, exactly once.
    assert cl.leader() in survivors
    for rid, alloc_id in acked.items():
        a = h.request("GET", f"/api/v1/allocations/{alloc_id}", url=new_leader.rest_url)
        assert a["spec"]["request_id"] == rid
    allocs = h.request("GET", "/api/v1/allocations?all=true", url=new_leader.rest_url)[
        "allocations"
    ]
    per_rid = Counter(a["spec"]["request_id"] for a in allocs)
    assert {rid: n for rid, n in per_rid.items() if n != 1} == {}
    assert set(per_rid) == set(acked)
    assert len(allocs) == N_SUBMISSIONS


def test_full_quorum_restart_restores_state_from_disk(cluster_factory):
    h = cluster_factory(members=3, agents=1)
    cl = h.cluster
    tenant = unique("persist")
    h.request("POST", "/api/v1/tenants", {"name": tenant, "max_nodes": 7})
    vc = create_vcluster_without_scheduler(h)
    done = h.submit("echo persisted", tenant=tenant, walltime="1m")
    done = h.wait_state(done["id"], ("Completed", "Failed", "Cancelled"), timeout=30)
    assert done["state"] == "Completed"
    pending = h.submit("true", tenant=tenant, vcluster=vc, name="waits")
    cancelled = h.cancel(h.submit("true", vcluster=vc)["id"])
    before = {a["id"]: a for a in h.request("GET", "/api/v1/allocations?all=true")["allocations"]}
    tenants_before = h.request("GET", "/api/v1/tenants")["tenants"]
    vclusters_before = h.request("GET", "/api/v1/vclusters")["vclusters"]
    nodes_before = {n["id"] for n in h.nodes()}

    for m in cl.members:
        cl.stop_member(m, signal.SIGTERM)
    for m in cl.members:
        cl.start_member(m)
    leader = cl.leader(timeout=30)

    def restored():
        got = h.request("GET", "/api/v1/allocations?all=true", url=leader.rest_url)
        return len(got["allocations"]) >= len(before) and got

    got = h.wait_for("allocations restored", restored, timeout=30)
    after = {a["id"]: a for a in got["allocations"]}
    assert set(after) == set(before)
    for aid, a in before.items():
        b = after[aid]
        assert b["state"] == a["state"], aid
        assert b["spec"] == a["spec"], aid
        assert b["submitted_at"] == a["submitted_at"], aid
        assert b["exit_code"] == a["exit_code"], aid
    assert after[done["id"]]["state"] == "Completed"
    assert after[pending["id"]]["state"] == "Pending"
    assert after[cancelled["id"]]["state"] == "Cancelled"

    tenants = {
        t["name"]: t for t in h.request("GET", "/api/v1/tenants", url=leader.rest_url)["tenants"]
    }
    assert tenants[tenant]["max_nodes"] == 7
    assert set(tenants) == {t["name"] for t in tenants_before}
    vcs = {
        v["name"] for v in h.request("GET", "/api/v1/vclusters", url=leader.rest_url)["vclusters"]
    }
    assert vcs == {v["name"] for v in vclusters_before}
    assert vc in vcs
    assert {
        n["id"] for n in h.request("GET", "/api/v1/nodes", url=leader.rest_url)["nodes"]
    } == nodes_before

    # every member, not only the leader, has the state back
    for m in cl.members:
        h.wait_for(
            f"member {m.id} caught up",
            lambda m=m: (
                len(h.request("GET", "/api/v1/allocations?all=true", url=m.rest_url)["allocations"])
                == len(before)
            ),
            timeout=30,
        )

    # and the restored cluster keeps working: the agent reconnects and runs new work
    nxt = h.submit("echo after-restart", walltime="1m")
    assert (
        h.wait_state(nxt["id"], ("Completed", "Failed", "Cancelled"), timeout=40)["state"]
        == "Completed"
    )


def test_submission_via_follower_sees_tenant_just_created_on_leader(cluster_factory):
    h = cluster_factory(members=3, agents=0)
    leader = h.cluster.leader()
    wait_members_caught_up(h)
    followers = [m for m in h.cluster.members if m is not leader]
    rejected = []
    for i in range(20):
        tenant = unique("fresh")
        h.request("POST", "/api/v1/tenants", {"name": tenant}, url=leader.rest_url)
        status, data = _post(
            followers[i % 2].rest_url,
            {"entrypoint": "true", "tenant": tenant, "vcluster": "default", "walltime": "1m"},
            timeout=10,
        )
        if status != 201:
            rejected.append((tenant, status, data))
    print(f"{len(rejected)} of 20 rejected")
    assert rejected == []


def test_running_job_survives_complete_quorum_loss_and_runs_once(cluster_factory, tmp_path):
    """Spec, Complete Quorum Loss: "Running allocations continue - node agents operate
    autonomously." The member that comes back first had been down since before the job
    was assigned; alone it has no majority, so it cannot catch up until the others return."""
    h = cluster_factory(members=3, agents=1)
    cl = h.cluster
    wait_members_caught_up(h)
    leader = cl.leader()
    lagging = next(m for m in cl.members if m is not leader)
    cl.stop_member(lagging, signal.SIGTERM)

    trace = tmp_path / "trace.log"
    a = h.submit(
        'echo start >> "$TRACE"; sleep 10; echo done >> "$TRACE"',
        walltime="1m",
        env={"TRACE": str(trace)},
    )
    node = h.wait_state(a["id"], "Running", timeout=20)["assigned_nodes"][0]
    pgid = pgid_of(h, a["id"], node)
    h.wait_for("job started", lambda: trace.exists(), timeout=10)

    others = [m for m in cl.members if m is not lagging]
    for m in others:
        cl.stop_member(m, signal.SIGTERM)
    cl.start_member(lagging)  # a minority: no leader, no commits, state from before the job
    time.sleep(4)  # the agent retries its streams on every endpoint twice a second
    alive_during_outage = process_group_alive(pgid)
    for m in others:
        cl.start_member(m)
    cl.leader(timeout=30)
    done = h.wait_state(a["id"], ("Completed", "Failed", "Cancelled"), timeout=60)
    time.sleep(1)
    runs = trace.read_text().splitlines()
    assert alive_during_outage, f"the job was killed during the quorum outage; runs: {runs}"
    assert runs == ["start", "done"]
    assert done["state"] == "Completed" and done["exit_code"] == 0
