"""Steps for features/allocation_listing.feature: the listing rule of `lattice status`.

The scenario shares the module's real local cluster (``lattice_cluster``); the ``world``
fixture releases and cancels what it submitted and waits for both nodes to be idle.
"""

from __future__ import annotations

import json
import shlex

import pytest
from lattice_acceptance.world import World, shared_world, show
from pytest_bdd import given, parsers, scenarios, then, when

pytestmark = [pytest.mark.cluster]

scenarios("allocation_listing.feature")


world = shared_world(World)  # the scenarios share the module's cluster


@given(parsers.parse("a running Lattice cluster with {count:d} nodes"))
def running_cluster(world: World, count: int) -> None:
    world.check_nodes(count)


@given(
    parsers.parse(
        'alice has submitted "{first}" and bob has submitted "{second}", both held until released'
    )
)
def two_users_submit(world: World, first: str, second: str) -> None:
    for name, user in ((first, "alice"), (second, "bob")):
        world.submit(name, directives=("--walltime=5m",), user=user, until_released=True)


@when(parsers.parse('{user} runs "lattice {command}"'))
def user_runs(world: World, user: str, command: str) -> None:
    world.cli(*shlex.split(command), user=user)


def _listed(world: World) -> str:
    assert world.last is not None
    return world.last.stdout


@then(parsers.parse('the listing shows "{shown}" and not "{hidden}"'))
def shows_one(world: World, shown: str, hidden: str) -> None:
    out = _listed(world)
    assert world.jobs[shown].id in out, show(world.last)
    assert world.jobs[hidden].id not in out, show(world.last)


@then(parsers.parse('the listing shows "{first}" and "{second}"'))
def shows_both(world: World, first: str, second: str) -> None:
    out = _listed(world)
    for name in (first, second):
        assert world.jobs[name].id in out, show(world.last)


@then("the JSON lists the allocations of alice and bob, each under its own user")
def json_users(world: World) -> None:
    data = json.loads(_listed(world))
    records = data["allocations"] if isinstance(data, dict) else data
    users = {a["id"]: a["spec"]["user"] for a in records}
    for job in world.jobs.values():
        assert users.get(job.id) == job.user, (job, users)
