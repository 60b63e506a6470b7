"""Steps for features/services.feature: service allocations with an HTTP liveness probe
and exposed ports, on the module's real local cluster (``lattice_cluster``, 2 nodes).

Each service is a tiny Python HTTP server on a free port whose /healthz answers 500
once the scenario creates its ``unhealthy`` file. It is submitted through the REST API
(the CLI has no probe flags yet); what users see is read with `lattice services`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

import pytest
from lattice_acceptance.world import TIMEOUT, Job, shared_world, show
from lattice_acceptance.world import World as ClusterWorld
from lattice_cli.devcluster import free_port as _free_port
from pytest_bdd import given, parsers, scenarios, then, when

pytestmark = [pytest.mark.cluster]

scenarios("services.feature")

SERVER = """
import http.server, os, sys
port, marker = int(sys.argv[1]), sys.argv[2]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(500 if os.path.exists(marker) else 200)
        self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


@dataclass
class World(ClusterWorld):
    ports: dict[str, int] = field(default_factory=dict)  # service -> its port
    requeues: dict[str, int] = field(default_factory=dict)  # service -> requeues seen


world = shared_world(World)  # the scenarios share the module's cluster


def _listed(world: World) -> dict[str, list[dict]]:  # type: ignore[type-arg]
    r = world.cli("services", "-o", "json")
    return {s["name"]: s["endpoints"] for s in json.loads(r.stdout)}


@given(parsers.parse("a running Lattice cluster with {count:d} nodes for services"))
def running_cluster(world: World, count: int) -> None:
    world.check_nodes(count)


@given(
    parsers.parse(
        'a service "{name}" with an HTTP liveness probe, requeue policy "{policy}" '
        "and max_requeue {limit:d}"
    )
)
def service(world: World, name: str, policy: str, limit: int) -> None:
    d = world.workdir / name
    d.mkdir()
    (d / "serve.py").write_text(SERVER)
    port = _free_port()
    a = world.cluster.submit(
        f"{sys.executable} {d / 'serve.py'} {port} {d / 'unhealthy'}",
        name=name,
        lifecycle="unbounded",
        requeue_policy=policy,
        max_requeue=limit,
        liveness_probe={
            "probe_type": "http",
            "port": port,
            "path": "/healthz",
            "period_secs": 1,
            "initial_delay_secs": 1,
            "failure_threshold": 2,
            "timeout_secs": 1,
        },
        expose=[{"name": name, "port": port, "protocol": "http"}],
    )
    job = Job(name=name, id=a["id"], dir=d, user="tester")
    world.jobs[name] = job
    world.ports[name] = port
    job.first = world.wait_running(job)


@when(parsers.parse('the health endpoint of "{name}" starts answering 500'))
def unhealthy(world: World, name: str) -> None:
    world.requeues[name] = world.get(name)["requeue_count"]
    (world.jobs[name].dir / "unhealthy").touch()


@when(parsers.parse('"{name}" is cancelled'))
def cancel(world: World, name: str) -> None:
    world.cli("cancel", world.jobs[name].id)
    world.cluster.wait_state(world.jobs[name].id, "Cancelled", timeout=TIMEOUT)


@then(parsers.parse('"{name}" is requeued with the reason "{reason}" and runs again'))
def requeued(world: World, name: str, reason: str) -> None:
    c, job = world.cluster, world.jobs[name]
    before = world.requeues[name]
    seen = c.wait_for(
        f"{name} requeued",
        lambda: (a := c.get(job.id))["requeue_count"] > before and a,
        timeout=TIMEOUT,
        interval=0.02,
    )
    (job.dir / "unhealthy").unlink()  # the next run is healthy
    if seen["state"] == "Pending":  # placing it again clears the reason
        assert seen["reason"] == reason, seen
    world.wait_running(job)


@then(parsers.parse('"{name}" ends Failed with the reason "{reason}"'))
def ends_failed(world: World, name: str, reason: str) -> None:
    a = world.cluster.wait_state(world.jobs[name].id, "Failed", timeout=TIMEOUT)
    assert a["reason"] == reason, a
    r = world.cli("status", world.jobs[name].id, "-o", "json")
    assert json.loads(r.stdout)["state"] == "Failed", show(r)


def _expect_endpoint(world: World, name: str, endpoints: list[dict]) -> None:  # type: ignore[type-arg]
    a = world.get(name)
    assert a["state"] == "Running", a
    assert [(e["allocation_id"], e["node_id"], e["port"]) for e in endpoints] == [
        (a["id"], a["assigned_nodes"][0], world.ports[name])
    ], endpoints


@then(parsers.parse('`lattice services` lists "{name}" at its node and port'))
def lists(world: World, name: str) -> None:
    listed = world.cluster.wait_for(
        f"{name} registered", lambda: _listed(world).get(name), timeout=TIMEOUT
    )
    _expect_endpoint(world, name, listed)


@then(parsers.parse("`lattice services {name}` shows it on the node it runs on now"))
def shows(world: World, name: str) -> None:
    r = world.cluster.wait_for(
        f"{name} registered",
        lambda: (r := world.cli("services", name, "-o", "json", ok=False)).returncode == 0 and r,
        timeout=TIMEOUT,
    )
    _expect_endpoint(world, name, json.loads(r.stdout)["endpoints"])
    table = world.cli("services", name).stdout
    assert f":{world.ports[name]}" in table and world.jobs[name].id in table, table


@then(parsers.parse('`lattice services` does not list "{name}"'))
def not_listed(world: World, name: str) -> None:
    assert name not in _listed(world)
    r = world.cli("services", name, ok=False)
    assert r.returncode == 1 and "no service" in r.stderr, show(r)
