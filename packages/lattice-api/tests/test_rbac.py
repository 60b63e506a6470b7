"""RBAC through the table: for every RPC and REST route with a permission, each role
that does not hold it gets PermissionDenied (gRPC) / 403 (REST) naming the permission,
before any handler runs; public routes answer without an identity."""

from __future__ import annotations

import re
from typing import Any

import grpclib
import pytest
from grpclib.const import Status
from lattice_api.auth import CERT_ROLES, Role
from lattice_api.permissions import NOT_BUILT, PUBLIC, ROLES, ROUTES, RPCS
from lattice_common.proto.lattice import v1
from served_api import bearer, token

pytestmark = pytest.mark.timeout(120)

SERVED = (v1.AllocationServiceBase, v1.NodeServiceBase, v1.AdminServiceBase, v1.QuorumServiceBase)


SAMPLE = {"section": "network"}  # path parameters restricted to some values


def denied_roles(permission: str) -> list[Role]:
    # roles only a client certificate gives: test_mtls.py walks the contract for them
    return [r for r in Role if r not in ROLES[permission] and r not in CERT_ROLES]


def checked_rpcs() -> list[tuple[str, Any]]:
    """(``Service.Rpc``, its grpclib handler) for every RPC the table checks."""
    out = []
    for base in SERVED:
        service = base.__name__.removesuffix("Base")
        for path, handler in base.__mapping__(base()).items():
            name = f"{service}.{path.rsplit('/', 1)[1]}"
            if RPCS[name] not in (NOT_BUILT, PUBLIC) and denied_roles(RPCS[name]):
                out.append((name, path, handler))
    return out


async def test_denied_roles_get_permission_denied_over_grpc(served: Any) -> None:
    _api, _w, _rest, channel = served
    seen = 0
    for name, path, handler in checked_rpcs():
        permission = RPCS[name]
        for role in denied_roles(permission):
            metadata = {"authorization": f"Bearer {token('eve', role)}"}
            request = handler.request_type()
            with pytest.raises(grpclib.GRPCError) as e:
                async with channel.request(
                    path,
                    handler.cardinality,
                    handler.request_type,
                    handler.reply_type,
                    metadata=metadata,
                    timeout=5,
                ) as stream:
                    await stream.send_message(request, end=True)
                    await stream.recv_message()
            assert e.value.status == Status.PERMISSION_DENIED, (name, role)
            assert permission in (e.value.message or ""), (name, role)
            seen += 1
    assert seen > 20


async def test_denied_roles_get_403_over_rest(served: Any) -> None:
    _api, _w, rest, _channel = served
    seen = 0
    for key, permission in ROUTES.items():
        if permission == PUBLIC:
            continue
        method, path = key.split(" ", 1)
        path = path.replace("{id}", "n1").replace("{name}", "physics")
        # any other path parameter, with a value its route accepts
        path = re.sub(r"\{([a-z_]+)\}", lambda m: SAMPLE.get(m[1], "x1"), path)
        for role in denied_roles(permission):
            status, body = await rest.call(
                method, path, bearer("eve", role), {} if method != "GET" else None
            )
            assert status == 403, (key, role, body)
            assert body["error"]["code"] == "permission_denied"
            assert permission in body["error"]["message"] and body["error"]["hint"]
            seen += 1
    assert seen > 30


async def test_public_routes_answer_without_identity(served: Any) -> None:
    _api, _w, rest, _channel = served
    for key, permission in ROUTES.items():
        if permission == PUBLIC:
            method, path = key.split(" ", 1)
            async with rest.session.request(method, rest.url + path) as r:
                assert r.status == 200, key


async def test_allowed_roles_pass_the_table(served: Any) -> None:
    """A role holding the permission is not stopped by the table (the operation may
    still refuse on its own terms, e.g. not found)."""
    _api, _w, rest, _channel = served
    for role in (Role.READ_ONLY, Role.USER, Role.OPERATOR):
        status, _ = await rest.call("GET", "/api/v1/nodes", bearer("eve", role))
        assert status == 200
    status, _ = await rest.call("POST", "/api/v1/nodes/n3/drain", bearer("op", Role.OPERATOR))
    assert status == 200
    status, body = await rest.call(
        "POST", "/api/v1/nodes/n3/release", bearer("cu", Role.CLAIMING_USER)
    )
    assert status != 403 or "node.release" not in body["error"]["message"]
