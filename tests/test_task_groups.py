"""Task groups (job arrays) on a real cluster: one allocation per index, each with
LATTICE_TASK_INDEX, never more running at once than the group's concurrency."""

from __future__ import annotations

import itertools
import json

import pytest

pytestmark = pytest.mark.cluster


def test_task_group_runs_every_index_within_its_concurrency(lattice_cluster) -> None:
    h = lattice_cluster
    out = h.cli(
        "submit",
        "--task-group=0-5%1",
        "--walltime=5m",
        "--",
        "sh",
        "-c",
        "sleep 0.3; echo task-$LATTICE_TASK_INDEX",
    )
    assert out.returncode == 0, out.stderr
    assert "Submitted task group" in out.stdout and "(6 tasks, at most 1 running)" in out.stdout
    gid = out.stdout.split()[3]

    tasks = h.request("GET", f"/api/v1/allocations?all=true&task_group={gid}")["allocations"]
    assert len(tasks) == 6
    done = [h.wait_state(t["id"], ("Completed", "Failed"), timeout=60) for t in tasks]
    assert all(d["state"] == "Completed" for d in done), done
    assert sorted(d["task_index"] for d in done) == list(range(6))
    for d in done:
        assert h.logs(d["id"]) == [f"task-{d['task_index']}"]
    # concurrency 1: no two tasks' run intervals overlap, although 2 nodes were free
    spans = sorted((d["started_at"], d["finished_at"]) for d in done)
    assert all(a[1] <= b[0] + 0.05 for a, b in itertools.pairwise(spans)), spans

    table = h.cli("status", "--all")
    assert table.returncode == 0, table.stderr
    row = next(line for line in table.stdout.splitlines() if line.startswith(gid))
    assert "Completed" in row and "1×6" in row

    expanded = h.cli("status", gid, "-o", "json")
    assert expanded.returncode == 0, expanded.stderr
    assert len(json.loads(expanded.stdout)) == 6


def test_bad_task_group_range_is_rejected_with_a_hint(lattice_cluster) -> None:
    h = lattice_cluster
    before = len(h.allocations())
    out = h.cli("submit", "--task-group=9-3", "--walltime=5m", "--", "true")
    assert out.returncode != 0
    assert "Error:" in out.stderr and "Hint:" in out.stderr
    assert len(h.allocations()) == before
