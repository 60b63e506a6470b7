"""Steps for features/fair_share.feature: the fair share target as a soft quota, and the
administrator's view of a tenant's target and burst allowance.

Each scenario starts its own 2-node cluster with a ``World`` from ``lattice_acceptance.world``
(shared with test_scheduling_bdd.py): the scenarios create tenants and change weights.
Tenants are created and changed with `lattice admin tenant` as an administrator; jobs are
batch scripts submitted with `lattice submit` under the tenant they name (``--tenant``),
and the REST API is read to observe states and nodes. Jobs of the default tenant, which
has no fair share target, play the third party.

With the vCluster's weights at priority 1 and everything else 0, a job's score is its
class / 10 times its tenant's soft-quota multiplier: wait time and the fair share factor
f3 play no part, so only the soft quota can put a class-5 job in front of a class-6 one.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

import pytest
from lattice_acceptance.world import TIMEOUT, World, fresh_world, show
from pytest_bdd import given, parsers, scenarios, then, when

pytestmark = [pytest.mark.cluster]

scenarios("fair_share.feature")

ADMIN = "admin"
# The tenant every job is charged to unless it names one (the harness cluster's tenant).
NO_TARGET_TENANT = "default"


world = fresh_world(World)  # a cluster of its own per scenario


def _tenants(world: World) -> dict[str, dict[str, str]]:
    """`lattice admin tenant list` as a user reads it: each tenant's row by column."""
    r = world.cli("admin", "tenant", "list")
    header, *rows = r.stdout.splitlines()
    columns = header.split()
    table = {}
    for row in rows:
        cells = row.split()
        assert len(cells) == len(columns), show(r)
        table[cells[0]] = dict(zip(columns, cells, strict=True))
    return table


def _submit(world: World, tenant: str, name: str, cls: int, *, until_released: bool) -> None:
    # walltime 5m: within 5 minutes of its walltime a job is too near completion to be
    # preempted (Preemption Policy, near_completion_threshold). Once "b-next" runs,
    # biology holds its 50% share and is no longer owed capacity, so "p-next" (class 6)
    # could otherwise take its node by class preemption; this keeps the scenario about
    # the queue order alone.
    world.submit(
        name,
        "sleep 1",
        directives=("--walltime=5m", f"--preemption-class={cls}", f"--tenant={tenant}"),
        user=tenant,
        until_released=until_released,
    )


# --------------------------------------------------------------------------- background


@given(parsers.parse("a Lattice cluster with {count:d} nodes"))
def lattice_cluster(world: World, count: int) -> None:
    world.start_cluster(count)


@given(
    parsers.parse(
        'the administrator creates the tenants "{first}" and "{second}", each with a fair '
        "share target of {target}"
    )
)
def create_tenants(world: World, first: str, second: str, target: str) -> None:
    for name in (first, second):
        r = world.cli(
            "admin", "tenant", "create", "--name", name, "--fair-share-target", target, user=ADMIN
        )
        assert r.stdout.strip() == f"Created tenant {name}", show(r)
    tenants = _tenants(world)
    for name in (first, second):
        assert tenants[name]["FAIR_SHARE"] == target, tenants
    assert tenants[NO_TARGET_TENANT]["FAIR_SHARE"] == "0", tenants


# --------------------------------------------------------------------------- soft quota


@given(
    parsers.parse(
        'the administrator sets the weights of vCluster "{vcluster}" to priority '
        "{priority:g} and every other weight to 0"
    )
)
def set_weights(world: World, vcluster: str, priority: float) -> None:
    world.set_weights(vcluster, {"priority": priority})
    assert world.listed_weights(vcluster) == world.weights


@given(
    parsers.re(
        r"(?:(?P<tenant>\w+)|a tenant without a fair share target) runs a job "
        r'"(?P<name>[^"]+)" of class (?P<cls>\d+) that holds (?:one|the other) node until '
        r"released"
    )
)
def holder(world: World, tenant: str | None, name: str, cls: str) -> None:
    _submit(world, tenant or NO_TARGET_TENANT, name, int(cls), until_released=True)
    job = world.jobs[name]
    a = world.wait_running(job)
    assert len(a["assigned_nodes"]) == 1, a
    held = {
        n for j in world.jobs.values() if j is not job for n in j.first.get("assigned_nodes", [])
    }
    assert not held & set(a["assigned_nodes"]), f"{name} shares a node with another holder: {a}"


