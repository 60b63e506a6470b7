"""Service discovery over REST and gRPC: the registry of running service allocations,
filtered by the caller's tenant (admins and operators see every tenant, or the one they
name); submissions with a liveness probe and exposed ports are validated."""

from __future__ import annotations

import time
from typing import Any

import jwt
import pytest
from lattice_api.auth import Role
from lattice_api.validation import validate_submission
from lattice_common.errors import ValidationError
from lattice_common.proto.lattice import v1
from lattice_common.types import (
    AllocationSpec,
    AllocationState,
    ExposedPort,
    LifecycleType,
    LivenessProbeSpec,
)
from served_api import ROLE_CLAIMS, SECRET, Grpc, bearer, grpc_error

ADMIN = bearer("root", Role.SYSTEM_ADMIN)


def member(user: str, tenant: str, role: Role = Role.USER) -> dict[str, str]:
    claims = {"sub": user, "exp": int(time.time()) + 600, "tenant": tenant, **ROLE_CLAIMS[role]}
    return {"authorization": "Bearer " + jwt.encode(claims, SECRET, algorithm="HS256")}


def _service(api: Any, tenant: str, node: str, name: str = "api", port: int = 8080) -> str:
    spec = AllocationSpec(
        entrypoint="python serve.py",
        tenant=tenant,
        vcluster="batch",
        user="carol",
        lifecycle=LifecycleType.UNBOUNDED,
        expose=[ExposedPort(name=name, port=port, protocol="http")],
        liveness_probe=LivenessProbeSpec(probe_type="http", port=port, path="/healthz"),
    )
    aid = api.submit(spec, now=time.time()).id
    api.start(aid, [node], now=time.time())
    return aid


async def test_rest_lists_and_looks_up_by_tenant(served: Any) -> None:
    api, _w, rest, _ = served
    a_phys = _service(api, "physics", "n2")
    a_bio = _service(api, "bio", "n3")
    status, all_ = await rest.call("GET", "/api/v1/services", ADMIN)
    assert status == 200 and all_["names"] == ["api"]
    eps = all_["services"][0]["endpoints"]
    assert {(e["allocation_id"], e["node_id"], e["port"]) for e in eps} == {
        (a_phys, "n2", 8080),
        (a_bio, "n3", 8080),
    }
    status, only = await rest.call("GET", "/api/v1/services", ADMIN, tenant="bio")
    assert [e["allocation_id"] for e in only["services"][0]["endpoints"]] == [a_bio]
    phys = member("dave", "physics")
    status, mine = await rest.call("GET", "/api/v1/services/api", phys)
    assert status == 200 and [e["allocation_id"] for e in mine["endpoints"]] == [a_phys]
    assert mine["endpoints"][0]["tenant"] == "physics"
    status, err = await rest.call("GET", "/api/v1/services", phys, tenant="bio")
    assert status == 403 and "bio" in err["error"]["message"]
    status, err = await rest.call("GET", "/api/v1/services", bearer("notenant"))
    assert status == 403
    status, err = await rest.call("GET", "/api/v1/services/nope", ADMIN)
    assert status == 404 and "lattice services" in err["error"]["hint"]
    # the allocation ends: its endpoints go
    api.set_state(a_phys, AllocationState.FAILED, now=time.time())
    status, mine = await rest.call("GET", "/api/v1/services/api", phys)
    assert status == 404
    status, err = await rest.call("GET", "/api/v1/services", bearer("x", Role.AGENT))
    assert status == 403  # agents have no business here


async def test_grpc_lookup_and_list_follow_the_tenant(served: Any) -> None:
    api, _w, _rest, channel = served
    a_phys = _service(api, "physics", "n2")
    _service(api, "bio", "n3", name="db", port=5432)
    admin = Grpc(channel, ADMIN)
    names = await admin.admin.list_services(v1.ListServicesRequest())
    assert names.names == ["api", "db"]
    phys = Grpc(channel, member("dave", "physics"))
    assert (await phys.admin.list_services(v1.ListServicesRequest())).names == ["api"]
    got = await phys.admin.lookup_service(v1.LookupServiceRequest(name="api"))
    assert got.name == "api" and [(e.allocation_id, e.node_id, e.port) for e in got.endpoints] == [
        (a_phys, "n2", 8080)
    ]
    code, _ = await grpc_error(phys.admin.lookup_service(v1.LookupServiceRequest(name="db")))
    assert code == "NOT_FOUND"
    ro = Grpc(channel, member("ro", "bio", Role.READ_ONLY))
    assert (await ro.admin.list_services(v1.ListServicesRequest())).names == ["db"]


async def test_submit_carries_probe_and_expose_over_grpc(served: Any) -> None:
    api, _w, _rest, channel = served
    alice = Grpc(channel, bearer("alice"))
    res = await alice.alloc.submit(
        v1.SubmitRequest(
            allocation=v1.AllocationSpec(
                entrypoint="python serve.py",
                tenant="physics",
                vcluster="batch",
                lifecycle="unbounded",
                liveness_probe=v1.LivenessProbeSpec(probe_type="http", port=8080, path="/h"),
                expose=[v1.ExposedPort(name="api", port=8080)],
            )
        )
    )
    a = api.quorum.state.allocations[res.allocation_ids[0]]
    assert a.spec.liveness_probe == LivenessProbeSpec(probe_type="http", port=8080, path="/h")
    assert a.spec.expose == [ExposedPort(name="api", port=8080)]


def _validate(**body: Any) -> AllocationSpec:
    return validate_submission(
        {"entrypoint": "serve", "tenant": "t", "vcluster": "v", "lifecycle": "unbounded", **body},
        user="u",
        tenants={"t"},
        vclusters={"v"},
    )


def test_validation_of_probes_and_exposed_ports() -> None:
    spec = _validate(
        liveness_probe={"probe_type": "tcp", "port": 9000, "initial_delay_secs": 0},
        expose=[8080, "metrics:9090", {"name": "api", "port": 8000, "protocol": "http"}],
    )
    assert spec.liveness_probe == LivenessProbeSpec(
        probe_type="tcp", port=9000, initial_delay_secs=0
    )
    assert [(e.name, e.port) for e in spec.expose] == [
        ("port-8080", 8080),
        ("metrics", 9090),
        ("api", 8000),
    ]
    for bad in (
        {"liveness_probe": {"probe_type": "grpc", "port": 1}},
        {"liveness_probe": {"port": 0}},
        {"liveness_probe": {"port": 80, "period_secs": 0}},
        {"liveness_probe": {"port": 80, "path": "healthz"}},
        {"expose": [{"name": "a b", "port": 80}]},
        {"expose": [70000]},
        {"expose": "8080"},
    ):
        with pytest.raises(ValidationError):
            _validate(**bad)
