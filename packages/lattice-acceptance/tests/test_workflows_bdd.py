"""Steps for features/workflows.feature: jobs that wait for others (--dependency, #SBATCH
--dependency) and DAGs (`lattice dag submit`).

The scenarios share the module's real local cluster (``lattice_cluster``, 2 nodes); the
``world`` fixture cancels whatever still runs and waits for both nodes to be idle. Jobs
are batch scripts submitted with `lattice submit` as a user would; each appends its name
to the scenario's ``order`` file when it starts.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any

import pytest
from lattice_acceptance.world import (
    TIMEOUT,
    Job,
    assert_hint_line,
    assert_rejected,
    shared_world,
    show,
)
from lattice_acceptance.world import World as ClusterWorld
from pytest_bdd import given, parsers, scenarios, then, when

pytestmark = [pytest.mark.cluster]

scenarios("workflows.feature")

# Long enough for several scheduler cycles (1 s in the harness) with a node free.
OBSERVE_SECONDS = 2.5


@dataclass
class World(ClusterWorld):
    dag: tuple[str, int] | None = None  # (DAG id, allocations) that lattice dag submit printed


world = shared_world(World)  # the scenarios share the module's cluster


def _ids(world: World, text: str) -> str:
    """``<name>`` placeholders replaced by the id of that job."""
    return re.sub(r"<(\w+)>", lambda m: world.jobs[m.group(1)].id, text)


def _script_job(world: World, name: str, header: list[str], body: str, job_name: str = "") -> Job:
    d = world.workdir / name
    d.mkdir()
    script = d / f"{name}.sh"
    script.write_text(
        "\n".join(
            [
                "#!/bin/bash",
                f"#SBATCH --job-name={job_name or name}",
                "#SBATCH --time=5:00",
                *header,
                f"echo {name} >> {world.order_file}",
                body,
            ]
        )
        + "\n"
    )
    r = world.cli("submit", str(script))
    m = re.fullmatch(r"Submitted allocation (\S+)\n?", r.stdout)
    assert m, show(r)
    job = Job(name=name, id=m.group(1), dir=d, user="tester")
    world.jobs[name] = job
    return job


def _wait_until_released(world: World, name: str) -> str:
    return f"while [ ! -e {world.workdir / name}/release ]; do sleep 0.1; done"


# --------------------------------------------------------------------------- given


@given(parsers.parse("a running Lattice cluster with {count:d} nodes for workflows"))
def running_cluster(world: World, count: int) -> None:
    world.check_nodes(count)


@given(parsers.parse('a job "{name}" that runs until released'))
def job_until_released(world: World, name: str) -> None:
    world.submit(name, directives=("--walltime=5m",), until_released=True)
    world.cluster.wait_state(world.jobs[name].id, "Running", timeout=TIMEOUT)


@given(parsers.parse('a job "{name}" that fails with exit code {code:d}'))
def failing_job(world: World, name: str, code: int) -> None:
    world.submit(name, f"exit {code}", directives=("--walltime=5m",), until_released=True)


@given(parsers.parse('a job "{name}" submitted with --dependency={cond} on "{other}"'))
@when(parsers.parse('I submit a job "{name}" with --dependency={cond} on "{other}"'))
def dependent_job(world: World, name: str, cond: str, other: str) -> None:
    header = [f"#SBATCH --dependency={cond}:{world.jobs[other].id}"]
    _script_job(world, name, header, f"echo done {name}")


@given(
    parsers.parse(
        'a job "{name}" named "{job_name}" with --dependency=singleton that runs until released'
    )
)
def singleton_until_released(world: World, name: str, job_name: str) -> None:
    wait = _wait_until_released(world, name)
    job = _script_job(world, name, ["#SBATCH --dependency=singleton"], wait, job_name)
    world.cluster.wait_state(job.id, "Running", timeout=TIMEOUT)


@when(parsers.parse('I submit a job "{name}" named "{job_name}" with --dependency=singleton'))
def singleton_job(world: World, name: str, job_name: str) -> None:
    _script_job(world, name, ["#SBATCH --dependency=singleton"], f"echo done {name}", job_name)


@when(parsers.parse('I submit a script with "{line}" as "{name}"'))
def script_with_line(world: World, line: str, name: str) -> None:
    _script_job(world, name, [_ids(world, line)], f"echo done {name}")


@when(parsers.parse('"{name}" is released'))
def release(world: World, name: str) -> None:
    world.release(name)


@when(parsers.parse("I run lattice submit with --dependency={text}"))
def submit_bad_dependency(world: World, text: str) -> None:
    world.stored_before = len(world.cluster.allocations())
    world.cli("submit", f"--dependency={text}", "--walltime=5m", "--", "true", ok=False)


# --------------------------------------------------------------------------- then


@then(parsers.parse('"{name}" stays Pending with the reason "{reason}" while a node is free'))
def stays_pending(world: World, name: str, reason: str) -> None:
    c = world.cluster
    c.wait_for(  # the scheduler publishes a reason on its next cycle
        f"{name}'s pending reason",
        lambda: c.get(world.jobs[name].id)["pending_reason"] == reason,
        timeout=TIMEOUT,
    )
    deadline = time.monotonic() + OBSERVE_SECONDS
    while time.monotonic() < deadline:
        a = c.get(world.jobs[name].id)
        assert a["state"] == "Pending", a
        assert a["pending_reason"] == reason, a
        assert any(not n["owner"] for n in c.nodes())
        time.sleep(0.2)
    r = world.cli("status", world.jobs[name].id)
    assert reason in r.stdout, show(r)


@then(parsers.parse('"{first}" and "{second}" end Completed, in that order'))
def end_in_order(world: World, first: str, second: str) -> None:
    for name in (first, second):
        world.cluster.wait_state(world.jobs[name].id, "Completed", timeout=TIMEOUT)
    assert world.order_file.read_text().split() == [first, second]


@then(parsers.parse('"{name}" ends Cancelled with the reason "{reason}"'))
def ends_cancelled(world: World, name: str, reason: str) -> None:
    a = world.cluster.wait_state(world.jobs[name].id, "Cancelled", timeout=TIMEOUT)
    assert a["reason"] == _ids(world, reason), a
    assert a.get("started_at") is None  # it never ran


@then(parsers.parse('"{name}" ends Completed'))
def ends_completed(world: World, name: str) -> None:
    world.cluster.wait_state(world.jobs[name].id, "Completed", timeout=TIMEOUT)


@then(parsers.parse('the submission is refused with "{text}"'))
def refused(world: World, text: str) -> None:
    assert world.last is not None
    assert_rejected(world.last, text)


@then('the error carries a "Hint:" line')
def hint_line(world: World) -> None:
    assert world.last is not None
    assert_hint_line(world.last)


@then("no allocation was stored")
def nothing_stored(world: World) -> None:
    assert len(world.cluster.allocations()) == world.stored_before


# --------------------------------------------------------------------------- DAGs


def _stage(world: World, ref: str, after: dict[str, str], code: int = 0) -> str:
    lines = [
        f"  - name: {ref}",
        f"    entrypoint: \"sh -c 'echo {ref} >> {world.order_file}; sleep 0.2; exit {code}'\"",
        "    nodes: 1",
        '    walltime: "5m"',
    ]
    if after:
        lines.append("    depends_on:")
        lines.extend(f"      - {p}: {cond}" for p, cond in after.items())
    return "\n".join(lines)


def _submit_dag(world: World, name: str, stages: list[str], ok: bool = True) -> None:
    path = world.workdir / f"{name}.yaml"
    path.write_text(f"name: {name}\nallocations:\n" + "\n".join(stages) + "\n")
    world.stored_before = len(world.cluster.allocations())
    r = world.cli("dag", "submit", str(path), ok=ok)
    m = re.search(r"Submitted DAG (\S+) with (\d+) allocations", r.stdout)
    world.dag = (m.group(1), int(m.group(2))) if m else None


def _dag(world: World) -> dict[str, Any]:
    assert world.dag is not None, show(world.last)
    return json.loads(world.cli("dag", "status", world.dag[0], "-o", "json").stdout)


def _member_ids(world: World) -> dict[str, str]:
    return {m["ref"]: m["allocation_id"] for m in _dag(world)["members"]}


@when(
    parsers.parse(
        'I submit with lattice dag submit a DAG "{name}" where "{b}" and "{c}" follow "{a}" '
        'and "{d}" follows "{b2}" and "{c2}"'
    )
)
def submit_diamond(
    world: World, name: str, a: str, b: str, c: str, d: str, b2: str, c2: str
) -> None:
    # a runs until released, so the Blocked members can be seen
    first = [
        f"  - name: {a}",
        f"    entrypoint: \"sh -c 'echo {a} >> {world.order_file}; "
        f"while [ ! -e {world.workdir}/release-{a} ]; do sleep 0.1; done'\"",
        '    walltime: "5m"',
    ]
    _submit_dag(
        world,
        name,
        [
            "\n".join(first),
            _stage(world, b, {a: "success"}),
            _stage(world, c, {a: "success"}),
            _stage(world, d, {b2: "success", c2: "success"}),
        ],
    )


@when(parsers.parse('I submit with lattice dag submit a pipeline "{name}" of the stages {stages}'))
def submit_pipeline(world: World, name: str, stages: str) -> None:
    refs = re.findall(r'"(\w+)"', stages)
    _submit_dag(
        world,
        name,
        [_stage(world, r, {refs[i - 1]: "success"} if i else {}) for i, r in enumerate(refs)],
    )


@when(
    parsers.parse(
        'I submit with lattice dag submit a DAG "{name}" where "{train}" exits with code {code:d}, '
        '"{evaluate}" follows it on success and "{notify}" on failure'
    )
)
def submit_guarded(
    world: World, name: str, train: str, code: int, evaluate: str, notify: str
) -> None:
    _submit_dag(
        world,
        name,
        [
            _stage(world, train, {}, code),
            _stage(world, evaluate, {train: "success"}),
            _stage(world, notify, {train: "failure"}),
        ],
    )


@when(
    parsers.parse(
        'I submit with lattice dag submit a DAG whose "{a}" follows "{c}", "{b}" follows "{a2}" '
        'and "{c2}" follows "{b2}"'
    )
)
def submit_cycle(world: World, a: str, c: str, b: str, a2: str, c2: str, b2: str) -> None:
    _submit_dag(
        world,
        "loop",
        [
            _stage(world, a, {c: "success"}),
            _stage(world, b, {a2: "success"}),
            _stage(world, c2, {b2: "any"}),
        ],
        ok=False,
    )


@then(parsers.parse('lattice confirms "Submitted DAG" with {n:d} allocations'))
def confirms_dag(world: World, n: int) -> None:
    assert world.dag is not None and world.dag[1] == n, show(world.last)


@then(
    parsers.parse(
        'lattice dag status shows "{b}", "{c}" and "{d}" Blocked while "{a}" has not ended'
    )
)
def blocked_while(world: World, b: str, c: str, d: str, a: str) -> None:
    ids = _member_ids(world)
    world.cluster.wait_state(ids[a], "Running", timeout=TIMEOUT)
    time.sleep(1.5)  # a scheduler cycle with a node free
    states = {m["ref"]: m["state"] for m in _dag(world)["members"]}
    assert states == {a: "Running", b: "Blocked", c: "Blocked", d: "Blocked"}, states
    r = world.cli("dag", "status", world.dag[0])
    assert "Blocked" in r.stdout, show(r)
    (world.workdir / f"release-{a}").touch()


@then(parsers.parse('every stage ends Completed, "{first}" first and "{last}" last'))
def diamond_order(world: World, first: str, last: str) -> None:
    ids = _member_ids(world)
    for aid in ids.values():
        world.cluster.wait_state(aid, "Completed", timeout=TIMEOUT)
    order = world.order_file.read_text().split()
    assert order[0] == first and order[-1] == last and sorted(order) == sorted(ids), order


@then(parsers.parse("every stage ends Completed, in the order {stages}"))
def pipeline_order(world: World, stages: str) -> None:
    refs = re.findall(r'"(\w+)"', stages)
    ids = _member_ids(world)
    for ref in refs:
        world.cluster.wait_state(ids[ref], "Completed", timeout=TIMEOUT)
    assert world.order_file.read_text().split() == refs


@then(parsers.parse("lattice dag status shows the DAG {state}"))
def dag_state_is(world: World, state: str) -> None:
    world.cluster.wait_for(f"DAG {state}", lambda: _dag(world)["state"] == state, timeout=TIMEOUT)
    r = world.cli("dag", "status", world.dag[0])
    assert state in r.stdout, show(r)


@then(parsers.parse('"{ref}" of the DAG ends Cancelled with the reason "{reason}"'))
def dag_member_cancelled(world: World, ref: str, reason: str) -> None:
    a = world.cluster.wait_state(_member_ids(world)[ref], "Cancelled", timeout=TIMEOUT)
    assert a["reason"] == reason and a.get("started_at") is None, a


@then(parsers.parse('"{ref}" of the DAG ends Completed'))
def dag_member_completed(world: World, ref: str) -> None:
    world.cluster.wait_state(_member_ids(world)[ref], "Completed", timeout=TIMEOUT)


@when(
    parsers.parse(
        'I submit with lattice dag submit two {n:d}-task arrays "{pre}" and "{train}" where '
        '"{train2}" follows "{pre2}" element by element'
    )
)
def submit_arrays(world: World, n: int, pre: str, train: str, train2: str, pre2: str) -> None:
    d = world.workdir
    stages = [
        f"  - name: {pre}\n"
        f"    entrypoint: \"sh -c 'sleep 0.$((${{INDEX}} % 3)); touch {d}/{pre}-${{INDEX}}'\"\n"
        f'    task_group: "0-{n - 1}"\n'
        '    walltime: "5m"',
        f"  - name: {train}\n"
        f"    entrypoint: \"sh -c 'test -e {d}/{pre}-${{INDEX}}'\"\n"
        f'    task_group: "0-{n - 1}"\n'
        '    walltime: "5m"\n'
        "    depends_on:\n"
        f"      - {pre2}: corresponding",
    ]
    _submit_dag(world, "arrays", stages)


@then(parsers.parse("all {n:d} tasks end Completed"))
def all_tasks_completed(world: World, n: int) -> None:
    ids = _member_ids(world)
    assert len(ids) == n, ids
    for aid in ids.values():
        a = world.cluster.wait_state(aid, ("Completed", "Failed", "Cancelled"), timeout=60)
        assert a["state"] == "Completed", a


@then(
    parsers.parse('every "{train}" element started after the "{pre}" element with its index ended')
)
def elementwise_order(world: World, train: str, pre: str) -> None:
    ids = _member_ids(world)
    allocs = {ref: world.cluster.get(aid) for ref, aid in ids.items()}
    for ref, a in allocs.items():
        if ref.startswith(f"{train}["):
            before = allocs[ref.replace(train, pre, 1)]
            assert a["started_at"] >= before["finished_at"], (ref, a, before)
