"""mTLS between components, end to end over the real servers (serve_local_api with
ServerTls): the internal CA (`lattice admin ca init|issue` over REST), a node's
bootstrap -> agent certificate flow over gRPC, the node identity check on every agent
call, the permission table walked for the certificate-only roles (bootstrap, service),
what the gRPC listener refuses at the handshake, expiry on an open connection, and a CA
rotation.

The site's PKI is a CA made with pki.create_ca: it signed the server's certificate
(127.0.0.1) and is trusted for client certificates; the cluster's internal CA is made
through the API and trusted as soon as it exists."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpclib
import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.oid import NameOID
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import StreamTerminatedError
from lattice_api.auth import Role
from lattice_api.permissions import NOT_BUILT, PUBLIC, ROLES, RPCS
from lattice_api.settings import ApiSettings
from lattice_api.tls import ServerTls
from lattice_common import commands as c
from lattice_common import pki
from lattice_common.config import TlsConfig
from lattice_common.proto.lattice import v1
from lattice_test_harness.local_api import LocalApi, serve_local_api
from prometheus_client import REGISTRY
from served_api import AGENT_TOKEN, SECRET, Rest, bearer, grpc_error

pytestmark = pytest.mark.timeout(60)

SITE = "test"
SERVED = (v1.AllocationServiceBase, v1.NodeServiceBase, v1.AdminServiceBase, v1.QuorumServiceBase)
ADMIN = bearer("root", Role.SYSTEM_ADMIN)
USER = bearer("alice", Role.USER)


def load(pem: str | bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem.encode() if isinstance(pem, str) else pem)


def csr_for(kind: pki.Kind, name: str, site: str = SITE) -> tuple[str, bytes]:
    """(CSR PEM, key PEM): the key stays with the caller, as `lattice admin ca issue`."""
    key = pki.generate_key()
    return pki.make_csr(key, kind, name, site).decode(), pki.key_pem(key)


@dataclass
class Served:
    api: LocalApi
    site_ca: tuple[bytes, bytes]
    rest: Rest
    channels: list[Channel] = field(default_factory=list)

    def channel(self, cert: bytes | None = None, key: bytes | None = None) -> Channel:
        """A gRPC channel presenting cert/key (none: no client certificate)."""
        ctx = pki.client_context([self.site_ca[0]], cert, key)
        ch = Channel(self.api.host, self.api.grpc_port, ssl=ctx)
        self.channels.append(ch)
        return ch

    def plaintext_channel(self) -> Channel:
        ch = Channel(self.api.host, self.api.grpc_port)
        self.channels.append(ch)
        return ch

    def site_issue(
        self,
        kind: pki.Kind,
        name: str,
        *,
        site: str = SITE,
        now: float | None = None,
        lifetime: float = 600.0,
    ) -> tuple[bytes, bytes]:
        """A certificate from the site's PKI (trusted by the listener)."""
        t = time.time() if now is None else now
        return pki.issue(*self.site_ca, kind=kind, name=name, site=site, now=t, lifetime=lifetime)

    async def init_ca(self, rotate: bool = False) -> dict[str, Any]:
        status, body = await self.rest.call("POST", "/api/v1/admin/ca", ADMIN, {"rotate": rotate})
        assert status == 200, body
        return body

    async def admin_issue(
        self, kind: pki.Kind, name: str, lifetime: float | None = None
    ) -> tuple[bytes, bytes]:
        """`lattice admin ca issue`: a certificate from the internal CA."""
        csr, key = csr_for(kind, name)
        payload: dict[str, Any] = {"kind": kind.value, "name": name, "csr_pem": csr}
        if lifetime is not None:
            payload["lifetime_seconds"] = lifetime
        status, body = await self.rest.call("POST", "/api/v1/admin/ca/issue", ADMIN, payload)
        assert status == 200, body
        return body["cert_pem"].encode(), key


