"""Steps for features/observability.feature: `lattice top` on a real cluster with a
real VictoriaMetrics (the dev cluster starts it, tsdb=True) and 2-second windows."""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from lattice_acceptance.world import World, show
from lattice_test_harness.cluster import ClusterHandle
from lattice_test_harness.victoria import available
from pytest_bdd import given, parsers, scenarios, then, when

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(not available(), reason="victoria-metrics is not installed"),
]

scenarios("observability.feature")

WINDOW = 2.0


@pytest.fixture
def world(cluster_factory: Callable[..., ClusterHandle], tmp_path: Path) -> Iterator[World]:
    env = {"LATTICE_TELEMETRY__AGGREGATION_WINDOW_SECONDS": str(WINDOW)}
    w = World(make=functools.partial(cluster_factory, tsdb=True, env=env), workdir=tmp_path)
    yield w
    w.clean_up()


@given(parsers.parse("a Lattice cluster with {count:d} nodes and a metrics database"))
def cluster(world: World, count: int) -> None:
    world.start_cluster(count)


@when("the user submits a job that keeps one core busy for a while")
def busy_job(world: World) -> None:
    world.current = world.submit(
        "burn", "timeout 60 sh -c 'while :; do :; done' || true", directives=("--walltime=5m",)
    )


@when("the job is running")
def running(world: World) -> None:
    a = world.wait_running(world.current)
    world.node = a["assigned_nodes"][0]


@then(
    parsers.parse(
        "within two aggregation windows lattice top shows its CPU utilization above {pct:d} %"
    )
)
def top_shows_cpu(world: World, pct: int) -> None:
    job = world.current
    # two windows, plus the agent's first collection (a baseline without rates), its push
    # and start-up: generous, as the suite shares the machine's two cores with this job
    deadline = time.monotonic() + 2 * WINDOW + 20
    seen = ""
    while time.monotonic() < deadline:
        r = world.cli("top", job.id)
        seen = r.stdout
        m = re.search(r"^cpu_utilization\s+([\d.]+)\s+%", r.stdout, re.MULTILINE)
        if m and float(m.group(1)) > pct:
            return
        time.sleep(0.5)
    raise AssertionError(f"lattice top {job.id} never showed cpu_utilization > {pct} %:\n{seen}")


@then("lattice top --per-node shows one row for the node that runs it")
def per_node(world: World) -> None:
    r = world.cli("top", world.current.id, "--per-node")
    rows = [line for line in r.stdout.splitlines() if line.startswith(world.node)]
    assert len(rows) == 1, show(r)


@then("lattice top -o json names the allocation and the node that reported")
def as_json(world: World) -> None:
    r = world.cli("top", world.current.id, "-o", "json")
    snap = json.loads(r.stdout)
    assert snap["allocation_id"] == world.current.id, show(r)
    assert snap["node_ids"] == [world.node], show(r)
    cpu = [s for s in snap["samples"] if s["name"] == "cpu_utilization"]
    assert cpu and cpu[0]["value"] > 50, show(r)


@when("the user submits a job that waits for another job to finish")
def pending_job(world: World) -> None:
    first = world.submit("first", "", directives=("--walltime=5m",), until_released=True)
    r = world.cli("submit", "--walltime=5m", f"--dependency=afterok:{first.id}", "--", "true")
    m = re.fullmatch(r"Submitted allocation (\S+)\n?", r.stdout)
    assert m, show(r)
    world.waiting_id = m.group(1)


@then("lattice top of the waiting job says there are no metrics for it yet")
def no_metrics(world: World) -> None:
    r = world.cli("top", world.waiting_id)
    assert "no metrics" in r.stdout.lower(), show(r)
    assert world.waiting_id in r.stdout, show(r)
