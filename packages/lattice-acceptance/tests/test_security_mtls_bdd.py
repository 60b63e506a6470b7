"""Steps for features/security_mtls.feature: a cluster that runs as production does
(`lattice dev up --secure`) and what its mutual TLS lets through and keeps out.

The scenarios share the module's secure cluster: a site CA, one quorum member (TLS on
REST, mutual TLS on gRPC, encrypted Raft), a scheduler with a site-CA certificate, two
agents that started from bootstrap certificates, and the fake identity provider as a
process. Agent certificates live 6 s (LATTICE_TLS__AGENT_CERT_LIFETIME_SECONDS), so the
agents renew every 4 s while the scenarios run: a step that borrows an agent's
certificate re-reads it until the pair loads (the agent replaces the key, then the
certificate) and has a moment left to live.

People use the real `lattice` CLI after `lattice login --device` (the identity provider
approves at once, as alice; the administrator asks for the admin scope), each with a
token store of their own (XDG_CONFIG_HOME) kept for the module. Component-to-component
calls are made the way the components make them: grpclib channels with
lattice_common.pki client contexts, and pysyncobj's own utility client for Raft.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpclib
import pytest
import yaml
from cryptography import x509
from grpclib.client import Channel
from grpclib.exceptions import GRPCError, StreamTerminatedError
from lattice_acceptance.world import TIMEOUT, log_lines, show
from lattice_acceptance.world import World as ClusterWorld
from lattice_cli.devcluster import AgentProc
from lattice_cli.devsecure import SITE
from lattice_common import pki
from lattice_common.proto.lattice import v1
from lattice_common.rpc import decode_grpc_error
from lattice_test_harness.cluster import ClusterHandle
from lattice_test_harness.plugin import make_cluster
from pysyncobj.utility import TcpUtility, UtilityException
from pytest_bdd import given, parsers, scenarios, then, when

pytestmark = [pytest.mark.cluster]


scenarios("security_mtls.feature")

#: agent certificates live this long here (renewed at two thirds: every 4 s)
AGENT_LIFETIME = 6.0
#: who the feature names -> their token store; the role `lattice whoami` must show
PEOPLE = {"alice": ("alice", "user"), "the administrator": ("admin", "system-admin")}
ADMIN = "admin"


@pytest.fixture(scope="module")
def secure_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    base = tmp_path_factory.mktemp("security-mtls-bdd")
    env = {"LATTICE_TLS__AGENT_CERT_LIFETIME_SECONDS": f"{AGENT_LIFETIME:g}"}
    h = make_cluster(base / "cluster", members=1, agents=2, secure=True, env=env)
    yield h
    h.cluster.stop()


@dataclass
class World(ClusterWorld):
    outcome: Any = None  # what the scenario's last internal call returned or raised
    port: str = ""  # the internal port the scenario calls
    client: str = ""  # how it calls it
    certificate: bytes = b""  # the certificate the scenario is about
    key: bytes = b""
    metric_before: float = 0.0
    serial_before: str = ""  # the certificate a node held when the scenario began
    expiry_before: float = 0.0
    renewals_before: int = 0

    @property
    def people(self) -> Path:
        """The token stores of the people who logged in (kept for the module)."""
        return self.cluster.cluster.base.parent / "people"

    def cli(
        self, *args: str, user: str = "alice", ok: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """`lattice ...` as a person who logged in (their own token store); the
        cluster's CLI config names the endpoint and the site CA."""
        env = {**self.cluster.cli_env(), "XDG_CONFIG_HOME": str(self.people / user)}
        r = subprocess.run(
            [sys.executable, "-m", "lattice_cli.main", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            cwd=self.workdir,
        )
        self.last = r
        if ok:
            assert r.returncode == 0, show(r)
        assert "Traceback" not in r.stderr, show(r)
        return r

    # --- the cluster's files ------------------------------------------------------------

    @property
    def site_ca(self) -> bytes:
        assert self.cluster.cluster.secure is not None
        return self.cluster.cluster.secure.ca_cert.read_bytes()

    def internal_ca(self) -> bytes:
        """The internal CA's certificate, as `lattice admin ca show` gives it."""
        r = self.cli("admin", "ca", "show", "-o", "json", user=ADMIN)
        return str(json.loads(r.stdout)["cert_pem"]).encode()

    def tls_dir(self, node: str) -> Path:
        return self.cluster.cluster.base / "agents" / node / "tls"

    def kept_certificate(self, node: str) -> bytes:
        return (self.tls_dir(node) / "node" / "node.crt").read_bytes()

    def agent_credentials(self, node: str) -> tuple[bytes, bytes]:
        """The certificate and key an agent keeps, read as one pair (a renewal replaces
        them one after the other) with at least a second left to live."""
        d = self.tls_dir(node) / "node"

        def pair() -> tuple[bytes, bytes] | None:
            try:
                cert, key = (d / "node.crt").read_bytes(), (d / "node.key").read_bytes()
                pki.client_context([self.site_ca], cert, key)
            except (OSError, pki.CertError):
                return None
            return (cert, key) if pki.validity(cert)[1] - time.time() > 1.0 else None

        return self.cluster.wait_for(f"{node}'s certificate and key", pair, timeout=TIMEOUT)

    def member_credentials(self) -> tuple[bytes, bytes]:
        """lattice-server's own certificate (site CA, kind api)."""
        secure = self.cluster.cluster.secure
        assert secure is not None
        cert, key = secure.service_cert(pki.Kind.API, f"member-{self.member.id}")
        return cert.read_bytes(), key.read_bytes()

    @property
    def member(self) -> Any:
        return self.cluster.cluster.members[0]

    def agent_log(self, node: str) -> str:
        return self.cluster.cluster.log_path(f"agent-{node}").read_text(errors="replace")

    def mismatch_metric(self, node: str) -> float:
        """lattice_node_identity_mismatch_total{node=...} on /metrics (0 before the first)."""
        import urllib.request

        secure = self.cluster.cluster.secure
        assert secure is not None
        url = f"{self.cluster.url}/metrics"
        with urllib.request.urlopen(url, timeout=10, context=secure.client_context()) as r:
            text = r.read().decode()
        m = re.search(
            rf'^lattice_node_identity_mismatch_total\{{node="{re.escape(node)}"\}} (\S+)$',
            text,
            re.MULTILINE,
        )
        return float(m.group(1)) if m else 0.0

    def renewals(self, node: str) -> int:
        return self.agent_log(node).count("certificate renewed: quorum-ca")


@pytest.fixture
def world(secure_cluster: ClusterHandle, tmp_path: Path) -> Iterator[World]:
    w = World.on(secure_cluster, tmp_path)
    yield w
    w.clean_up()
    w.wait_idle()


def _call(host: str, port: int, ctx: Any, rpc: Callable[[Channel], Awaitable[Any]]) -> Any:
    """One gRPC call on a fresh channel: its answer, or what the client got instead."""

    async def go() -> Any:
        ch = Channel(host, port, ssl=ctx)
        try:
            return await asyncio.wait_for(rpc(ch), 15)
        finally:
            ch.close()

    try:
        return asyncio.run(go())
    except Exception as e:  # the refusal the scenario looks at
        return e


def _to_member(world: World, ctx: Any, rpc: Callable[[v1.NodeServiceStub], Awaitable[Any]]) -> Any:
    return _call(
        "127.0.0.1", world.member.grpc_port, ctx, lambda ch: rpc(v1.NodeServiceStub(ch, timeout=5))
    )


def _identity(world: World, node: str) -> str:
    return world.node_field(node, "Agent identity")


def _shown_serial(world: World, node: str) -> str | None:
    """The serial `lattice nodes NODE` shows for a quorum-CA identity."""
    m = re.fullmatch(
        r"quorum-ca \(serial ([0-9A-F]{1,16}), expires \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ\)",
        _identity(world, node),
    )
    return m.group(1) if m else None


def _node_cli(world: World, *args: str) -> Any:
    """`lattice nodes ...` as the administrator (node_field runs as the world's default)."""
    return world.cli("nodes", *args, user=ADMIN)


# --- background -------------------------------------------------------------------------


@given("a secure Lattice cluster: a site CA, TLS on the API, mutual TLS between its components")
def secure_cluster_given(world: World) -> None:
    c = world.cluster.cluster
    assert c.secure is not None and c.secure.ca_cert.is_file()
    assert c.rest_url.startswith("https://"), c.rest_url
    cfg = yaml.safe_load((world.member.dir / "config.yaml").read_text())
    # tls_ca on the member: its gRPC listener requires client certificates of that CA
    assert cfg["api"]["tls_ca"] == str(c.secure.ca_cert), cfg["api"]
    nodes = {n["id"]: n for n in world.cluster.nodes()}
    assert {"node-001", "node-002"} <= set(nodes), nodes
    assert all(n["state"] == "Ready" for n in nodes.values()), nodes


@given(parsers.parse('{who} has logged in with "{command}"'))
def logged_in(world: World, who: str, command: str) -> None:
    person, role = PEOPLE[who]
    args = shlex.split(command)
    assert args[:2] == ["lattice", "login"], command
    if world.cli("whoami", user=person, ok=False).returncode != 0:  # not yet in this module
        r = world.cli(*args[1:], "--timeout", "30", user=person)
        assert re.search(r"^Logged in to https://\S+ as alice until ", r.stdout, re.M), show(r)
    r = world.cli("whoami", user=person)
    fields = dict(re.findall(r"^(\w+):\s+(.*?)\s*$", r.stdout, re.MULTILINE))
    assert (fields.get("User"), fields.get("Role"), fields.get("Auth")) == (
        "alice",
        role,
        "oidc",
    ), show(r)


# --- a new node joins ---------------------------------------------------------------------


@when(parsers.parse('the administrator runs "{command}"'))
def admin_runs(world: World, command: str) -> None:
    args = shlex.split(command)
    assert args[0] == "lattice", command
    r = world.cli(*args[1:], user=ADMIN)
    m = re.match(r"Issued bootstrap certificate for (\S+): serial ([0-9A-F]+), expires ", r.stdout)
    assert m, show(r)
    world.node = m.group(1)
    out = world.workdir / args[args.index("--out") + 1]
    world.certificate = (out / f"{world.node}.crt").read_bytes()
    world.key = (out / f"{world.node}.key").read_bytes()
    named = pki.cert_identity(world.certificate)
    assert named is not None and (named.kind, named.name) == (pki.Kind.BOOTSTRAP, world.node)
    assert pki.serial_of(world.certificate) == m.group(2)


@when(parsers.parse("{node}'s agent starts with only that bootstrap certificate and the site CA"))
def start_new_agent(world: World, node: str) -> None:
    c = world.cluster.cluster
    assert node == world.node
    assert all(a.node_id != node for a in c.agents), f"{node} already has an agent"
    d = c.base / "agents" / node
    tls = d / "tls"
    tls.mkdir(parents=True, mode=0o700)
    (tls / "bootstrap.crt").write_bytes(world.certificate)
    (tls / "bootstrap.key").write_bytes(world.key)
    (tls / "bootstrap.key").chmod(0o600)
    assert not (tls / "node").exists()  # nothing from an earlier run: a new node
    agent = AgentProc(node_id=node, dir=d, group=len(c.agents) % c.groups)
    agent.tls_args = [
        "--bootstrap-cert",
        str(tls / "bootstrap.crt"),
        "--bootstrap-key",
        str(tls / "bootstrap.key"),
        "--bootstrap-ca",
        str(c.secure.ca_cert),  # type: ignore[union-attr]
        "--cert-dir",
        str(tls / "node"),
    ]
    c.agents.append(agent)  # stopped with the cluster
    c.start_agent(agent)


@then(parsers.parse("{node} becomes Ready"))
def becomes_ready(world: World, node: str) -> None:
    c = world.cluster
    c.wait_for(f"{node} Ready", lambda: c.node(node)["state"] == "Ready", timeout=TIMEOUT)


@then(
    parsers.parse(
        "{node}'s agent log says it exchanged its bootstrap certificate for a quorum-CA certificate"
    )
)
def exchanged(world: World, node: str) -> None:
    first = next(
        (json.loads(ln)["msg"] for ln in world.agent_log(node).splitlines() if '"identity: ' in ln),
        "",
    )
    assert re.fullmatch(
        r"identity: quorum-ca \(serial [0-9A-F]+, expires \S+\) \(from the bootstrap certificate\)",
        first,
    ), world.agent_log(node)[-3000:]


@then(
    parsers.parse(
        "the certificate {node} keeps names {name} and is signed by the internal CA that "
        '"lattice admin ca show" shows'
    )
)
def kept_certificate_signed(world: World, node: str, name: str) -> None:
    cert = world.kept_certificate(node)
    named = pki.cert_identity(cert)
    assert named is not None
    assert (named.kind, named.name, named.site) == (pki.Kind.AGENT, name, SITE), named
    assert (
        x509.load_pem_x509_certificate(cert)
        .subject.rfc4514_string()
        .startswith(f"CN={name}.{SITE}.lattice.internal")
    )
    ca = x509.load_pem_x509_certificate(world.internal_ca())
    x509.load_pem_x509_certificate(cert).verify_directly_issued_by(ca)  # raises if not


@then(
    parsers.parse(
        '"lattice nodes {node}" shows the agent identity "quorum-ca" with the serial of the '
        "certificate {keeper} keeps"
    )
)
def shows_identity(world: World, node: str, keeper: str) -> None:
    assert node == keeper

    def same() -> bool:
        shown = _shown_serial(world, node)
        return shown is not None and shown == pki.serial_of(world.kept_certificate(node))[:16]

    # the agent renews every 4 s: the API learns the new serial on its next call
    world.cluster.wait_for(f"{node}'s kept certificate in `lattice nodes {node}`", same, 15.0, 0.2)


@then(
    parsers.parse(
        '"lattice admin audit query --action cert.issue" shows that {node}\'s bootstrap '
        "identity was issued its agent certificate"
    )
)
def issue_audited(world: World, node: str) -> None:
    r = world.cli("admin", "audit", "query", "--action", "cert.issue", "-o", "json", user=ADMIN)
    entries = json.loads(r.stdout)
    boot = [e for e in entries if e["target"] == f"bootstrap:{node}"]
    assert [e["actor"] for e in boot] == ["alice"], show(r)  # the administrator issued it
    exchanged = [e for e in entries if e["actor"] == f"bootstrap:{node}"]
    assert exchanged and all(e["target"] == f"agent:{node}" for e in exchanged), show(r)


# --- a job --------------------------------------------------------------------------------


@when(parsers.parse('alice submits a job that prints "{text}"'))
def alice_submits(world: World, text: str) -> None:
    world.current = world.submit(
        "hello", f"echo {shlex.quote(text)}", directives=("--walltime=5m",), user="alice"
    )


@then("the job completes")
def job_completes(world: World) -> None:
    assert world.current is not None
    world.wait_end(world.current.name)


@then(parsers.parse('"lattice logs" shows alice the line "{text}"'))
def logs_show(world: World, text: str) -> None:
    assert world.current is not None
    r = world.cli("logs", world.current.id, user="alice")
    assert text in log_lines(r), show(r)


@then("the node that ran it is shown as authenticated by the quorum CA")
def ran_on_quorum_ca_node(world: World) -> None:
    assert world.current is not None
    nodes = world.get(world.current.name)["assigned_nodes"]
    assert len(nodes) == 1, nodes
    assert _shown_serial(world, nodes[0]) is not None, _identity(world, nodes[0])


# --- one node's certificate for another node ------------------------------------------------


@given(parsers.parse("the value of lattice_node_identity_mismatch_total for {node} is noted"))
def metric_noted(world: World, node: str) -> None:
    world.metric_before = world.mismatch_metric(node)


@when(
    parsers.parse("a client presents {owner}'s agent certificate and sends a heartbeat for {node}")
)
def heartbeat_as_other(world: World, owner: str, node: str) -> None:
    world.certificate, world.key = world.agent_credentials(owner)
    ctx = pki.client_context([world.site_ca], world.certificate, world.key)
    world.outcome = _to_member(
        world, ctx, lambda s: s.heartbeat(v1.HeartbeatRequest(node_id=node, sequence=1))
    )


@then(parsers.parse('it is refused with {status}: "{message}"'))
def refused_with(world: World, status: str, message: str) -> None:
    o = world.outcome
    assert isinstance(o, GRPCError), f"not refused by the server: {o!r}"
    assert o.status == grpclib.Status[status], repr(o)
    assert decode_grpc_error(o).message == message, repr(o)


@then(parsers.parse("lattice_node_identity_mismatch_total for {node} has gone up by {n:d}"))
def metric_up(world: World, node: str, n: int) -> None:
    assert world.mismatch_metric(node) == world.metric_before + n


@then(
    parsers.parse(
        '"lattice admin audit query --action node.identity_mismatch" shows that {owner}\'s '
        "certificate was refused for {node}"
    )
)
def mismatch_audited(world: World, owner: str, node: str) -> None:
    r = world.cli(
        "admin", "audit", "query", "--action", "node.identity_mismatch", "-o", "json", user=ADMIN
    )
    serial = pki.serial_of(world.certificate)
    ours = [e for e in json.loads(r.stdout) if e["details"].get("serial") == serial]
    assert [(e["actor"], e["target"], e["details"]["certificate_node"]) for e in ours] == [
        (f"agent:{owner}", f"node:{node}", owner)
    ], show(r)


@then(parsers.parse("{node} is still Ready, authenticated by the quorum CA"))
def still_ready(world: World, node: str) -> None:
    r = _node_cli(world, node, "-o", "json")
    shown = json.loads(r.stdout)
    assert shown["state"] == "Ready", show(r)
    assert shown["agent_identity"].startswith("quorum-ca (serial "), show(r)
    # its own agent's heartbeats go on being accepted (a refused impostor changes nothing)
    log = world.agent_log(node)
    assert "heartbeat via" not in log, log[-3000:]


# --- internal ports -------------------------------------------------------------------------


def _raft(world: World, password: str | None) -> Any:
    """A pysyncobj utility request ("status") to the member's Raft port."""
    try:
        return TcpUtility(password=password, timeout=5).executeCommand(
            f"127.0.0.1:{world.member.raft_port}", ["status"]
        )
    except UtilityException as e:
        return e


def _port_call(world: World, port: str, cert: bytes | None, key: bytes | None, tls: bool) -> Any:
    trust = [world.site_ca, world.internal_ca()]
    if port == "lattice-server's gRPC port":
        ctx = pki.client_context(trust, cert, key) if tls else None
        return _to_member(world, ctx, lambda s: s.list_nodes(v1.ListNodesRequest()))
    if port == "node-002's agent port":
        host, p = world.cluster.node("node-002")["agent_address"].rsplit(":", 1)
        ctx = pki.client_context(trust, cert, key, check_hostname=False) if tls else None
        return _call(
            host,
            int(p),
            ctx,
            lambda ch: v1.NodeAgentServiceStub(ch, timeout=5).cache_status(
                v1.GetCacheStatusRequest()
            ),
        )
    raise AssertionError(f"unknown port {port!r}")


@when(parsers.parse("a client that {client} calls {port}"))
def outsider_calls(world: World, client: str, port: str) -> None:
    world.port, world.client = port, client
    if port == "member 1's Raft port":
        assert world.member.id == 1
        password = {"speaks plaintext": None, "uses a wrong Raft password": "not-the-password"}
        world.outcome = _raft(world, password[client])
        return
    if client == "presents a certificate from a foreign CA":
        # a CA of its own with the same name and site, and a certificate it made for
        # node-001: only the key differs from the real thing
        now = time.time()
        ca, ca_key = pki.create_ca(SITE, now=now)
        cert, key = pki.issue(
            ca, ca_key, kind=pki.Kind.AGENT, name="node-001", site=SITE, now=now, lifetime=600
        )
        world.outcome = _port_call(world, port, cert, key, tls=True)
    elif client == "uses TLS without a client certificate":
        world.outcome = _port_call(world, port, None, None, tls=True)
    elif client == "speaks plaintext":
        world.outcome = _port_call(world, port, None, None, tls=False)
    else:
        raise AssertionError(f"unknown client {client!r}")


@then("the connection is closed without an answer")
def closed_without_answer(world: World) -> None:
    o = world.outcome
    assert isinstance(o, Exception), f"{world.port} answered a client that {world.client}: {o!r}"
    # a gRPC status (even a refusal) would be an answer from the application: the
    # handshake itself must fail
    assert not isinstance(o, GRPCError), repr(o)
    if isinstance(o, UtilityException):
        assert str(o) == "connection lost", repr(o)
    else:
        assert isinstance(o, (StreamTerminatedError, ConnectionError, OSError)), repr(o)


@then(parsers.parse("the same call with {insider} is answered"))
def insider_answered(world: World, insider: str) -> None:
    port = world.port
    if insider == "the cluster's Raft password":
        secure = world.cluster.cluster.secure
        assert secure is not None
        status = _raft(world, secure.raft_password.read_text())
        assert isinstance(status, dict) and status["has_quorum"], repr(status)
        return
    if insider == "node-001's agent certificate":
        cert, key = world.agent_credentials("node-001")
    elif insider == "lattice-server's certificate":
        cert, key = world.member_credentials()
    else:
        raise AssertionError(f"unknown insider {insider!r}")
    answer = _port_call(world, port, cert, key, tls=True)
    if port == "lattice-server's gRPC port":
        assert isinstance(answer, v1.ListNodesResponse), repr(answer)
        assert {"node-001", "node-002"} <= {n.id for n in answer.nodes}
    else:
        assert isinstance(answer, v1.NodeCacheStatus), repr(answer)
        assert (answer.node, answer.ok) == ("node-002", True), answer


# --- renewal --------------------------------------------------------------------------------


@given(parsers.parse("agent certificates on this cluster live {seconds:d} seconds"))
def lifetime(world: World, seconds: int) -> None:
    assert seconds == AGENT_LIFETIME
    start, end = pki.validity(world.kept_certificate("node-002"))
    # backdated by 5 % of the lifetime, both ends in whole seconds
    assert abs((end - start) - seconds) <= 1.5, (start, end)


@when(
    parsers.parse(
        "{node}'s agent has renewed its certificate {times:d} times, past the expiry of the "
        "one it held"
    )
)
def renewed(world: World, node: str, times: int) -> None:
    world.node = node
    cert = world.kept_certificate(node)
    world.serial_before = pki.serial_of(cert)
    world.expiry_before = pki.validity(cert)[1]
    world.renewals_before = world.renewals(node)
    world.cluster.wait_for(
        f"{times} more renewals of {node}'s certificate, past its expiry",
        lambda: (
            world.renewals(node) >= world.renewals_before + times
            and time.time() > world.expiry_before
        ),
        timeout=(times + 2) * AGENT_LIFETIME,
        interval=0.2,
    )


@then(parsers.parse("{node} keeps a certificate with a new serial from the internal CA"))
def new_serial(world: World, node: str) -> None:
    cert = world.kept_certificate(node)
    assert pki.serial_of(cert) != world.serial_before
    assert pki.validity(cert)[1] > world.expiry_before
    ca = x509.load_pem_x509_certificate(world.internal_ca())
    x509.load_pem_x509_certificate(cert).verify_directly_issued_by(ca)


@then(parsers.parse("{node}'s agent registered once and never lost its desired-state stream"))
def stream_kept(world: World, node: str) -> None:
    log = world.agent_log(node)
    assert log.count(f"registered node {node} ") == 1, log[-3000:]
    # the stream it opened with its first certificate carried on through every renewal
    assert "desired-state stream" not in log, log[-3000:]
    assert "certificate renewal failed" not in log, log[-3000:]


@then("a job on every node completes")
def job_on_every_node(world: World) -> None:
    world.wait_idle()
    count = len(world.cluster.nodes())
    job = world.submit(
        "everywhere", "", directives=(f"--nodes={count}", "--walltime=5m"), user="alice"
    )
    world.current = job
    a = world.wait_end("everywhere")
    assert world.node in a["assigned_nodes"], a


# --- bootstrap certificates -------------------------------------------------------------------


@given(parsers.parse("{node}'s bootstrap certificate, from when it joined"))
def bootstrap_certificate(world: World, node: str) -> None:
    d = world.tls_dir(node)
    world.certificate = (d / "bootstrap.crt").read_bytes()
    world.key = (d / "bootstrap.key").read_bytes()
    named = pki.cert_identity(world.certificate)
    assert named is not None and (named.kind, named.name) == (pki.Kind.BOOTSTRAP, node), named
    assert pki.validity(world.certificate)[1] > time.time() + 60  # still valid
    assert "(from the bootstrap certificate)" in world.agent_log(node)


def _as_bootstrap(world: World, rpc: Callable[[v1.NodeServiceStub], Awaitable[Any]]) -> None:
    ctx = pki.client_context([world.site_ca], world.certificate, world.key)
    world.outcome = _to_member(world, ctx, rpc)


@when(
    parsers.parse(
        "the bootstrap certificate asks lattice-server to sign a certificate request for {node}"
    )
)
def bootstrap_asks(world: World, node: str) -> None:
    world.node = node
    csr = pki.make_csr(pki.generate_key(), pki.Kind.AGENT, node, SITE).decode()
    _as_bootstrap(
        world,
        lambda s: s.sign_node_certificate(v1.SignNodeCertificateRequest(node_id=node, csr_pem=csr)),
    )


@then(parsers.parse("it gets an agent certificate for {node} from the internal CA"))
def gets_certificate(world: World, node: str) -> None:
    o = world.outcome
    assert not isinstance(o, Exception), repr(o)
    cert = o.cert_pem.encode()
    named = pki.cert_identity(cert)
    assert named is not None and (named.kind, named.name) == (pki.Kind.AGENT, node), named
    ca = x509.load_pem_x509_certificate(world.internal_ca())
    x509.load_pem_x509_certificate(cert).verify_directly_issued_by(ca)


@when("the bootstrap certificate lists the nodes")
def bootstrap_lists(world: World) -> None:
    _as_bootstrap(world, lambda s: s.list_nodes(v1.ListNodesRequest()))


@when(parsers.parse("the bootstrap certificate sends a heartbeat for {node}"))
def bootstrap_heartbeat(world: World, node: str) -> None:
    _as_bootstrap(world, lambda s: s.heartbeat(v1.HeartbeatRequest(node_id=node, sequence=1)))
