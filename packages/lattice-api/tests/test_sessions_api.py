"""Interactive sessions over REST and gRPC: create (an allocation with a holding
entrypoint and a default walltime), read, list, end; only the owner (or an admin)."""

from __future__ import annotations

from typing import Any

from lattice_api.auth import Role
from lattice_common.proto.lattice import v1
from lattice_common.types import AllocationState
from served_api import Grpc, bearer, grpc_error

ALICE, BOB = bearer("alice"), bearer("bob")
WHERE = {"tenant": "physics", "vcluster": "batch"}


async def test_session_lifecycle_over_rest(served: Any) -> None:
    api, _w, rest, _ = served
    status, s = await rest.call("POST", "/api/v1/sessions", ALICE, {**WHERE, "nodes": 1})
    assert status == 201, s
    a = api.quorum.state.allocations[s["allocation_id"]]
    assert a.spec.entrypoint == "sleep infinity" and a.spec.walltime_seconds == 4 * 3600
    assert s["state"] == "Pending" and s["user"] == "alice"
    status, got = await rest.call("GET", f"/api/v1/sessions/{s['id']}", ALICE)
    assert status == 200 and got["allocation_id"] == s["allocation_id"]
    status, err = await rest.call("GET", f"/api/v1/sessions/{s['id']}", BOB)
    assert status == 403 and "belongs to alice" in err["error"]["message"]
    status, listed = await rest.call("GET", "/api/v1/sessions", ALICE)
    assert [x["id"] for x in listed["sessions"]] == [s["id"]]
    status, _ = await rest.call("GET", "/api/v1/sessions", BOB)
    assert status == 200 and _["sessions"] == []
    status, err = await rest.call("DELETE", f"/api/v1/sessions/{s['id']}", BOB)
    assert status == 403
    status, ended = await rest.call("DELETE", f"/api/v1/sessions/{s['id']}", ALICE)
    assert status == 200 and ended["state"] == "Cancelled"
    assert api.quorum.state.allocations[s["allocation_id"]].state == AllocationState.CANCELLED
    status, err = await rest.call("DELETE", f"/api/v1/sessions/{s['id']}", ALICE)
    assert status == 409


async def test_session_refusals_store_nothing(served: Any) -> None:
    api, _w, rest, _ = served
    before = len(api.quorum.state.allocations)
    status, err = await rest.call("POST", "/api/v1/sessions", ALICE, {**WHERE, "nodes": 0})
    assert status == 400 and err["error"]["hint"]
    status, err = await rest.call("POST", "/api/v1/sessions", ALICE, {**WHERE, "vcluster": "nope"})
    assert status == 404
    assert len(api.quorum.state.allocations) == before
    status, _ = await rest.call(
        "POST", "/api/v1/sessions", bearer("ro", Role.READ_ONLY), {**WHERE, "nodes": 1}
    )
    assert status == 403


async def test_session_over_grpc(served: Any) -> None:
    _api, _w, _rest, channel = served
    alice = Grpc(channel, ALICE)
    spec = v1.AllocationSpec(tenant="physics", vcluster="batch", nodes=1, walltime="1h")
    s = await alice.alloc.create_session(v1.CreateSessionRequest(spec=spec))
    assert s.user == "alice" and s.state == "Pending"
    got = await alice.alloc.get_session(v1.GetSessionRequest(id=s.id))
    assert got.allocation_id == s.allocation_id
    code, _ = await grpc_error(
        Grpc(channel, BOB).alloc.delete_session(v1.DeleteSessionRequest(id=s.id))
    )
    assert code == "PERMISSION_DENIED"
    ended = await alice.alloc.delete_session(v1.DeleteSessionRequest(id=s.id))
    assert ended.session is not None and ended.session.state == "Cancelled"