@when(
    parsers.re(
        r'(?P<tenant>\w+) submits a job "(?P<name>[^"]+)" of class (?P<cls>\d+)'
        r"(?P<until> that runs until released)?"
    )
)
def submit_job(world: World, tenant: str, name: str, cls: str, until: str | None) -> None:
    _submit(world, tenant, name, int(cls), until_released=bool(until))


@then(parsers.parse('"{first}" and "{second}" both wait Pending while no node is free'))
def both_pending(world: World, first: str, second: str) -> None:
    for name in (first, second):
        a = world.wait_considered(world.jobs[name])
        assert a["state"] == "Pending", a
    assert all(n["owner"] for n in world.cluster.nodes()), world.cluster.nodes()


@when(parsers.parse('I release "{name}"'))
def release(world: World, name: str) -> None:
    world.release(name)


@then(parsers.parse('"{name}" starts on the node "{holder}" had, while "{other}" stays Pending'))
def starts_while_other_pending(world: World, name: str, holder: str, other: str) -> None:
    world.wait_end(holder)
    # Whichever of the two starts first is the one the scheduler preferred.
    started: dict[str, Any] = world.cluster.wait_for(
        f"{name} or {other} to start",
        lambda: next((a for n in (name, other) if (a := world.get(n))["state"] != "Pending"), None),
        timeout=TIMEOUT,
    )
    assert started["id"] == world.jobs[name].id, (
        f"{other} started on the freed node before {name}: {started}"
    )
    a = world.wait_running(world.jobs[name])
    assert a["assigned_nodes"] == world.jobs[holder].first["assigned_nodes"], a

    def check() -> None:
        assert world.get(name)["state"] == "Running", world.get(name)
        assert world.get(other)["state"] == "Pending", world.get(other)

    world.observe(f"{other} Pending", check)
    assert world.status_field(world.jobs[name].id, "State") == "Running"
    assert world.status_field(world.jobs[other].id, "State") == "Pending"
    assert other not in world.started_order(), world.started_order()


@then(parsers.parse('"{name}" runs on the node "{holder}" had and ends Completed'))
def runs_on_node_of(world: World, name: str, holder: str) -> None:
    a = world.wait_end(name)
    assert a["assigned_nodes"] == world.jobs[holder].first["assigned_nodes"], a
    assert a["started_at"] >= world.get(holder)["finished_at"], (a, world.get(holder))


@then(parsers.parse('"{name}" ends Completed'))
def ends_completed(world: World, name: str) -> None:
    world.wait_end(name)
    assert world.status_field(world.jobs[name].id, "State") == "Completed"


# --------------------------------------------------------------------------- administration


@when(parsers.parse("the administrator runs lattice {command}"))
def admin_runs(world: World, command: str) -> None:
    world.cli(*shlex.split(command), user=ADMIN)


@then(parsers.parse('lattice confirms "{message}"'))
def confirms(world: World, message: str) -> None:
    r = world.last
    assert r is not None
    assert r.stdout.strip() == message, show(r)


@then(
    parsers.parse(
        "lattice admin tenant list shows {tenant} with a fair share target of {target} and a "
        "burst allowance of {burst}"
    )
)
def tenant_listed(world: World, tenant: str, target: str, burst: str) -> None:
    row = _tenants(world)[tenant]
    assert (row["FAIR_SHARE"], row["BURST"]) == (target, burst), row
    (record,) = [
        t
        for t in json.loads(world.cli("admin", "tenant", "list", "-o", "json").stdout)
        if t["name"] == tenant
    ]
    assert record["fair_share_target"] == float(target), record
    assert record["burst_allowance"] == float(burst), record


@then(parsers.parse("lattice admin tenant list still shows no burst allowance for {tenant}"))
def no_burst_listed(world: World, tenant: str) -> None:
    row = _tenants(world)[tenant]
    assert row["BURST"] == "0", row  # 0: not set (`--burst-allowance` help)
