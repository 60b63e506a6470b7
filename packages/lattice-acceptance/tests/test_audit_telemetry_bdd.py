"""Steps for features/audit_telemetry.feature: file-access events of a sensitive job on a
real 1-node cluster of its own, read back through `lattice admin audit query`.

The job waits in one Python process (one exec, so the wait itself opens nothing) until a
``release`` file appears; the step lets it go once `lattice nodes NODE` shows the
``file-access:ebpf`` telemetry note (the agent has the job's processes in its kernel
filter), and the job then writes its result with a shell redirection.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import pytest
from lattice_acceptance.world import TIMEOUT, World, fresh_world, show
from lattice_agent.telemetry.ebpf import probe
from pytest_bdd import given, parsers, scenarios, then, when

pytestmark = [pytest.mark.cluster]

scenarios("audit_telemetry.feature")

ADMIN = "ops"


world = fresh_world(World)  # a cluster of its own per scenario


def _file_access(world: World, *args: str) -> list[dict[str, Any]]:
    r = world.cli(
        "admin", "audit", "query", "--action", "file.access", *args, "-o", "json", user=ADMIN
    )
    return json.loads(r.stdout)


@given(
    parsers.parse(
        'a Lattice cluster with {count:d} node and a "{vcluster}" vCluster, where eBPF can run'
    )
)
def cluster_with_ebpf(world: World, count: int, vcluster: str) -> None:
    ok, why = probe()
    if not ok:
        pytest.skip(f"eBPF cannot run here: {why}")
    world.start_cluster(count, vclusters=("default", vcluster))
    world.node = world.node_ids()[0]


@when(parsers.parse('alice submits a sensitive job that waits, then writes "{name}"'))
def submit_sensitive(world: World, name: str) -> None:
    d = world.workdir / "alice-audited"
    wait = (
        f"{sys.executable} -c 'import os, time\n"
        f'while not os.path.exists("{d}/release"): time.sleep(0.1)\''
    )
    job = world.submit(
        "alice-audited",
        f"{wait}\necho 42 > {d}/{name}",
        directives=("--walltime=5m", "--vcluster=sensitive"),
        user="alice",
    )
    world.current = job
    world.wait_running(job)


@when("the node says in its telemetry note that it audits file access with eBPF")
def node_audits(world: World) -> None:
    deadline = time.monotonic() + 60
    note = ""
    while time.monotonic() < deadline:
        note = world.node_field(world.node, "Telemetry")
        if "file-access:ebpf" in note:
            return
        time.sleep(0.5)
    raise AssertionError(f"the node's telemetry note never said file-access:ebpf: {note!r}")


@when("the job is let go")
def let_go(world: World) -> None:
    time.sleep(1.0)  # the note comes with a heartbeat; the filter was seeded before it
    world.release(world.current.name)


@then("alice's job ends Completed")
def job_completed(world: World) -> None:
    world.wait_end(world.current.name)


@then(
    parsers.parse(
        'lattice admin audit query --action file.access lists alice\'s write of "{name}" on the node'
    )
)
def write_listed(world: World, name: str) -> None:
    job = world.current
    path = f"{job.dir}/{name}"
    deadline = time.monotonic() + TIMEOUT
    found: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        entries = _file_access(world, "--target", job.id)
        found = [
            (e, r)
            for e in entries
            for r in json.loads(e["details"]["records"])
            if r["path"] == path
        ]
        if found:
            break
        time.sleep(0.5)
    assert found, f"no file.access record of {path}: {show(world.last)}"
    entry, record = found[0]
    assert entry["actor"] == "alice" and entry["target"] == f"allocation:{job.id}"
    assert entry["details"]["node"] == world.node and entry["details"]["sensitive"] == "true"
    assert record["flags"] == "w,create,trunc" and record["source"] == "ebpf"
    assert record["result"] >= 0
    rows = world.cli("admin", "audit", "query", "--action", "file.access", user=ADMIN).stdout
    assert "file.access" in rows and f"allocation:{job.id}" in rows, rows


@then("the entries name no file opened by another allocation")
def only_audited(world: World) -> None:
    entries = _file_access(world)
    targets = {e["target"] for e in entries if "lost" not in e["details"]}
    assert targets == {f"allocation:{world.current.id}"}, targets
