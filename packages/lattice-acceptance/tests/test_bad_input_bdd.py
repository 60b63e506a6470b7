"""Steps for features/bad_input.feature: refused submissions, through the CLI and REST.

The scenarios share the module's real local cluster (``lattice_cluster``): nothing they
do is meant to be stored, and whatever is stored by mistake is cancelled afterwards.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass

import pytest
from lattice_acceptance.world import Job, assert_hint_line, assert_rejected, shared_world
from lattice_acceptance.world import World as ClusterWorld
from lattice_test_harness.cluster import ApiError
from pytest_bdd import given, parsers, scenarios, then, when

pytestmark = [pytest.mark.cluster]

scenarios("bad_input.feature")


@dataclass
class World(ClusterWorld):
    api_error: ApiError | None = None


world = shared_world(World)  # the scenarios share the module's cluster


def _keep_if_accepted(world: World, stdout: str) -> None:
    """A submission accepted by mistake is cancelled after the scenario."""
    if m := re.search(r"Submitted allocation (\S+)", stdout):
        world.jobs[m.group(1)] = Job(name=m.group(1), id=m.group(1), dir=world.workdir, user="")


@given(parsers.parse("a running Lattice cluster with {count:d} nodes"))
def running_cluster(world: World, count: int) -> None:
    world.check_nodes(count)


# --------------------------------------------------------------------------- CLI


@when(parsers.parse('I run lattice submit with {options} for the command "{command}"'))
def submit_bad(world: World, options: str, command: str) -> None:
    world.stored_before = len(world.cluster.allocations())
    if options.startswith("a script with "):
        directive = options.removeprefix("a script with ")
        script = world.workdir / "bad.sh"
        script.write_text(f"#!/bin/bash\n{directive}\n#LATTICE --walltime=5m\n{command}\n")
        args = [str(script)]
    else:
        flags = [] if options == "no walltime" else shlex.split(options)
        if options != "no walltime" and not any(f.startswith("--walltime") for f in flags):
            flags.append("--walltime=5m")
        args = [*flags, "--", *shlex.split(command)]
    r = world.cli("submit", *args, ok=False)
    _keep_if_accepted(world, r.stdout)


@when(parsers.re(r'I run "lattice (?P<line>.*)"$'))
def run_command_line(world: World, line: str) -> None:
    world.stored_before = len(world.cluster.allocations())
    r = world.cli(*shlex.split(line), ok=False)
    _keep_if_accepted(world, r.stdout)


@then(parsers.parse("the submission is rejected with an error mentioning '{error}'"))
def rejected(world: World, error: str) -> None:
    assert world.last is not None
    assert_rejected(world.last, error)


@then('the error carries a "Hint:" line')
def carries_hint_line(world: World) -> None:
    assert world.last is not None
    assert_hint_line(world.last)


@then("no allocation was stored")
def nothing_stored(world: World) -> None:
    assert len(world.cluster.allocations()) == world.stored_before


# --------------------------------------------------------------------------- REST


@when(parsers.parse("I POST an allocation to the REST API with {name} set to {value}"))
def post_bad(world: World, name: str, value: str) -> None:
    world.stored_before = len(world.cluster.allocations())
    spec = {"entrypoint": "echo never", name: json.loads(value)}
    try:
        a = world.cluster.submit(**spec)
    except ApiError as e:
        world.api_error = e
    else:
        world.jobs[a["id"]] = Job(name=a["id"], id=a["id"], dir=world.workdir, user="")
        raise AssertionError(f"the API accepted {name}={value}: {a}")


@then(parsers.parse("the API answers {status:d} {code} with an error mentioning '{error}'"))
def api_rejected(world: World, status: int, code: str, error: str) -> None:
    e = world.api_error
    assert e is not None
    assert (e.status, e.error.get("code")) == (status, code), (e.status, e.error)
    assert error in e.error.get("message", ""), e.error


@then("the error carries a hint")
def api_hint(world: World) -> None:
    e = world.api_error
    assert e is not None
    assert len(e.error.get("hint") or "") > 5, e.error
