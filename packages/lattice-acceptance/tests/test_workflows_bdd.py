"""Steps for features/workflows.feature: jobs that wait for others (--dependency, #SBATCH
--dependency) and DAGs (`lattice dag submit`).

The scenarios share the module's real local cluster (``lattice_cluster``, 2 nodes); the
``world`` fixture cancels whatever still runs and waits for both nodes to be idle. Jobs
are batch scripts submitted with `lattice submit` as a user would; each appends its name
to the scenario's ``order`` file when it starts.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from lattice_acceptance.world import TIMEOUT, Job, assert_hint_line, assert_rejected, show
from lattice_acceptance.world import World as ClusterWorld
from lattice_test_harness.cluster import ClusterHandle
from pytest_bdd import given, parsers, scenarios, then, when

pytestmark = [pytest.mark.cluster]

scenarios("workflows.feature")

# Long enough for several scheduler cycles (1 s in the harness) with a node free.
OBSERVE_SECONDS = 2.5


@pytest.fixture
def world(lattice_cluster: ClusterHandle, tmp_path: Path) -> Iterator[ClusterWorld]:
    w = ClusterWorld.on(lattice_cluster, tmp_path)
    yield w
    w.clean_up()
    w.wait_idle()


def _ids(world: ClusterWorld, text: str) -> str:
    """``<name>`` placeholders replaced by the id of that job."""
    return re.sub(r"<(\w+)>", lambda m: world.jobs[m.group(1)].id, text)


def _script_job(world: ClusterWorld, name: str, header: list[str], body: str) -> Job:
    d = world.workdir / name
    d.mkdir()
    script = d / f"{name}.sh"
    script.write_text(
        "\n".join(
            [
                "#!/bin/bash",
                f"#SBATCH --job-name={name}",
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


def _wait_until_released(world: ClusterWorld, name: str) -> str:
    return f"while [ ! -e {world.workdir / name}/release ]; do sleep 0.1; done"


# --------------------------------------------------------------------------- given


@given(parsers.parse("a running Lattice cluster with {count:d} nodes for workflows"))
def running_cluster(world: ClusterWorld, count: int) -> None:
    world.check_nodes(count)


@given(parsers.parse('a job "{name}" that runs until released'))
def job_until_released(world: ClusterWorld, name: str) -> None:
    world.submit(name, directives=("--walltime=5m",), until_released=True)
    world.cluster.wait_state(world.jobs[name].id, "Running", timeout=TIMEOUT)


@given(parsers.parse('a job "{name}" that fails with exit code {code:d}'))
def failing_job(world: ClusterWorld, name: str, code: int) -> None:
    world.submit(name, f"exit {code}", directives=("--walltime=5m",), until_released=True)


@given(parsers.parse('a job "{name}" submitted with --dependency={cond} on "{other}"'))
@when(parsers.parse('I submit a job "{name}" with --dependency={cond} on "{other}"'))
def dependent_job(world: ClusterWorld, name: str, cond: str, other: str) -> None:
    header = [f"#SBATCH --dependency={cond}:{world.jobs[other].id}"]
    _script_job(world, name, header, f"echo done {name}")


@when(parsers.parse('I submit a script with "{line}" as "{name}"'))
def script_with_line(world: ClusterWorld, line: str, name: str) -> None:
    _script_job(world, name, [_ids(world, line)], f"echo done {name}")


@when(parsers.parse('"{name}" is released'))
def release(world: ClusterWorld, name: str) -> None:
    world.release(name)


@when(parsers.parse("I run lattice submit with --dependency={text}"))
def submit_bad_dependency(world: ClusterWorld, text: str) -> None:
    world.stored_before = len(world.cluster.allocations())
    world.cli("submit", f"--dependency={text}", "--walltime=5m", "--", "true", ok=False)


# --------------------------------------------------------------------------- then


@then(parsers.parse('"{name}" stays Pending with the reason "{reason}" while a node is free'))
def stays_pending(world: ClusterWorld, name: str, reason: str) -> None:
    c = world.cluster
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
def end_in_order(world: ClusterWorld, first: str, second: str) -> None:
    for name in (first, second):
        world.cluster.wait_state(world.jobs[name].id, "Completed", timeout=TIMEOUT)
    assert world.order_file.read_text().split() == [first, second]


@then(parsers.parse('"{name}" ends Cancelled with the reason "{reason}"'))
def ends_cancelled(world: ClusterWorld, name: str, reason: str) -> None:
    a = world.cluster.wait_state(world.jobs[name].id, "Cancelled", timeout=TIMEOUT)
    assert a["reason"] == _ids(world, reason), a
    assert a.get("started_at") is None  # it never ran


@then(parsers.parse('"{name}" ends Completed'))
def ends_completed(world: ClusterWorld, name: str) -> None:
    world.cluster.wait_state(world.jobs[name].id, "Completed", timeout=TIMEOUT)


@then(parsers.parse('the submission is refused with "{text}"'))
def refused(world: ClusterWorld, text: str) -> None:
    assert world.last is not None
    assert_rejected(world.last, text)


@then('the error carries a "Hint:" line')
def hint_line(world: ClusterWorld) -> None:
    assert world.last is not None
    assert_hint_line(world.last)


@then("no allocation was stored")
def nothing_stored(world: ClusterWorld) -> None:
    assert len(world.cluster.allocations()) == world.stored_before