@pytest.fixture
async def served_tls() -> AsyncIterator[Served]:
    now = time.time()
    site_ca = pki.create_ca(SITE, now=now)
    cert, key = pki.issue(
        *site_ca,
        kind=pki.Kind.API,
        name="api",
        site=SITE,
        now=now,
        lifetime=3600,
        hosts=["127.0.0.1"],
    )
    tls = ServerTls(cert, key, [site_ca[0]], mutual=True)
    async with serve_local_api(
        hmac_secret=SECRET,
        agent_token=AGENT_TOKEN,
        tls=tls,
        settings=ApiSettings(tls=TlsConfig(site=SITE)),
    ) as api:
        rest_ctx = pki.client_context([site_ca[0]], alpn=None)
        connector = aiohttp.TCPConnector(ssl=rest_ctx)
        async with aiohttp.ClientSession(connector=connector) as session:
            served = Served(api, site_ca, Rest(session, f"https://{api.host}:{api.rest_port}"))
            try:
                yield served
            finally:
                for ch in served.channels:
                    ch.close()


def nodes(channel: Channel) -> v1.NodeServiceStub:
    return v1.NodeServiceStub(channel, timeout=5)


def register(node_id: str) -> v1.RegisterNodeRequest:
    return v1.RegisterNodeRequest(node=v1.Node(id=node_id, hostname=f"{node_id}.example"))


async def first_desired_state(stub: v1.NodeServiceStub, node_id: str) -> v1.DesiredState:
    stream = stub.watch_desired_state(v1.WatchDesiredStateRequest(node_id=node_id))
    try:
        async for state in stream:
            return state
    finally:
        await stream.aclose()
    raise AssertionError("the desired-state stream ended without a message")


def mismatches(node: str) -> float:
    return REGISTRY.get_sample_value("lattice_node_identity_mismatch_total", {"node": node}) or 0.0


def grpc_requests(method: str, status: str) -> float:
    labels = {"method": method, "status": status}
    return REGISTRY.get_sample_value("lattice_api_requests_total", labels) or 0.0


# --------------------------------------------------------------------------- the CA


async def test_ca_init_get_and_rotate_over_rest(served_tls: Served) -> None:
    rest = served_tls.rest
    status, body = await rest.call("GET", "/api/v1/admin/ca", USER)
    assert status == 200 and body["cert_pem"] == "" and body["site"] == SITE

    status, body = await rest.call("POST", "/api/v1/admin/ca", USER, {})
    assert status == 403, body
    assert "pki.admin" in body["error"]["message"]
    status, body = await rest.call("POST", "/api/v1/admin/ca", bearer("op", Role.OPERATOR), {})
    assert status == 403

    first = await served_tls.init_ca()
    ca_cert = load(first["cert_pem"])
    cn = ca_cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    assert cn == pki.ca_name(SITE)
    assert ca_cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert first["previous_pem"] == []
    assert first["serial"] == pki.serial_of(first["cert_pem"].encode())

    status, body = await rest.call("POST", "/api/v1/admin/ca", ADMIN, {})
    assert status == 409, body
    assert body["error"]["code"] == "already_exists"
    assert "--rotate" in body["error"]["hint"]

    rotated = await served_tls.init_ca(rotate=True)
    assert rotated["cert_pem"] != first["cert_pem"]
    assert rotated["previous_pem"] == [first["cert_pem"]]

    # anyone authenticated reads it (a token of any role, or a client certificate)
    for who in (USER, bearer("ro", Role.READ_ONLY), {"authorization": f"Bearer {AGENT_TOKEN}"}):
        status, body = await rest.call("GET", "/api/v1/admin/ca", who)
        assert status == 200 and body["cert_pem"] == rotated["cert_pem"], who
        assert body["previous_pem"] == [first["cert_pem"]]
    status, body = await rest.call("GET", "/api/v1/admin/ca", {})
    assert status == 401
    # over gRPC with a bootstrap certificate of the site's PKI
    ch = served_tls.channel(*served_tls.site_issue(pki.Kind.BOOTSTRAP, "node-009"))
    got = await v1.AdminServiceStub(ch, timeout=5).get_certificate_authority(
        v1.GetCertificateAuthorityRequest()
    )
    assert got.cert_pem == rotated["cert_pem"]

    status, body = await rest.call("GET", "/api/v1/admin/audit", ADMIN, action="ca.init")
    assert status == 200
    assert [e["details"]["rotate"] for e in body["entries"]] == ["false", "true"]


