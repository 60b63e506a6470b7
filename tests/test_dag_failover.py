"""A DAG on a 3-member quorum whose leader is killed mid-workflow: dependency resolution
runs in the quorum's apply, so the DAG still completes, in order, and no stage runs twice."""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request

import pytest
from lattice_test_harness.cluster import ApiError
from test_quorum_failover import wait_members_caught_up

pytestmark = pytest.mark.cluster

STAGES = 12


def _dag(h, dag_id: str) -> dict:
    # whichever member answers: the old leader is dead, and a member that has not yet
    # heard from the new one answers 503 (not in sync with a leader)
    for m in h.cluster.members:
        try:
            return h.request("GET", f"/api/v1/dags/{dag_id}", url=m.rest_url)
        except (OSError, urllib.error.URLError):
            continue
        except ApiError as e:
            if e.status != 503:
                raise
    raise AssertionError("no member answers")


def test_leader_killed_mid_dag_the_dag_completes_and_no_stage_runs_twice(cluster_factory, tmp_path):
    h = cluster_factory(members=3, agents=2)
    wait_members_caught_up(h)
    runs = tmp_path / "runs"
    stages = [
        {
            "id": f"s{i}",
            "entrypoint": f"sh -c 'echo s{i} >> {runs}; sleep 0.3'",
            "walltime": "5m",
            **({"depends_on": [{"ref": f"s{i - 1}", "condition": "success"}]} if i else {}),
        }
        for i in range(STAGES)
    ]
    body = {
        "tenant": h.cluster.tenant,
        "vcluster": h.cluster.vclusters[0],
        "request_id": "dag-failover-1",
        "dag": {"name": "failover", "allocations": stages},
    }
    res = h.request("POST", "/api/v1/dags", body)
    dag_id = res["dag_id"]

    # kill the leader once a few stages have run
    h.wait_for("3 stages run", lambda: runs.exists() and len(runs.read_text().split()) >= 3)
    leader = h.cluster.leader()
    leader.proc.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()

    deadline = time.monotonic() + 120
    state = "Running"
    while time.monotonic() < deadline:
        try:
            state = _dag(h, dag_id)["state"]
        except AssertionError:
            state = "unreachable"
        if state not in ("Running", "unreachable"):
            break
        time.sleep(0.3)
    assert state == "Completed", f"DAG {state} {time.monotonic() - killed_at:.1f}s after the kill"
    assert runs.read_text().split() == [f"s{i}" for i in range(STAGES)]  # in order, once each

    # the DAG and its members are the same on every surviving member
    survivors = [m for m in h.cluster.members if m is not leader]
    views = []
    for m in survivors:
        d = h.wait_for(
            f"member {m.id} applied the end",
            lambda m=m: (
                (v := h.request("GET", f"/api/v1/dags/{dag_id}", url=m.rest_url))["state"]
                == "Completed"
                and v
            ),
        )
        views.append(json.dumps(d["members"], sort_keys=True))
    assert len(set(views)) == 1
