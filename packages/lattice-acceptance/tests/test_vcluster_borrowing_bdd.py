"""Steps for features/vcluster_borrowing.feature: elastic borrowing of idle nodes between
vClusters, and the home vCluster reclaiming its node.

The scenario starts its own cluster (``World.start_cluster`` from
``lattice_acceptance.world``) with one node at home in each of two vClusters, each
served by its own scheduler. Jobs are batch scripts submitted with `lattice submit`;
the REST API is read to see where they run.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from lattice_acceptance.world import Job, fresh_world
from lattice_acceptance.world import World as ClusterWorld
from pytest_bdd import given, parsers, scenarios, then, when

pytestmark = [pytest.mark.cluster]

scenarios("vcluster_borrowing.feature")


@dataclass
class World(ClusterWorld):
    borrower: Job | None = None  # the job that runs on a node of another vCluster


world = fresh_world(World)  # a cluster of its own per scenario


def _home_of(world: World, vcluster: str) -> str:
    (node,) = [n["id"] for n in world.cluster.nodes() if n["home_vcluster"] == vcluster]
    return node


@given(
    parsers.parse(
        'a Lattice cluster with the vClusters "{first}" and "{second}", each the home of one node'
    )
)
def two_vclusters(world: World, first: str, second: str) -> None:
    world.start_cluster(2, (first, second), agent_homes=(first, second))
    assert sorted(n["home_vcluster"] for n in world.cluster.nodes()) == [first, second]


@when(
    parsers.parse(
        'I submit the jobs "{one}" and "{two}" to vCluster "{vcluster}", which run until released'
    )
)
def submit_two(world: World, one: str, two: str, vcluster: str) -> None:
    for name in (one, two):
        world.submit(
            name, directives=("--walltime=10m", f"--vcluster={vcluster}"), until_released=True
        )


@then(parsers.parse('both run, one of them on the node at home in "{home}"'))
def both_run(world: World, home: str) -> None:
    running = {name: world.wait_running(job) for name, job in world.jobs.items()}
    placed = sorted(n for a in running.values() for n in a["assigned_nodes"])
    assert placed == world.node_ids(), running
    node = _home_of(world, home)
    (name,) = [name for name, a in running.items() if a["assigned_nodes"] == [node]]
    world.borrower, world.node = world.jobs[name], node


@then(parsers.parse('lattice nodes shows that node at home in "{home}" and owned by "{owner}"'))
def node_lent(world: World, home: str, owner: str) -> None:
    assert world.node_field(world.node, "Home vCluster") == home
    assert world.node_field(world.node, "Owner vCluster") == owner


@when(parsers.parse('I submit a job "{name}" of class {cls:d} to vCluster "{vcluster}"'))
def submit_home_job(world: World, name: str, cls: int, vcluster: str) -> None:
    world.submit(
        name, directives=("--walltime=5m", f"--preemption-class={cls}", f"--vcluster={vcluster}")
    )


@then(parsers.parse('"{name}" runs on the node at home in "{home}" and ends Completed'))
def runs_at_home(world: World, name: str, home: str) -> None:
    a = world.wait_end(name)
    assert a["assigned_nodes"] == [_home_of(world, home)], a


@then(
    parsers.parse(
        'the job of "{vcluster}" that ran there was preempted once and kept its original '
        "submit time"
    )
)
def borrower_preempted(world: World, vcluster: str) -> None:
    job = world.borrower
    assert job is not None
    a = world.cluster.get(job.id)
    assert a["spec"]["vcluster"] == vcluster, a
    assert a["preempted_count"] == 1, a
    assert a["submitted_at"] == job.first["submitted_at"], (a, job.first)
