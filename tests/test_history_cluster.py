"""Allocation history on a real dev cluster (lattice-server + an agent as processes,
the embedded SQLite history store): with a retention of 2 s, ended jobs leave the
quorum's state (the watch snapshot no longer holds them), and `lattice history`,
`lattice status ID` and the usage endpoint still show and count them, exit codes
included; with accounting on, the job is still charged exactly its runtime and its cost
shows in `lattice history`."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
from lattice_common.rpc import Endpoints, RemoteQuorum
from lattice_test_harness.cluster import ClusterHandle
from lattice_test_harness.plugin import make_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

RETENTION_SECONDS = 2.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    env = {
        "LATTICE_STORAGE__ALLOCATION_RETENTION_HOURS": repr(RETENTION_SECONDS / 3600),
        "LATTICE_STORAGE__HISTORY_SWEEP_INTERVAL_SECONDS": "0.5",
    }
    h = make_cluster(tmp_path_factory.mktemp("history"), members=1, agents=1, env=env)
    yield h
    h.cluster.stop()


def state_ids(cluster: ClusterHandle) -> set[str]:
    """The allocation ids in the quorum's state: the watch stream's snapshot."""

    async def snap() -> set[str]:
        q = RemoteQuorum(Endpoints(cluster.cluster.grpc_endpoints))
        async for d in q.watch():
            return {a.id for a in d.allocations}
        return set()

    return asyncio.run(snap())


def test_ended_jobs_leave_the_state_and_history_still_shows_them(cluster: ClusterHandle) -> None:
    ok = cluster.submit("echo fine")
    bad = cluster.submit("exit 3")
    running = cluster.submit("sleep 60")
    for a in (ok, bad):
        cluster.wait_state(a["id"], ("Completed", "Failed"), timeout=30)
    cluster.wait_state(running["id"], "Running", timeout=30)
    assert {ok["id"], bad["id"]} <= state_ids(cluster)

    deadline = time.monotonic() + 30
    while {ok["id"], bad["id"]} & state_ids(cluster):
        assert time.monotonic() < deadline, "the ended jobs never left the quorum's state"
        time.sleep(0.5)
    assert running["id"] in state_ids(cluster)  # running work is never touched

    out = cluster.cli("history", "-o", "json")
    assert out.returncode == 0, out.stderr
    rows = {r["id"]: r for r in json.loads(out.stdout)}
    assert rows[ok["id"]]["state"] == "Completed" and rows[ok["id"]]["exit_code"] == 0
    assert rows[bad["id"]]["state"] == "Failed" and rows[bad["id"]]["exit_code"] == 3
    assert running["id"] not in rows

    # the server applies --limit (the latest to end) and --since (the store filters in SQL)
    latest = max((ok["id"], bad["id"]), key=lambda i: rows[i]["finished_at"])
    out = cluster.cli("history", "--limit", "1", "-o", "json")
    assert out.returncode == 0, out.stderr
    assert [r["id"] for r in json.loads(out.stdout)] == [latest]
    mine = cluster.request("GET", "/api/v1/allocations?state=Completed,Failed&since=0&limit=1")
    assert [a["id"] for a in mine["allocations"]] == [latest]
    later = max(r["finished_at"] for r in rows.values()) + 1
    none = cluster.request("GET", f"/api/v1/allocations?state=Completed,Failed&since={later}")
    assert none["allocations"] == []
    out = cluster.cli("history", "--since", "2099-01-01", "-o", "json")
    assert out.returncode == 0 and json.loads(out.stdout) == [], out.stderr

    # status of a moved allocation answers from the history store
    st = cluster.get(bad["id"])
    assert st["state"] == "Failed" and st["exit_code"] == 3
    out = cluster.cli("status", bad["id"])
    assert out.returncode == 0, out.stderr
    assert "Failed" in out.stdout

    # usage still counts them (they ran inside the window)
    usage = cluster.request("GET", "/api/v1/usage?days=1")
    assert usage["allocations"] >= 3, usage
    cluster.cancel(running["id"])


def test_accounting_settles_a_job_that_left_the_state(cluster_factory: Any) -> None:
    """With accounting on, a job is charged exactly its runtime whether the charger
    settles it before or after it moved to the history store, and `lattice history`
    shows its cost."""
    from test_accounting_cluster import OPTIONS, finalized, money, runtime_cost, setup_money

    env = {
        "LATTICE_STORAGE__ALLOCATION_RETENTION_HOURS": repr(RETENTION_SECONDS / 3600),
        "LATTICE_STORAGE__HISTORY_SWEEP_INTERVAL_SECONDS": "0.5",
    }
    h: ClusterHandle = cluster_factory(
        members=1, agents=1, accounting=True, accounting_options=OPTIONS, env=env
    )
    setup_money(h, topup="100", transfer="20")
    a = h.submit("sleep 1", walltime="10m")
    done = h.wait_state(a["id"], "Completed", timeout=60)
    deadline = time.monotonic() + 30
    while a["id"] in state_ids(h):
        assert time.monotonic() < deadline, "the ended job never left the quorum's state"
        time.sleep(0.5)
    c = finalized(h, a["id"])
    assert abs(money(c["cost"]) - runtime_cost(done)) < Decimal("0.0001"), (c, done)
    out = h.cli("history", "-o", "json")
    assert out.returncode == 0, out.stderr
    (row,) = [r for r in json.loads(out.stdout) if r["id"] == a["id"]]
    assert row["exit_code"] == 0 and money(row["cost"]) == money(c["cost"])
