"""Steps for features/allocation_history.feature: ended allocations leave the quorum's
state after the retention window and `lattice history` / `lattice status ID` read them
from the history store (lattice_common.history).

The module's own real local cluster: a retention of 2 s, swept every 0.5 s."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import pytest
from lattice_acceptance.world import World, module_world, show
from lattice_common.rpc import Endpoints, RemoteQuorum
from lattice_test_harness.cluster import ClusterHandle
from lattice_test_harness.plugin import make_cluster
from pytest_bdd import given, parsers, scenarios, then, when

pytestmark = [pytest.mark.cluster]

scenarios("allocation_history.feature")

RETENTION_SECONDS = 2.0


@pytest.fixture(scope="module")
def history_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    env = {
        "LATTICE_STORAGE__ALLOCATION_RETENTION_HOURS": repr(RETENTION_SECONDS / 3600),
        "LATTICE_STORAGE__HISTORY_SWEEP_INTERVAL_SECONDS": "0.5",
    }
    h = make_cluster(tmp_path_factory.mktemp("history"), members=1, agents=1, env=env)
    yield h
    h.cluster.stop()


world = module_world("history_cluster")  # the scenarios share the module's cluster


@given(
    parsers.parse(
        "a running Lattice cluster that keeps ended allocations live for {seconds:d} seconds"
    )
)
def running_cluster(world: World, seconds: int) -> None:
    assert seconds == RETENTION_SECONDS
    world.check_nodes(1)


@when(parsers.parse('{user} submits "{name}", which exits with code {code:d}'))
def submit_failing(world: World, user: str, name: str, code: int) -> None:
    world.current = world.submit(name, f"exit {code}", directives=("--walltime=5m",), user=user)


@when(parsers.parse("the job ended more than {seconds:d} seconds ago"))
def ended_long_ago(world: World, seconds: int) -> None:
    assert world.current is not None
    a = world.cluster.wait_state(world.current.id, ("Completed", "Failed"), timeout=30)
    time.sleep(max(0.0, float(a["finished_at"]) + seconds - time.time()) + 0.1)


def _live_ids(cluster: ClusterHandle) -> set[str]:
    async def snapshot() -> set[str]:
        q = RemoteQuorum(Endpoints(cluster.cluster.grpc_endpoints))
        async for d in q.watch():
            return {a.id for a in d.allocations}
        return set()

    return asyncio.run(snapshot())


@then("the quorum's live state no longer holds the job")
def not_live(world: World) -> None:
    assert world.current is not None
    deadline = time.monotonic() + 20
    while world.current.id in _live_ids(world.cluster):
        assert time.monotonic() < deadline, "the ended job stayed in the quorum's state"
        time.sleep(0.3)


@then(parsers.parse('"lattice history" lists "{name}" as {state} with exit code {code:d}'))
def history_lists(world: World, name: str, state: str, code: int) -> None:
    job = world.jobs[name]
    r = world.cli("history", "-o", "json", user=job.user)
    rows = {a["id"]: a for a in json.loads(r.stdout)}
    assert job.id in rows, show(r)
    assert rows[job.id]["state"] == state and rows[job.id]["exit_code"] == code, show(r)
    table = world.cli("history", user=job.user)
    assert job.id in table.stdout and state.upper() in table.stdout.upper(), show(table)


@then(parsers.parse('"lattice status" of the job still says {state}'))
def status_says(world: World, state: str) -> None:
    assert world.current is not None
    assert world.status_field(world.current.id, "State") == state


def _history_ids(world: World, user: str, *args: str) -> list[str]:
    r = world.cli("history", *args, "-o", "json", user=user)
    assert r.returncode == 0, show(r)
    return [a["id"] for a in json.loads(r.stdout)]


@then(parsers.parse('"lattice history --limit {n:d}" lists only "{name}"'))
def history_limit(world: World, n: int, name: str) -> None:
    job = world.jobs[name]
    assert _history_ids(world, job.user, "--limit", str(n)) == [job.id]


@then(
    parsers.parse(
        '"lattice history --since" a moment after "{before}" ended lists "{name}" but not "{other}"'
    )
)
def history_since(world: World, before: str, name: str, other: str) -> None:
    first = world.cluster.get(world.jobs[before].id)
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(float(first["finished_at"]) + 1))
    ids = _history_ids(world, world.jobs[name].user, "--since", f"{since}Z")
    assert world.jobs[name].id in ids and world.jobs[other].id not in ids
