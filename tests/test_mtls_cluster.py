"""A secure dev cluster (`lattice dev up --secure`) as real processes: TLS on both API
listeners, mTLS between every component, agents that start from a bootstrap
certificate and renew their quorum-CA certificate while running, encrypted Raft.

What a user and an operator would notice: jobs run and their logs come back through
the API's mTLS channel to the agent; `lattice nodes ID` says how the agent
authenticated; a renewal keeps the agent's desired-state stream; one node's
certificate cannot heartbeat for another node; a foreign CA's certificate, no
certificate and plaintext are refused on every internal port.
"""

from __future__ import annotations

import asyncio
import pickle
import re
import socket
import ssl
import struct
import time
import zlib
from pathlib import Path
from typing import Any

import grpclib
import pytest
from grpclib.client import Channel
from lattice_common import pki
from lattice_common.proto.lattice import v1
from lattice_test_harness.plugin import make_cluster

pytestmark = pytest.mark.cluster

#: agent certificates live 9 s here, so renewals (at 2/3: 6 s) happen during the test
AGENT_LIFETIME = 9.0


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Any:
    env = {"LATTICE_TLS__AGENT_CERT_LIFETIME_SECONDS": str(AGENT_LIFETIME)}
    h = make_cluster(tmp_path_factory.mktemp("secure"), members=1, agents=2, secure=True, env=env)
    yield h
    h.cluster.stop()


def _agent_files(h: Any, node: str) -> tuple[bytes, bytes, bytes]:
    d = h.cluster.base / "agents" / node / "tls" / "node"
    return (d / "node.crt").read_bytes(), (d / "node.key").read_bytes(), (d / "ca.pem").read_bytes()


def _member(h: Any) -> Any:
    return h.cluster.members[0]


def _grpc(h: Any, cert: bytes | None, key: bytes | None, trust: list[bytes] | None = None) -> Any:
    site_ca = h.cluster.secure.ca_cert.read_bytes()
    ctx = pki.client_context(trust or [site_ca], cert, key)
    return Channel("127.0.0.1", _member(h).grpc_port, ssl=ctx)


def _agent_log(h: Any, node: str) -> str:
    return (h.cluster.log_path(f"agent-{node}")).read_text(errors="replace")


def test_jobs_run_and_logs_come_back_over_mtls(secure: Any) -> None:
    h = secure
    a = h.submit("echo hello-over-mtls", nodes=1)
    done = h.wait_state(a["id"], ("Completed", "Failed"), timeout=60)
    assert done["state"] == "Completed"
    assert "hello-over-mtls" in h.logs(a["id"])  # API -> agent over mTLS
    # the nodes say how their agents authenticated: the cascade's quorum-CA step
    node = h.request("GET", "/api/v1/nodes/node-001")
    assert node["agent_identity"].startswith("quorum-ca (serial ")


def test_renewal_keeps_the_desired_state_stream(secure: Any) -> None:
    h = secure
    node = "node-001"
    first = pki.serial_of(_agent_files(h, node)[0])
    deadline = time.monotonic() + 6 * AGENT_LIFETIME
    while time.monotonic() < deadline and _agent_log(h, node).count("certificate renewed") < 4:
        time.sleep(0.5)
    log = _agent_log(h, node)
    assert log.count("certificate renewed") >= 4, log[-2000:]
    assert pki.serial_of(_agent_files(h, node)[0]) != first
    # the stream opened before the renewals never broke, even past the first
    # certificate's expiry
    assert "desired-state stream" not in log, log[-2000:]
    # and work still reaches the agent through it
    a = h.submit("echo after-renewal", nodes=2)
    assert h.wait_state(a["id"], ("Completed", "Failed"), timeout=60)["state"] == "Completed"
    serial = h.request("GET", f"/api/v1/nodes/{node}")["agent_identity"]
    assert re.search(r"serial [0-9A-F]{16}", serial)


