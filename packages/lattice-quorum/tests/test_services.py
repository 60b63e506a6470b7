"""The service registry in the quorum: endpoints added when a service allocation runs,
moved when it runs again elsewhere, removed on every end; queries filter by tenant."""

from __future__ import annotations

from lattice_common import commands as c
from lattice_common.types import AllocationState, ExposedPort, RequeuePolicy
from lattice_quorum import queries
from test_state import assign, ok, register, set_state, submit, world

A = AllocationState
API = [ExposedPort(name="api", port=8080, protocol="http")]


def _world():  # type: ignore[no-untyped-def]
    s = world(nodes=0, tenants={"t": {}, "u": {}})
    for i in range(4):
        register(s, f"n{i}", hostname=f"host{i}")
    return s


def _where(s, name: str = "api") -> list[tuple[str, str, str, int]]:  # type: ignore[no-untyped-def]
    return [(e.allocation_id, e.node_id, e.address, e.port) for e in s.services.get(name, [])]


def test_registered_on_running_removed_on_end() -> None:
    s = _world()
    aid = submit(s, expose=API, lifecycle="unbounded", walltime_seconds=0)
    assert s.services == {}
    assign(s, aid, ["n1"])
    assert s.allocations[aid].state == A.RUNNING
    assert _where(s) == [(aid, "n1", "host1", 8080)]
    assert s.services["api"][0].tenant == "t"
    ok(s, c.CancelAllocation(allocation_id=aid, reason="cancelled", now=40.0))
    assert s.services == {}  # the empty name is dropped


def test_failed_end_and_other_services_kept() -> None:
    s = _world()
    a1 = submit(s, expose=API, nodes=2)
    a2 = submit(s, expose=[*API, ExposedPort(name="metrics", port=9090)])
    assign(s, a1, ["n0", "n1"])
    assign(s, a2, ["n2"])
    assert [e[:2] for e in _where(s)] == sorted([(a1, "n0"), (a1, "n1"), (a2, "n2")])
    assert _where(s, "metrics") == [(a2, "n2", "host2", 9090)]
    set_state(s, a1, A.FAILED, reason="liveness_probe_failed")
    assert _where(s) == [(a2, "n2", "host2", 8080)]
    set_state(s, a2, A.COMPLETED)
    assert s.services == {}


def test_requeue_removes_and_the_next_run_moves_it() -> None:
    s = _world()
    aid = submit(s, expose=API, requeue_policy=RequeuePolicy.ALWAYS, max_requeue=1)
    assign(s, aid, ["n0"])
    assert _where(s) == [(aid, "n0", "host0", 8080)]
    set_state(s, aid, A.FAILED, reason="liveness_probe_failed")
    a = s.allocations[aid]
    assert a.state == A.PENDING and a.requeue_count == 1 and a.reason == "liveness_probe_failed"
    assert s.services == {}
    assign(s, aid, ["n3"])
    assert _where(s) == [(aid, "n3", "host3", 8080)]
    set_state(s, aid, A.FAILED, reason="liveness_probe_failed")  # max_requeue reached
    assert s.allocations[aid].state == A.FAILED and s.services == {}


def test_explicit_requeue_and_node_failure_deregister() -> None:
    s = _world()
    aid = submit(s, expose=API)
    assign(s, aid, ["n0"])
    ok(s, c.RequeueAllocation(allocation_id=aid, reason="node_failure", now=50.0))
    assert s.services == {}
    assign(s, aid, ["n1"])
    assert _where(s) == [(aid, "n1", "host1", 8080)]


def test_scale_replaces_endpoints() -> None:
    s = _world()
    aid = submit(s, expose=API, nodes=2, min_nodes=1, lifecycle="reactive", walltime_seconds=0)
    assign(s, aid, ["n0", "n1"])
    ok(s, c.ScaleAllocation(allocation_id=aid, remove_node_ids=["n1"], now=60.0))
    assert _where(s) == [(aid, "n0", "host0", 8080)]


def test_allocations_without_expose_are_not_registered() -> None:
    s = _world()
    aid = submit(s)
    assign(s, aid, ["n0"])
    assert s.services == {}


def test_queries_filter_by_tenant() -> None:
    s = _world()
    a1 = submit(s, expose=API, tenant="t")
    a2 = submit(s, expose=API, tenant="u")
    a3 = submit(s, expose=[ExposedPort(name="db", port=5432)], tenant="u")
    for aid, nid in ((a1, "n0"), (a2, "n1"), (a3, "n2")):
        assign(s, aid, [nid])
    everything = queries.services(s)
    assert sorted(everything) == ["api", "db"] and len(everything["api"]) == 2
    mine = queries.services(s, {"t"})
    assert list(mine) == ["api"] and [e.allocation_id for e in mine["api"]] == [a1]
    assert [e.allocation_id for e in queries.service(s, "api", {"u"})] == [a2]
    assert queries.service(s, "db", {"t"}) == []
    # copies: changing an answer changes nothing stored
    queries.service(s, "api")[0].port = 1
    assert s.services["api"][0].port == 8080