# --------------------------------------------------------------------------- bootstrap


async def test_bootstrap_certificate_gets_the_agent_certificate_of_its_node_only(
    served_tls: Served,
) -> None:
    ca = await served_tls.init_ca()
    rest = served_tls.rest

    # a bootstrap certificate lives an hour at most
    csr, _key = csr_for(pki.Kind.BOOTSTRAP, "node-001")
    status, body = await rest.call(
        "POST",
        "/api/v1/admin/ca/issue",
        ADMIN,
        {"kind": "bootstrap", "name": "node-001", "csr_pem": csr, "lifetime_seconds": 7200},
    )
    assert status == 400, body
    assert "bootstrap" in body["error"]["message"]
    status, body = await rest.call(
        "POST",
        "/api/v1/admin/ca/issue",
        USER,
        {"kind": "bootstrap", "name": "node-001", "csr_pem": csr},
    )
    assert status == 403
    boot_cert, boot_key = await served_tls.admin_issue(pki.Kind.BOOTSTRAP, "node-001")
    start, end = pki.validity(boot_cert)
    assert end - start <= pki.BOOTSTRAP_MAX_LIFETIME + 60  # backdated a minute

    ch = served_tls.channel(boot_cert, boot_key)
    stub = nodes(ch)
    agent_csr, agent_key = csr_for(pki.Kind.AGENT, "node-001")
    issued = await stub.sign_node_certificate(
        v1.SignNodeCertificateRequest(node_id="node-001", csr_pem=agent_csr)
    )
    leaf = load(issued.cert_pem)
    leaf.verify_directly_issued_by(load(ca["cert_pem"]))
    assert "OU=agent" in leaf.subject.rfc4514_string()
    assert f"CN=node-001.{SITE}.lattice.internal" in leaf.subject.rfc4514_string()
    assert ca["cert_pem"] in issued.ca_pem
    assert issued.serial == pki.serial_of(issued.cert_pem.encode())
    # the agent certificate it got is one the listener takes
    agent = served_tls.channel(issued.cert_pem.encode(), agent_key)
    await nodes(agent).register_node(register("node-001"))

    # node-001's bootstrap certificate asking for node-002's
    before = mismatches("node-001")
    other_csr, _ = csr_for(pki.Kind.AGENT, "node-002")
    status, err = await grpc_error(
        stub.sign_node_certificate(
            v1.SignNodeCertificateRequest(node_id="node-002", csr_pem=other_csr)
        )
    )
    assert status == "UNAUTHENTICATED", err
    assert "node-001" in err["message"] and "node-002" in err["message"]
    assert mismatches("node-001") == before + 1
    status, body = await rest.call(
        "GET", "/api/v1/admin/audit", ADMIN, action="node.identity_mismatch"
    )
    assert status == 200
    [entry] = body["entries"]
    assert entry["actor"] == "bootstrap:node-001" and entry["target"] == "node:node-002"
    assert entry["details"]["certificate_node"] == "node-001"
    assert int(entry["details"]["serial"], 16) == load(boot_cert).serial_number

    # and it can do nothing else
    for call, permission in (
        (stub.register_node(register("node-001")), "node.agent"),
        (stub.heartbeat(v1.HeartbeatRequest(node_id="node-001", sequence=1)), "node.agent"),
        (stub.list_nodes(v1.ListNodesRequest()), "node.read"),
        (stub.get_node(v1.GetNodeRequest(id="node-001")), "node.read"),
    ):
        status, err = await grpc_error(call)
        assert status == "PERMISSION_DENIED" and permission in err["message"], err
        assert "bootstrap:node-001" in err["message"]


