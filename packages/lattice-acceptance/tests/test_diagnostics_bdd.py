"""Steps for features/diagnostics.feature: `lattice diag` of a running job on the
module's shared real cluster (``lattice_cluster``); the job's working directory is the
scenario's directory, where it was submitted from."""

from __future__ import annotations

import json
import re

import pytest
from lattice_acceptance.world import World, shared_world, show
from pytest_bdd import given, parsers, scenarios, then, when

pytestmark = [pytest.mark.cluster]

scenarios("diagnostics.feature")


world = shared_world(World)  # the scenarios share the module's cluster


@given(parsers.parse("a running Lattice cluster with {count:d} nodes"))
def running_cluster(world: World, count: int) -> None:
    world.check_nodes(count)


@given("a job that runs until released")
def job_until_released(world: World) -> None:
    world.current = world.submit("diagjob", directives=("--walltime=5m",), until_released=True)
    a = world.wait_running(world.current)
    world.node = a["assigned_nodes"][0]


@when('the user runs "lattice diag" on the job')
def run_diag(world: World) -> None:
    assert world.current is not None
    world.cli("diag", world.current.id)


def _earned(free_fraction: float, probe_seconds: float, inode_fraction: float = 1.0) -> str:
    """The mark a mount's figures earn, restated from the specification's thresholds:
    free space (and inodes) under 10 % is a warning and under 2 % critical; a probe of
    100 ms or more is a warning and of 1 s or more critical. The probe time depends on
    how busy the disk is, so the test checks the mark agrees with the figures shown."""
    order = ("ok", "warning", "critical")
    marks = [
        "critical" if f < 0.02 else "warning" if f < 0.10 else "ok"
        for f in (free_fraction, inode_fraction)
    ]
    marks.append(
        "critical" if probe_seconds >= 1.0 else "warning" if probe_seconds >= 0.1 else "ok"
    )
    return max(marks, key=order.index)


_SYMBOL = {"ok": "✓", "warning": "⚠ WARNING", "critical": "✗ CRITICAL"}
_MOUNT_LINE = re.compile(
    r"free of .* \((?P<pct>\d+) %\), write\+fsync\+read (?P<ms>[\d.]+) ms (?P<mark>.+)$"
)


def _mount_line(world: World) -> str:
    """The storage section's line for the job's working directory on its node."""
    r = world.last
    assert r is not None
    lines = r.stdout.splitlines()
    assert "Storage:" in lines, show(r)
    storage = lines[lines.index("Storage:") + 1 :]
    prefix = f"  {world.node} working directory: {world.workdir} ("
    mine = [ln for ln in storage if ln.startswith(prefix)]
    assert len(mine) == 1, show(r)
    return mine[0]


@then("the storage section shows the job's working directory on the node that runs it")
def workdir_shown(world: World) -> None:
    _mount_line(world)


@then(
    "its mark is the one its free space and probe time earn "
    "(✓ under 100 ms and over 10 % free, ⚠ under 1 s and over 2 % free, else ✗)"
)
def workdir_mark(world: World) -> None:
    r = world.last
    assert r is not None
    found = _MOUNT_LINE.search(_mount_line(world))
    assert found, show(r)
    # the line rounds the percentage; a mount within rounding of a threshold is not judged
    pct, ms = int(found["pct"]), float(found["ms"])
    assert pct not in (2, 10), show(r)
    earned = _earned(pct / 100.0, ms / 1000.0)
    assert found["mark"] == _SYMBOL[earned], show(r)


@then("lattice diag -o json reports that directory's mount with its free space and probe time")
def workdir_json(world: World) -> None:
    assert world.current is not None
    r = world.cli("diag", world.current.id, "-o", "json")
    answer = json.loads(r.stdout)
    assert answer["allocation_id"] == world.current.id and answer["state"] == "Running"
    mounts = [
        c
        for c in answer["checks"]
        if c["name"] == "mount" and c["details"]["role"] == "working directory"
    ]
    assert len(mounts) == 1, show(r)
    m = mounts[0]
    assert m["node_id"] == world.node, show(r)
    v = m["values"]
    inodes = v["free_inodes"] / v["total_inodes"] if v.get("total_inodes") else 1.0
    earned = _earned(v["free_bytes"] / v["total_bytes"], v["probe_seconds"], inodes)
    assert m["status"] == earned, show(r)
    assert m["details"]["path"] == str(world.workdir) and m["details"]["mount_point"], show(r)
    assert 0 < m["values"]["free_bytes"] <= m["values"]["total_bytes"], show(r)
    assert m["values"]["probe_seconds"] > 0, show(r)
    assert [n["node_id"] for n in answer["nodes"] if n["ok"]] == [world.node], show(r)
    # the probe left nothing behind in the job's directory
    assert not list(world.workdir.glob(".lattice-diag-*"))


@then("lattice diag --network shows the group span of the job's node and no storage section")
def network_only(world: World) -> None:
    assert world.current is not None
    r = world.cli("diag", world.current.id, "--network")
    lines = r.stdout.splitlines()
    assert "Network:" in lines and "Storage:" not in lines and "GPUs:" not in lines, show(r)
    (node,) = [n for n in world.cluster.nodes() if n["id"] == world.node]
    assert f"  Group span: 1 group (g{node.get('group', 0)}) ✓" in lines, show(r)
