"""Steps for features/task_groups.feature: job arrays, their concurrency and their rows in
`lattice status`.

The scenarios share the module's real local cluster (``lattice_cluster``, 2 nodes); the
``world`` fixture cancels whatever still runs and waits for both nodes to be idle.
"""

from __future__ import annotations

import itertools
import json
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

import pytest
from lattice_acceptance.world import (
    Job,
    assert_hint_line,
    assert_rejected,
    log_lines,
    shared_world,
    show,
)
from lattice_acceptance.world import World as ClusterWorld
from lattice_test_harness.cluster import TERMINAL
from pytest_bdd import given, parsers, scenarios, then, when

pytestmark = [pytest.mark.cluster]

scenarios("task_groups.feature")

# Six short tasks one after the other on a busy machine.
GROUP_TIMEOUT = 60.0


@dataclass
class Group:
    id: str
    prefix: str
    tasks: list[dict[str, Any]] = field(default_factory=list)  # the records, once ended


@dataclass
class World(ClusterWorld):
    submitted: Group | None = None

    @property
    def group(self) -> Group:
        assert self.submitted is not None, "no task group submitted"
        return self.submitted


world = shared_world(World)  # the scenarios share the module's cluster


@given(parsers.parse("a running Lattice cluster with {count:d} nodes"))
def running_cluster(world: World, count: int) -> None:
    world.check_nodes(count)


@when(
    parsers.parse(
        'I submit a task group with lattice submit --task-group={spec} whose tasks print "{prefix}"'
        " and their index"
    )
)
def submit_group(world: World, spec: str, prefix: str) -> None:
    world.stored_before = len(world.cluster.allocations())
    command = f"sleep 0.3; echo {prefix}$LATTICE_TASK_INDEX"
    r = world.cli("submit", f"--task-group={spec}", "--walltime=5m", "--", "sh", "-c", command)
    m = re.match(r"Submitted task group (\S+)", r.stdout)
    assert m, show(r)
    world.submitted = Group(id=m.group(1), prefix=prefix)


def _tasks(world: World, g: Group) -> list[dict[str, Any]]:
    return world.cluster.request("GET", f"/api/v1/allocations?all=true&task_group={g.id}")[
        "allocations"
    ]


@then(parsers.parse('lattice confirms "{message}" with "{detail}"'))
def confirms(world: World, message: str, detail: str) -> None:
    r = world.last
    assert r is not None
    assert r.stdout.startswith(message) and detail in r.stdout, show(r)


@then(parsers.parse("the group has {count:d} tasks, with the indexes {first:d} to {last:d}"))
def group_tasks(world: World, count: int, first: int, last: int) -> None:
    g = world.group
    tasks = _tasks(world, g)
    for t in tasks:  # cancelled after the scenario if something goes wrong
        world.jobs[t["id"]] = Job(name=t["id"], id=t["id"], dir=world.workdir, user="tester")
    assert len(tasks) == count, tasks
    assert sorted(t["task_index"] for t in tasks) == list(range(first, last + 1)), tasks


@then(
    parsers.parse(
        'every task ends Completed and lattice logs of each show "{prefix}" and its index'
    )
)
def every_task_completed(world: World, prefix: str) -> None:
    g = world.group
    c = world.cluster
    g.tasks = [c.wait_state(t["id"], TERMINAL, timeout=GROUP_TIMEOUT) for t in _tasks(world, g)]
    assert all(t["state"] == "Completed" for t in g.tasks), g.tasks
    for t in g.tasks:
        r = world.cli("logs", t["id"])
        assert log_lines(r) == [f"{prefix}{t['task_index']}"], show(r)


@then(parsers.parse("no two tasks ran at the same time, although {count:d} nodes were free"))
def no_overlap(world: World, count: int) -> None:
    spans = sorted((t["started_at"], t["finished_at"]) for t in world.group.tasks)
    assert all(a[1] <= b[0] + 0.05 for a, b in itertools.pairwise(spans)), spans
    assert len(world.cluster.nodes()) == count


@then(
    parsers.parse('lattice status --all shows the group on one row, {state}, with nodes "{nodes}"')
)
def status_row(world: World, state: str, nodes: str) -> None:
    g = world.group
    r = world.cli("status", "--all")
    rows = [ln for ln in r.stdout.splitlines() if ln.split()[:1] == [g.id]]
    assert len(rows) == 1, show(r)
    assert state in rows[0].split() and nodes in rows[0].split(), show(r)
    assert not any(t["id"] in r.stdout for t in g.tasks), show(r)  # one row, not six


@then(parsers.parse("lattice status of the group with -o json lists its {count:d} tasks"))
def status_json(world: World, count: int) -> None:
    g = world.group
    r = world.cli("status", g.id, "-o", "json")
    listed = json.loads(r.stdout)
    assert len(listed) == count, show(r)
    assert {a["id"] for a in listed} == {t["id"] for t in g.tasks}, show(r)


# --------------------------------------------------------------------------- bad input


@when(parsers.re(r'I run "lattice (?P<line>.*)"$'))
def run_command_line(world: World, line: str) -> None:
    world.stored_before = len(world.cluster.allocations())
    world.cli(*shlex.split(line), ok=False)


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