# --------------------------------------------------------------------------- agents


async def test_agent_certificate_acts_for_its_own_node_only(served_tls: Served) -> None:
    await served_tls.init_ca()
    cert, key = await served_tls.admin_issue(pki.Kind.AGENT, "node-001")
    stub = nodes(served_tls.channel(cert, key))

    got = await stub.register_node(register("node-001"))
    assert got.node is not None and got.node.id == "node-001"
    hb = await stub.heartbeat(v1.HeartbeatRequest(node_id="node-001", sequence=1))
    assert not hb.reregister
    status, body = await served_tls.rest.call("GET", "/api/v1/nodes/node-001", ADMIN)
    assert status == 200
    assert body["agent_identity"].startswith("quorum-ca"), body["agent_identity"]
    # the peer's serial as getpeercert() spells it (a leading 0 at times: see test_pki)
    serial = f"{load(cert).serial_number:X}"
    assert serial[:8] in body["agent_identity"] or f"0{serial}"[:8] in body["agent_identity"]
    # its desired state streams
    first = await asyncio.wait_for(first_desired_state(stub, "node-001"), 5)
    assert first.node_id == "node-001"

    before = mismatches("node-001")
    for call in (
        stub.heartbeat(v1.HeartbeatRequest(node_id="node-002", sequence=1)),
        stub.register_node(register("node-002")),
    ):
        status, err = await grpc_error(call)
        assert status == "UNAUTHENTICATED", err
        assert "node-001" in err["message"] and "node-002" in err["message"]
    with pytest.raises(grpclib.GRPCError) as e:
        await asyncio.wait_for(first_desired_state(stub, "node-002"), 5)
    assert e.value.status == Status.UNAUTHENTICATED
    message = json.loads(e.value.message or "{}")["message"]
    assert "node-001" in message and "node-002" in message
    assert mismatches("node-001") == before + 3
    # node-002 was neither registered nor bound to node-001's certificate
    status, _ = await served_tls.rest.call("GET", "/api/v1/nodes/node-002", ADMIN)
    assert status == 404
    # an agent certificate proposes nothing, not even a scheduling decision
    quorum = v1.QuorumServiceStub(served_tls.channel(cert, key), timeout=10)
    assign = c.AssignNodes(allocation_id="x", node_ids=["node-001"], now=1.0)
    status, err = await grpc_error(
        quorum.propose(v1.ProposeRequest(command=c.encode_command(assign)))
    )
    assert status == "PERMISSION_DENIED" and "may not propose" in err["message"]


async def test_certificate_of_another_site_is_unauthenticated(served_tls: Served) -> None:
    cert, key = served_tls.site_issue(pki.Kind.AGENT, "node-001", site="other")
    stub = nodes(served_tls.channel(cert, key))
    status, err = await grpc_error(stub.list_nodes(v1.ListNodesRequest()))
    assert status == "UNAUTHENTICATED", err
    assert "'other'" in err["message"] and f"'{SITE}'" in err["message"]
    status, err = await grpc_error(stub.register_node(register("node-001")))
    assert status == "UNAUTHENTICATED"
    # the same name for this site passes
    ok = nodes(served_tls.channel(*served_tls.site_issue(pki.Kind.AGENT, "node-001")))
    await ok.list_nodes(v1.ListNodesRequest())


# --------------------------------------------------------------------------- the table


def checked_rpcs(role: Role) -> list[tuple[str, str, Any]]:
    """(``Service.Rpc``, path, grpclib handler) of every served RPC whose permission
    ``role`` lacks (new RPCs join automatically)."""
    out = []
    for base in SERVED:
        service = base.__name__.removesuffix("Base")
        for path, handler in base.__mapping__(base()).items():
            name = f"{service}.{path.rsplit('/', 1)[1]}"
            permission = RPCS[name]
            if permission not in (NOT_BUILT, PUBLIC) and role not in ROLES[permission]:
                out.append((name, path, handler))
    return out


