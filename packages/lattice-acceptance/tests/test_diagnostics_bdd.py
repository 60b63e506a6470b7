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


@then("the storage section marks the job's working directory ok on the node that runs it")
def workdir_ok(world: World) -> None:
    r = world.last
    assert r is not None
    lines = r.stdout.splitlines()
    assert "Storage:" in lines, show(r)
    storage = lines[lines.index("Storage:") + 1 :]
    prefix = f"  {world.node} working directory: {world.workdir} ("
    mine = [ln for ln in storage if ln.startswith(prefix)]
    assert len(mine) == 1, show(r)
    assert re.search(r"free of .*write\+fsync\+read [\d.]+ ms ✓$", mine[0]), show(r)


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
    assert m["node_id"] == world.node and m["status"] == "ok", show(r)
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
