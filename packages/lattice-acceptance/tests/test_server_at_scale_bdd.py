"""Steps for features/server_at_scale.feature: the collector's pauses on the server's
/metrics, and a gRPC submission answered with the allocation exactly as stored (the
messages are built by the plan in ``lattice_common.wire``) or, asked for, with its id
alone. The shared module cluster
runs in development authentication, so gRPC names its user with ``x-lattice-user``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from grpclib.client import Channel
from lattice_acceptance.world import World, shared_world
from lattice_common.net import split_host_port
from lattice_common.proto.lattice import v1
from pytest_bdd import given, scenarios, then, when

pytestmark = [pytest.mark.cluster]

scenarios("server_at_scale.feature")

ENV = {"OMP_NUM_THREADS": "8", "RUN_LABEL": "flat cost"}
TAGS = {"team": "physics", "campaign": "2026-q4"}


world = shared_world(World)  # the scenarios share the module's cluster


@given("a running Lattice cluster with 2 nodes")
def running_cluster(world: World) -> None:
    world.check_nodes(2)


@when("the operator reads the server's metrics", target_fixture="metrics_text")
def read_metrics(world: World) -> str:
    return world.server_metrics()


@then(
    "they show the collector's pauses by generation, the longest full collection and the "
    "objects kept out of its walks"
)
def collector_metrics(metrics_text: str) -> None:
    lines = metrics_text.splitlines()
    assert "# TYPE lattice_gc_pause_seconds histogram" in lines
    # a running server has collected its youngest generation many times already
    count = next(x for x in lines if x.startswith('lattice_gc_pause_seconds_count{generation="0"}'))
    assert float(count.rsplit(" ", 1)[1]) > 0
    for gauge in ("lattice_gc_longest_full_pause_seconds", "lattice_gc_frozen_objects"):
        value = next(x for x in lines if x.startswith(gauge + " "))
        assert float(value.rsplit(" ", 1)[1]) >= 0


async def _submit_over_grpc(world: World, *, ids_only: bool = False) -> v1.SubmitResponse:
    host, port = split_host_port(world.cluster.cluster.grpc_endpoints.split(",")[0])
    channel = Channel(host, port)
    try:
        stub = v1.AllocationServiceStub(channel, timeout=20, metadata={"x-lattice-user": "tester"})
        spec = v1.AllocationSpec(
            entrypoint="echo flat cost",
            tenant=world.cluster.cluster.tenant,
            vcluster=world.cluster.cluster.vclusters[0],
            nodes=1,
            walltime_seconds=300,
            env=ENV,
            tags=TAGS,
        )
        return await stub.submit(v1.SubmitRequest(allocation=spec, ids_only=ids_only))
    finally:
        channel.close()


@when(
    "the user submits a job with environment variables and tags over gRPC",
    target_fixture="answer",
)
def submit_over_grpc(world: World) -> v1.SubmitResponse:
    answer = asyncio.run(_submit_over_grpc(world))
    world.cluster.wait_state(answer.allocation_ids[0], ("Completed",), timeout=60)
    return answer


@when(
    "the user submits a job with environment variables and tags over gRPC, asking for the "
    "ids alone",
    target_fixture="answer",
)
def submit_ids_only(world: World) -> v1.SubmitResponse:
    answer = asyncio.run(_submit_over_grpc(world, ids_only=True))
    world.cluster.wait_state(answer.allocation_ids[0], ("Completed",), timeout=60)
    return answer


@then("the answer carries the allocation's id and no allocation")
def answer_ids_only(answer: v1.SubmitResponse) -> None:
    assert len(answer.allocation_ids) == 1 and answer.allocation_ids[0]
    assert answer.allocations == []


@then("the answer carries the allocation's id, entrypoint, environment and tags")
def answer_carries(answer: v1.SubmitResponse) -> None:
    assert len(answer.allocation_ids) == 1 and len(answer.allocations) == 1
    a = answer.allocations[0]
    assert a.id == answer.allocation_ids[0]
    assert a.spec is not None
    assert (a.spec.entrypoint, a.spec.env, a.spec.tags) == ("echo flat cost", ENV, TAGS)
    assert a.state == "Pending" and a.submitted_at > 0


@then("lattice status of that allocation shows the same entrypoint, environment and tags")
def status_shows(world: World, answer: v1.SubmitResponse) -> None:
    r = world.cli("status", answer.allocation_ids[0], "-o", "json")
    shown: dict[str, Any] = json.loads(r.stdout)
    spec = shown["spec"]
    assert (spec["entrypoint"], spec["env"], spec["tags"]) == ("echo flat cost", ENV, TAGS)