async def _walk_denied(channel: Channel, role: Role) -> int:
    seen = 0
    for name, path, handler in checked_rpcs(role):
        permission = RPCS[name]
        with pytest.raises(grpclib.GRPCError) as e:
            async with channel.request(
                path,
                handler.cardinality,
                handler.request_type,
                handler.reply_type,
                timeout=5,
            ) as stream:
                await stream.send_message(handler.request_type(), end=True)
                await stream.recv_message()
        assert e.value.status == Status.PERMISSION_DENIED, (name, role, e.value.message)
        assert permission in (e.value.message or ""), (name, role)
        assert role.value in (e.value.message or ""), (name, role)
        seen += 1
    return seen


async def test_certificate_roles_walk_the_permission_table(served_tls: Served) -> None:
    await served_tls.init_ca()
    boot = served_tls.channel(*await served_tls.admin_issue(pki.Kind.BOOTSTRAP, "node-001"))
    service = served_tls.channel(*await served_tls.admin_issue(pki.Kind.SCHEDULER, "scheduler"))

    denied_bootstrap = await _walk_denied(boot, Role.BOOTSTRAP)
    denied_service = await _walk_denied(service, Role.SERVICE)
    served_rpcs = sum(len(b.__mapping__(b())) for b in SERVED)
    # a bootstrap certificate may only read the CA and ask for its node's certificate
    assert denied_bootstrap > 40 and denied_bootstrap > served_rpcs // 2
    assert denied_service > 25
    assert denied_bootstrap > denied_service

    # what they hold is not stopped by the table
    ca = await v1.AdminServiceStub(boot, timeout=5).get_certificate_authority(
        v1.GetCertificateAuthorityRequest()
    )
    assert ca.cert_pem
    listed = await nodes(service).list_nodes(v1.ListNodesRequest())
    assert listed.nodes == []
    await v1.AdminServiceStub(service, timeout=5).get_certificate_authority(
        v1.GetCertificateAuthorityRequest()
    )
    # a service certificate names no node: it is not an agent and gets no node certificate
    csr, _ = csr_for(pki.Kind.AGENT, "scheduler")
    status, err = await grpc_error(
        nodes(service).sign_node_certificate(
            v1.SignNodeCertificateRequest(node_id="scheduler", csr_pem=csr)
        )
    )
    assert status == "PERMISSION_DENIED" and "node.certificate" in err["message"]


# --------------------------------------------------------------------------- handshakes


async def test_the_grpc_listener_refuses_at_the_handshake(served_tls: Served) -> None:
    now = time.time()
    foreign_ca = pki.create_ca(SITE, now=now)  # same name, another key
    foreign = pki.issue(
        *foreign_ca, kind=pki.Kind.AGENT, name="node-001", site=SITE, now=now, lifetime=600
    )
    expired = served_tls.site_issue(pki.Kind.AGENT, "node-001", now=now - 7200, lifetime=60)
    assert pki.validity(expired[0])[1] < now
    refused = {
        "no client certificate": served_tls.channel(),
        "a foreign CA": served_tls.channel(*foreign),
        "an expired certificate": served_tls.channel(*expired),
        "plaintext": served_tls.plaintext_channel(),
    }
    method = "/lattice.v1.NodeService/ListNodes"

    def handled() -> float:  # calls of ListNodes the interceptor saw, whatever the answer
        statuses = ("OK", "UNAUTHENTICATED", "PERMISSION_DENIED", "INTERNAL")
        return sum(grpc_requests(method, s) for s in statuses)

    before = handled()
    for why, channel in refused.items():
        with pytest.raises(StreamTerminatedError, match="Connection lost"):
            await nodes(channel).list_nodes(v1.ListNodesRequest())
        assert handled() == before, why  # refused before any handler
    # the same listener, a valid certificate, in the same test
    valid = served_tls.channel(*served_tls.site_issue(pki.Kind.AGENT, "node-001"))
    assert (await nodes(valid).list_nodes(v1.ListNodesRequest())).nodes == []
    assert handled() == before + 1


