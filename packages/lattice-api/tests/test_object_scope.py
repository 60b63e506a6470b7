"""Object scope over the whole contract: every RPC of AllocationService whose request
names an allocation, and every REST route under /api/v1/allocations/{id}, is walked
with another user's allocation id. The answer is always the one an unknown id gets
(NOT_FOUND / 404; PERMISSION_DENIED / 403 where the role lacks the permission), never
the allocation, so ids cannot be guessed. A new RPC or route that takes an allocation
id is walked without being listed here."""

from __future__ import annotations

from typing import Any

import grpclib
import pytest
from grpclib.const import Cardinality, Status
from lattice_api.permissions import NOT_BUILT, ROUTES, RPCS
from lattice_common.proto.lattice import v1
from served_api import bearer

pytestmark = pytest.mark.timeout(120)

#: how the request of each RPC names its allocation
ID_FIELDS = ("allocation_id", "id")
#: answers that reveal nothing about the allocation
HIDDEN = {Status.NOT_FOUND, Status.PERMISSION_DENIED}


def allocation_rpcs() -> list[tuple[str, str, Any, str]]:
    """(name, path, handler, id field) for every built AllocationService RPC whose
    request (unary or server-streaming) names an allocation."""
    out = []
    base = v1.AllocationServiceBase
    for path, handler in base.__mapping__(base()).items():
        name = f"AllocationService.{path.rsplit('/', 1)[1]}"
        if RPCS.get(name) == NOT_BUILT or handler.cardinality not in (
            Cardinality.UNARY_UNARY,
            Cardinality.UNARY_STREAM,
        ):
            continue  # Attach (a bidirectional stream) has its own test in test_attach_api
        fields = {f.name for f in handler.request_type.__dataclass_fields__.values()}
        field = next((f for f in ID_FIELDS if f in fields), None)
        if field and "dag" not in name.lower() and "session" not in name.lower():
            out.append((name, path, handler, field))
    return out


async def _call(channel: Any, path: str, handler: Any, request: Any, who: dict[str, str]) -> Any:
    async with channel.request(
        path,
        handler.cardinality,
        handler.request_type,
        handler.reply_type,
        metadata=who,
        timeout=5,
    ) as stream:
        await stream.send_message(request, end=True)
        return await stream.recv_message()


async def test_every_allocation_rpc_hides_another_users_allocation(served: Any) -> None:
    _api, world, _rest, channel = served
    eve, bob = bearer("eve"), bearer("bob")
    walked = []
    for name, path, handler, field in allocation_rpcs():
        request = handler.request_type(**{field: world.bob_running})
        with pytest.raises(grpclib.GRPCError) as e:
            await _call(channel, path, handler, request, eve)
        assert e.value.status in HIDDEN, (name, e.value.status, e.value.message)
        # the same error as an id that does not exist
        unknown = handler.request_type(**{field: "ffffffff"})
        with pytest.raises(grpclib.GRPCError) as u:
            await _call(channel, path, handler, unknown, eve)
        assert u.value.status == e.value.status, name
        walked.append(name)
    # the owner gets past the scope check on the read RPCs
    got = await _call(
        channel,
        "/lattice.v1.AllocationService/Get",
        v1.AllocationServiceBase.__mapping__(v1.AllocationServiceBase())[
            "/lattice.v1.AllocationService/Get"
        ],
        v1.GetAllocationRequest(id=world.bob_running),
        bob,
    )
    assert got.id == world.bob_running
    assert {
        "AllocationService.Get",
        "AllocationService.Cancel",
        "AllocationService.GetLogs",
    } <= set(walked), walked
    assert len(walked) >= 6, walked


async def test_every_allocation_route_hides_another_users_allocation(served: Any) -> None:
    _api, world, rest, _channel = served
    eve = bearer("eve")
    walked = []
    for key in ROUTES:
        method, path = key.split(" ", 1)
        if not path.startswith("/api/v1/allocations/{id}") or method == "HEAD":
            continue
        if path.endswith("/attach"):
            continue  # a WebSocket upgrade: test_attach_api
        concrete = path.replace("{id}", world.bob_running).replace("{task_id}", "t0")
        body = None if method in ("GET", "DELETE") else {}
        status, answer = await rest.call(method, concrete, eve, body)
        assert status in (404, 403), (key, status, answer)
        unknown = path.replace("{id}", "ffffffff").replace("{task_id}", "t0")
        status2, _ = await rest.call(method, unknown, eve, body)
        assert status2 == status, (key, status, status2)
        walked.append(key)
    assert len(walked) >= 5, walked
