"""The permission table covers exactly what lattice-server serves.

Every RPC of the generated service bases served (Allocation, Node, Admin, Quorum,
Accounting) and
every route of the REST router has one entry; no entry names an RPC or a route that
does not exist; every permission named has roles; and an RPC is marked NOT_BUILT
exactly when its adapter does not implement it.
"""

from __future__ import annotations

import pytest
from lattice_api.auth import Authenticator, Identity, Role
from lattice_api.grpc.server import ADAPTERS
from lattice_api.node_monitor import NodeMonitor
from lattice_api.operations import Operations
from lattice_api.permissions import (
    NOT_BUILT,
    PUBLIC,
    ROLES,
    ROUTE_PERMISSIONS,
    ROUTES,
    RPC_BY_PATH,
    RPCS,
    allowed,
    authorize,
)
from lattice_api.rest.app import build_rest_app
from lattice_common.errors import PermissionDenied
from lattice_common.proto.lattice import v1
from lattice_quorum.local import LocalQuorum
from lattice_test_harness.local_api import MemoryLogs

SERVED = (
    v1.AllocationServiceBase,
    v1.NodeServiceBase,
    v1.AdminServiceBase,
    v1.QuorumServiceBase,
    v1.AccountingServiceBase,
)


def served_rpcs() -> dict[str, str]:
    """``"Service.Rpc"`` -> the Python method name, from the generated mappings."""
    out = {}
    for base in SERVED:
        service = base.__name__.removesuffix("Base")
        for path, handler in base.__mapping__(base()).items():
            rpc = path.rsplit("/", 1)[1]
            out[f"{service}.{rpc}"] = handler.func.__name__.removeprefix("__rpc_")
    return out


def router_routes() -> set[str]:
    q = LocalQuorum()
    ops = Operations(q, monitor=NodeMonitor(q), logs=MemoryLogs())
    app = build_rest_app(ops, Authenticator())
    return {f"{r.method} {r.resource.canonical}" for r in app.router.routes() if r.resource}


def test_every_served_rpc_has_an_entry_and_every_entry_an_rpc() -> None:
    rpcs = set(served_rpcs())
    assert rpcs - set(RPCS) == set(), "RPCs without a permission-table entry"
    assert set(RPCS) - rpcs == set(), "table entries naming no served RPC"
    assert set(RPC_BY_PATH) == {"/lattice.v1." + k.replace(".", "/") for k in RPCS}


def test_every_route_has_an_entry_and_every_entry_a_route() -> None:
    routes = router_routes()
    assert routes - set(ROUTE_PERMISSIONS) == set(), "routes without a permission-table entry"
    assert set(ROUTE_PERMISSIONS) - routes == set(), "table entries naming no route"
    assert {k for k in ROUTES if k.startswith("GET ")} <= routes


def test_every_permission_named_has_roles() -> None:
    named = set(RPCS.values()) | set(ROUTES.values())
    assert named - set(ROLES) - {PUBLIC, NOT_BUILT} == set()
    assert {PUBLIC} == {p for p in named if p == PUBLIC}
    assert {k for k, p in ROUTES.items() if p == PUBLIC} == {
        "GET /healthz",
        "GET /metrics",
        "GET /api/v1/auth/discovery",
    }


def test_not_built_exactly_when_the_adapter_lacks_the_rpc() -> None:
    by_service = {a.__bases__[0].__name__.removesuffix("Base"): a for a in ADAPTERS}
    assert set(by_service) == {b.__name__.removesuffix("Base") for b in SERVED}
    for name, attr in served_rpcs().items():
        adapter = by_service[name.split(".")[0]]
        stub = getattr(getattr(adapter, attr), "not_built", False)
        assert stub == (RPCS[name] == NOT_BUILT), name


def test_one_route_per_node_action_with_its_own_permission() -> None:
    assert ROUTES["POST /api/v1/nodes/{id}/release"] == "node.release"
    for action in ("drain", "undrain", "disable", "enable"):
        assert ROUTES[f"POST /api/v1/nodes/{{id}}/{action}"] == "node.admin"


@pytest.mark.parametrize("permission", sorted(ROLES))
def test_authorize_agrees_with_the_roles(permission: str) -> None:
    for role in Role:
        who = Identity("u", role)
        assert allowed(who, permission) == (role in ROLES[permission])
        if role in ROLES[permission]:
            authorize(who, permission)
        else:
            with pytest.raises(PermissionDenied) as e:
                authorize(who, permission)
            assert permission in e.value.message and e.value.hint