async def test_a_certificate_expiring_on_an_open_connection(served_tls: Served) -> None:
    """The chain is checked at the handshake only; the interceptor checks notAfter on
    every call, so an agent that kept its connection past expiry is refused."""
    cert, key = served_tls.site_issue(pki.Kind.AGENT, "node-001", lifetime=3.0)
    not_after = pki.validity(cert)[1]
    stub = nodes(served_tls.channel(cert, key))
    await stub.register_node(register("node-001"))  # the connection is open
    await asyncio.sleep(max(0.0, not_after - time.time()) + 0.3)
    assert time.time() > not_after
    status, err = await grpc_error(stub.heartbeat(v1.HeartbeatRequest(node_id="node-001")))
    assert status == "UNAUTHENTICATED", err
    assert "expired" in err["message"] and "node-001" in err["message"]
    status, err = await grpc_error(stub.list_nodes(v1.ListNodesRequest()))
    assert status == "UNAUTHENTICATED"
    # a new connection with it does not get past the handshake
    with pytest.raises(StreamTerminatedError):
        await nodes(served_tls.channel(cert, key)).list_nodes(v1.ListNodesRequest())


# --------------------------------------------------------------------------- rotation


async def test_rotating_the_ca_keeps_old_certificates_and_signs_with_the_new(
    served_tls: Served,
) -> None:
    old = await served_tls.init_ca()
    cert, key = await served_tls.admin_issue(pki.Kind.AGENT, "node-001")
    load(cert).verify_directly_issued_by(load(old["cert_pem"]))

    new = await served_tls.init_ca(rotate=True)
    assert new["previous_pem"] == [old["cert_pem"]]
    # a new connection with the old CA's certificate: still trusted
    stub = nodes(served_tls.channel(cert, key))
    await stub.register_node(register("node-001"))
    await stub.heartbeat(v1.HeartbeatRequest(node_id="node-001", sequence=1))

    # renewal: the new certificate is signed by the new CA
    csr, renewed_key = csr_for(pki.Kind.AGENT, "node-001")
    issued = await stub.sign_node_certificate(
        v1.SignNodeCertificateRequest(node_id="node-001", csr_pem=csr)
    )
    renewed = load(issued.cert_pem)
    renewed.verify_directly_issued_by(load(new["cert_pem"]))
    with pytest.raises(InvalidSignature):
        renewed.verify_directly_issued_by(load(old["cert_pem"]))
    # the bundle to trust carries both
    assert new["cert_pem"] in issued.ca_pem and old["cert_pem"] in issued.ca_pem
    renewed_stub = nodes(served_tls.channel(issued.cert_pem.encode(), renewed_key))
    await renewed_stub.heartbeat(v1.HeartbeatRequest(node_id="node-001", sequence=2))
    # and an admin-issued service certificate too
    svc, _ = await served_tls.admin_issue(pki.Kind.SCHEDULER, "scheduler")
    load(svc).verify_directly_issued_by(load(new["cert_pem"]))


async def test_a_name_too_long_for_a_certificate_is_a_bad_request(served_tls: Served) -> None:
    await served_tls.init_ca()
    name = "nid" + "0" * 60
    csr, _ = csr_for(pki.Kind.AGENT, "short")  # no CSR can name it: make_csr fails too
    status, body = await served_tls.rest.call(
        "POST",
        "/api/v1/admin/ca/issue",
        ADMIN,
        {"kind": "agent", "name": name, "csr_pem": csr},
    )
    assert status == 400, body
