"""Steps for features/node_handover.feature: a busy node's next allocation takes it in
the commit that ends its owner (lattice_quorum.handlers.handoff, queued by the
scheduler's lattice_scheduler.handoff). A fresh one-node cluster per scenario; the jobs
run until released (``lattice_acceptance.world``). The node's ``next_allocation`` is
read from `lattice nodes -o json`; "the same commit" from the allocations' revisions
(the revision of the last change to each record)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from typing import Any

import pytest
from lattice_acceptance.world import TIMEOUT, World, fresh_world
from pytest_bdd import given, scenarios, then, when

pytestmark = [pytest.mark.cluster]

scenarios("node_handover.feature")


world = fresh_world(World)  # a cluster of its own per scenario


def the_node(world: World) -> dict[str, Any]:
    nodes = json.loads(world.cli("nodes", "-o", "json").stdout)
    assert len(nodes) == 1, nodes
    return nodes[0]


@given("a Lattice cluster with 1 node running a job until released")
def one_busy_node(world: World) -> None:
    world.start_cluster(1)
    world.wait_running(world.submit("first", directives=("--walltime=10m",), until_released=True))


@given(
    "a Lattice cluster with 1 node whose scheduler cycles by itself only once a minute, "
    "running a job until released"
)
def one_busy_node_slow_cycle(world: World) -> None:
    world.start_cluster(1, cycle_interval=60.0)
    world.wait_running(world.submit("first", directives=("--walltime=10m",), until_released=True))


@given("two jobs that run until released waiting behind it")
def two_waiting(world: World) -> None:
    for name in ("second", "third"):
        world.submit(name, directives=("--walltime=10m",), until_released=True)
        assert world.get(name)["state"] == "Pending"


@when("the running job is released")
def release_first(world: World) -> None:
    world.release("first")
    world.wait_end("first")


@when("the first waiting job runs on the node")
@then("the first waiting job runs on the node")
def second_runs(world: World) -> None:
    a = world.wait_running(world.jobs["second"])
    assert a["assigned_nodes"] == [the_node(world)["id"]]


@then("the node shows the second waiting job as its next allocation")
def node_shows_next(world: World) -> None:
    third = world.jobs["third"].id
    world.cluster.wait_for(
        "the node's next allocation",
        lambda: the_node(world).get("next_allocation") == third,
        timeout=TIMEOUT,
    )


class Watch(threading.Thread):
    """``GET /api/v1/allocations/{id}/watch`` (NDJSON: one event per committed entry that
    changed it, with the state's revision after that entry), read until ``until``."""

    def __init__(self, world: World, alloc_id: str, until: tuple[str, ...]) -> None:
        super().__init__(daemon=True)
        self.until = until
        self.url = f"{world.cluster.url}/api/v1/allocations/{alloc_id}/watch"
        self.user = world.cluster.user
        self.events: list[dict[str, Any]] = []
        self.ready = threading.Event()

    def run(self) -> None:
        req = urllib.request.Request(self.url, headers={"x-lattice-user": self.user})
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            self.ready.set()
            for line in r:
                if line.strip():
                    self.events.append(json.loads(line))
                    if self.events[-1]["allocation"]["state"] in self.until:
                        return


@when("the first waiting job is released")
def release_second(world: World, watches: dict[str, Watch]) -> None:
    watches["second"] = Watch(world, world.jobs["second"].id, ("Completed", "Failed"))
    watches["third"] = Watch(world, world.jobs["third"].id, ("Running", "Staging"))
    for w in watches.values():
        w.start()
        assert w.ready.wait(TIMEOUT)
    world.release("second")


@pytest.fixture
def watches() -> dict[str, Watch]:
    return {}


@pytest.fixture
def submitted_at() -> dict[str, float]:
    return {}


@then("the second waiting job runs on the node, started by the commit that ended the first")
def third_follows(world: World, watches: dict[str, Watch]) -> None:
    ended = world.wait_end("second")
    started = world.wait_running(world.jobs["third"])
    assert started["assigned_nodes"] == ended["assigned_nodes"]
    for w in watches.values():
        w.join(TIMEOUT)
    end = next(e for e in watches["second"].events if e["allocation"]["state"] == "Completed")
    start = next(e for e in watches["third"].events if e["allocation"]["state"] != "Pending")
    # one committed entry ended the one and started the other: the node was never free
    assert start["revision"] == end["revision"], (start, end)
    assert the_node(world)["owner"] == started["id"]


@when("the node's next allocation is cancelled")
def cancel_next(world: World) -> None:
    node_shows_next(world)
    third = world.jobs["third"].id
    world.cli("cancel", third)
    world.cluster.wait_state(third, "Cancelled", timeout=TIMEOUT)


@then("the cancelled job never ran")
def never_ran(world: World) -> None:
    world.wait_end("second")
    a = world.get("third")
    assert a["state"] == "Cancelled" and not a.get("assigned_nodes"), a
    assert "third" not in world.started_order()


@then("the node is free")
def node_free(world: World) -> None:
    world.cluster.wait_for(
        "the node free", lambda: not the_node(world).get("owner"), timeout=TIMEOUT
    )
    assert not the_node(world).get("next_allocation")


SENT = "lattice_api_desired_state_sent_total"


@then(
    "the server has sent the node's agent four desired states: an idle node, the first "
    "job, the node idle again, the job that took it"
)
def four_sent(world: World) -> None:
    # a fresh one-node cluster: every desired state the server sent went to this agent.
    # The first waiting job was scheduled onto the freed node (nothing is queued on a
    # full cluster before a hand-over); the next allocation queued since is not sent
    world.observe(
        "the desired states sent",
        lambda: world.server_metric(SENT) == 4 or pytest.fail(f"{world.server_metric(SENT)} sent"),
    )


@then(
    "the server's metrics count the queued next job as a change that left the agent's "
    "work as it was"
)
def counted_unchanged(world: World) -> None:
    assert world.server_metric("lattice_api_desired_state_unchanged_total") >= 1


@when("a job of a higher preemption class that runs until released is submitted")
def urgent_submitted(world: World, submitted_at: dict[str, float]) -> None:
    submitted_at["urgent"] = time.monotonic()
    world.submit(
        "urgent", directives=("--walltime=10m", "--preemption-class=5"), until_released=True
    )
    assert world.get("urgent")["state"] == "Pending"


@then("the node shows the higher-class job as its next allocation well before the periodic cycle")
def urgent_next(world: World, submitted_at: dict[str, float]) -> None:
    # the only cycles in the last minute were pokes: the hand-over's weighs what arrived
    # since the last full one, so the urgent job goes ahead of the third one
    urgent = world.jobs["urgent"].id
    world.cluster.wait_for(
        "the urgent job as the node's next allocation",
        lambda: the_node(world).get("next_allocation") == urgent,
        timeout=20,
    )
    assert time.monotonic() - submitted_at["urgent"] < 30