def test_one_nodes_certificate_cannot_heartbeat_for_another(secure: Any) -> None:
    h = secure
    cert, key, _ca = _agent_files(h, "node-001")

    async def go() -> tuple[Any, Any]:
        ch = _grpc(h, cert, key)
        stub = v1.NodeServiceStub(ch, timeout=10)
        try:
            own = await stub.list_nodes(v1.ListNodesRequest())  # an agent may read nodes
            with pytest.raises(grpclib.GRPCError) as e:
                await stub.heartbeat(v1.HeartbeatRequest(node_id="node-002", sequence=10**9))
            return own, e.value
        finally:
            ch.close()

    own, err = asyncio.run(go())
    assert err.status == grpclib.Status.UNAUTHENTICATED
    assert "node-001" in err.message and "node-002" in err.message
    assert len(own.nodes) == 2
    metrics = _metrics(h)
    assert 'lattice_node_identity_mismatch_total{node="node-001"}' in metrics


def _metrics(h: Any) -> str:
    import urllib.request

    ctx = h.cluster.secure.client_context()
    with urllib.request.urlopen(f"{h.url}/metrics", timeout=10, context=ctx) as r:
        return r.read().decode()


def _refused(coro_factory: Any) -> BaseException:
    async def go() -> BaseException:
        try:
            await coro_factory()
        except BaseException as e:  # what the client sees when the server refuses
            return e
        raise AssertionError("the call succeeded")

    return asyncio.run(go())


def test_foreign_ca_no_certificate_and_plaintext_are_refused(secure: Any, tmp_path: Path) -> None:
    h = secure
    now = time.time()
    foreign_ca, foreign_key = pki.create_ca("dev", now=now)
    fcert, fkey = pki.issue(
        foreign_ca,
        foreign_key,
        kind=pki.Kind.AGENT,
        name="node-001",
        site="dev",
        now=now,
        lifetime=600,
    )

    async def call(cert: bytes | None, key: bytes | None) -> Any:
        ch = _grpc(h, cert, key)
        try:
            return await v1.NodeServiceStub(ch, timeout=5).list_nodes(v1.ListNodesRequest())
        finally:
            ch.close()

    async def plaintext() -> Any:
        ch = Channel("127.0.0.1", _member(h).grpc_port)
        try:
            return await v1.NodeServiceStub(ch, timeout=5).list_nodes(v1.ListNodesRequest())
        finally:
            ch.close()

    for factory in (lambda: call(fcert, fkey), lambda: call(None, None), plaintext):
        e = _refused(factory)
        assert isinstance(
            e, (ConnectionError, OSError, ssl.SSLError, grpclib.exceptions.StreamTerminatedError)
        ), repr(e)
    # the agents' own port: an API-side caller without the right certificate is refused
    agent_addr = h.request("GET", "/api/v1/nodes/node-002")["agent_address"]
    host, port = agent_addr.rsplit(":", 1)

    async def agent_plain() -> Any:
        ch = Channel(host, int(port))
        try:
            return await v1.NodeAgentServiceStub(ch, timeout=5).cache_status(
                v1.GetCacheStatusRequest()
            )
        finally:
            ch.close()

    e = _refused(agent_plain)
    assert isinstance(e, (ConnectionError, OSError, grpclib.exceptions.StreamTerminatedError)), (
        repr(e)
    )
    # Raft: a well-formed plaintext pysyncobj frame (length, zlib(pickle)) asking for
    # the member's status gets the connection closed and nothing back
    payload = zlib.compress(pickle.dumps("status"))
    with socket.create_connection(("127.0.0.1", _member(h).raft_port), timeout=5) as s:
        s.sendall(struct.pack("i", len(payload)) + payload)
        s.settimeout(5)
        assert s.recv(1024) == b""


def test_a_restarted_agent_comes_back_with_a_certificate(secure: Any) -> None:
    h = secure
    a = next(x for x in h.cluster.agents if x.node_id == "node-002")
    h.cluster.stop_agent(a)
    h.cluster.start_agent(a)  # its stored certificate first, else its bootstrap one
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if _agent_log(h, "node-002").count("identity: quorum-ca") >= 2:
            break
        time.sleep(0.2)
    assert _agent_log(h, "node-002").count("identity: quorum-ca") >= 2
    b = h.submit("echo back", nodes=2)
    assert h.wait_state(b["id"], ("Completed", "Failed"), timeout=60)["state"] == "Completed"
