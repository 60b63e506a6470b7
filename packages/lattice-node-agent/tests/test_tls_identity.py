"""The node agent's identity cascade (lattice_agent.tls_identity) against the real API.

Every step of ``acquire`` -- SPIFFE Workload API socket, the quorum-CA certificate kept
in ``tls.cert_dir``, bootstrap files (exchanged, or a site-CA agent certificate used as
is), the agent token -- and the renewal of a quorum-CA certificate (``AgentTls.renew``,
``renew_loop``), over the real gRPC/REST servers of lattice-server (serve_local_api with
a mutual ServerTls) and a FakeSpireAgent on a unix socket. Nothing of the API is mocked:
where a test proves that *no* call is made, the endpoint is a port that refuses
connections.

The site's PKI is a CA made with pki.create_ca: it signed the server's certificate
(127.0.0.1, kind api) and is trusted for client certificates; the cluster's internal CA
is created over REST (`lattice admin ca init`) and trusted by the listener at once."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import pytest
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from lattice_agent.tls_identity import AgentTls, IdentityError, acquire
from lattice_api.settings import ApiSettings
from lattice_api.tls import ServerTls
from lattice_common import pki
from lattice_common.config import TlsConfig
from lattice_common.proto.lattice import v1
from lattice_common.rpc import Endpoints
from lattice_quorum import queries
from lattice_test_harness.fake_spire import FakeSpireAgent, SpiffeCA
from lattice_test_harness.local_api import LocalApi, serve_local_api

pytestmark = pytest.mark.timeout(60)

SITE = "alps"
TRUST_DOMAIN = f"{SITE}.lattice.internal"
SECRET = "tls-identity-test-secret-that-is-long-enough!"
AGENT_TOKEN = "agent-token-tls-identity-0123456789"
NODE = "node-001"
OTHER = "node-002"
TLS_LOG = "lattice.agent.tls"


def admin_headers() -> dict[str, str]:
    claims = {"sub": "root", "exp": int(time.time()) + 600, "scope": "admin"}
    return {"authorization": f"Bearer {jwt.encode(claims, SECRET, algorithm='HS256')}"}


def token_metadata() -> dict[str, str]:
    return {"authorization": f"Bearer {AGENT_TOKEN}"}


def register(node_id: str) -> v1.RegisterNodeRequest:
    return v1.RegisterNodeRequest(node=v1.Node(id=node_id, hostname=f"{node_id}.example"))


def identity_string(cert: bytes) -> str:
    """What the API records for an agent presenting ``cert`` (ops.nodes.describe_identity)."""
    named = pki.cert_identity(cert)
    assert named is not None
    expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(named.not_after))
    return f"{named.mode} (serial {named.serial[:16]}, expires {expires})"


@contextlib.contextmanager
def refusing_port() -> Iterator[str]:
    """``host:port`` of a socket bound but not listening: every connection is refused,
    so an acquire that tried to call the API would fail (never hang)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory for unix sockets (sun_path holds 107 bytes; tmp_path may not)."""
    d = tempfile.mkdtemp(prefix="lt-tls-", dir="/tmp")
    try:
        yield Path(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------- the site


@dataclass
class SitePki:
    """The site's PKI and the agent's files under ``root``."""

    root: Path
    ca: tuple[bytes, bytes]

    @property
    def ca_path(self) -> str:
        return str(self.root / "site-ca.pem")

    @property
    def cert_dir(self) -> Path:
        return self.root / "state" / "tls"

    @property
    def absent_socket(self) -> str:
        return str(self.root / "no-spire" / "agent.sock")

    def issue(
        self,
        kind: pki.Kind,
        name: str,
        *,
        site: str = SITE,
        now: float | None = None,
        lifetime: float = 600.0,
        hosts: tuple[str, ...] = (),
    ) -> tuple[bytes, bytes]:
        t = time.time() if now is None else now
        return pki.issue(
            *self.ca, kind=kind, name=name, site=site, now=t, lifetime=lifetime, hosts=hosts
        )

    def files(self, cert: bytes, key: bytes, stem: str = "bootstrap") -> tuple[str, str]:
        """Write a pair as the operator would hand it to the agent."""
        cpath, kpath = self.root / f"{stem}.crt", self.root / f"{stem}.key"
        cpath.write_bytes(cert)
        kpath.write_bytes(key)
        kpath.chmod(0o600)
        return str(cpath), str(kpath)

    def config(self, **over: Any) -> TlsConfig:
        """The agent's tls section: the site CA, no SPIFFE socket, cert_dir under root."""
        fields: dict[str, Any] = {
            "site": SITE,
            "ca": self.ca_path,
            "spire_socket": self.absent_socket,
            "cert_dir": str(self.cert_dir),
        }
        fields.update(over)
        return TlsConfig(**fields)


@pytest.fixture
def site(tmp_path: Path) -> SitePki:
    s = SitePki(tmp_path, pki.create_ca(SITE, now=time.time(), name=f"{SITE} site root"))
    Path(s.ca_path).write_bytes(s.ca[0])
    return s


@dataclass
class Served:
    api: LocalApi
    rest: aiohttp.ClientSession
    rest_url: str

    @property
    def endpoint(self) -> str:
        return self.api.grpc_address

    async def call(self, method: str, path: str, body: Any = None) -> Any:
        async with self.rest.request(
            method, self.rest_url + path, json=body, headers=admin_headers()
        ) as r:
            got = await r.json()
            assert r.status == 200, got
            return got

    async def init_ca(self) -> dict[str, Any]:
        """`lattice admin ca init`"""
        return await self.call("POST", "/api/v1/admin/ca", {"rotate": False})

    async def admin_issue(self, kind: pki.Kind, name: str) -> tuple[bytes, bytes]:
        """`lattice admin ca issue`: a certificate of the internal CA (key made here)."""
        key = pki.generate_key()
        csr = pki.make_csr(key, kind, name, SITE).decode()
        body = await self.call(
            "POST", "/api/v1/admin/ca/issue", {"kind": kind.value, "name": name, "csr_pem": csr}
        )
        return body["cert_pem"].encode(), pki.key_pem(key)

    def internal_ca(self) -> tuple[bytes, bytes]:
        cert, key, _previous = self.api.quorum.read(queries.certificate_authority)
        return cert.encode(), key.encode()

    async def agent_identity(self, node_id: str) -> str:
        """`GET /api/v1/nodes/ID`: how the node's agent authenticated at its last call."""
        body = await self.call("GET", f"/api/v1/nodes/{node_id}")
        return str(body["agent_identity"])


@contextlib.asynccontextmanager
async def serve(
    site: SitePki, *, extra_trust: tuple[bytes, ...] = (), agent_lifetime: float | None = None
) -> AsyncIterator[Served]:
    """lattice-server over a LocalQuorum: mutual TLS on gRPC, trusting the site CA (and
    ``extra_trust``, e.g. a SPIFFE bundle), HMAC tokens, the agent token."""
    cert, key = site.issue(pki.Kind.API, "api", lifetime=3600, hosts=("127.0.0.1",))
    tls = ServerTls(cert, key, [site.ca[0], *extra_trust], mutual=True)
    settings_tls = TlsConfig(site=SITE)
    if agent_lifetime is not None:
        settings_tls = TlsConfig(site=SITE, agent_cert_lifetime_seconds=agent_lifetime)
    async with serve_local_api(
        hmac_secret=SECRET,
        agent_token=AGENT_TOKEN,
        tls=tls,
        settings=ApiSettings(tls=settings_tls),
    ) as api:
        connector = aiohttp.TCPConnector(ssl=pki.client_context([site.ca[0]], alpn=None))
        async with aiohttp.ClientSession(connector=connector) as session:
            yield Served(api, session, f"https://{api.host}:{api.rest_port}")


@contextlib.asynccontextmanager
async def channel_of(served: Served, ident: AgentTls) -> AsyncIterator[v1.NodeServiceStub]:
    """A fresh connection made with the identity's ``client`` context."""
    host, port = served.endpoint.rsplit(":", 1)
    ch = Channel(host, int(port), ssl=ident.client)
    try:
        yield v1.NodeServiceStub(ch, timeout=5)
    finally:
        ch.close()


async def exchanged(served: Served, site: SitePki, **config: Any) -> AgentTls:
    """The first start of node-001 with a bootstrap certificate of the internal CA."""
    await served.init_ca()
    cpath, kpath = site.files(*await served.admin_issue(pki.Kind.BOOTSTRAP, NODE))
    ident = await acquire(
        NODE, served.endpoint, site.config(cert=cpath, key=kpath, **config), None, None
    )
    assert ident is not None and ident.mode == "quorum-ca"
    return ident


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --------------------------------------------------------------------------- 1. SPIFFE


async def test_spiffe_comes_first_and_the_api_takes_the_svid_for_its_node_only(
    site: SitePki, short_dir: Path
) -> None:
    spiffe = SpiffeCA(TRUST_DOMAIN)
    svid = spiffe.issue_agent(NODE)
    assert svid.spiffe_id == f"spiffe://{TRUST_DOMAIN}/lattice/agent/{NODE}"
    # bootstrap files and a token are configured too: they are not looked at
    cpath, kpath = site.files(*site.issue(pki.Kind.BOOTSTRAP, NODE))
    sock = str(short_dir / "spire.sock")
    async with (
        FakeSpireAgent(sock, [svid]) as spire,
        serve(site, extra_trust=(spiffe.bundle_pem,)) as served,
    ):
        cfg = site.config(cert=cpath, key=kpath, spire_socket=sock)
        ident = await acquire(NODE, served.endpoint, cfg, AGENT_TOKEN, token_metadata())
        assert ident is not None
        assert ident.mode == "spiffe"
        assert ident.renewable
        assert spire.calls == [("true",)]
        assert ident.cert is not None and pki.cert_identity(ident.cert) is not None
        assert spiffe.bundle_pem in ident.trust and site.ca[0] in ident.trust
        assert not site.cert_dir.exists()  # nothing exchanged, nothing stored
        assert ident.server is not None and ident.peer is not None

        async with channel_of(served, ident) as stub:
            got = await stub.register_node(register(NODE))
            assert got.node is not None and got.node.id == NODE
        recorded = await served.agent_identity(NODE)
        assert recorded.startswith("spiffe"), recorded
        assert recorded == identity_string(ident.cert) == ident.describe()

        # the agent of node-002 (its own SVID, same trust domain) posing as node-001
        other_sock = str(short_dir / "other.sock")
        async with FakeSpireAgent(other_sock, [spiffe.issue_agent(OTHER)]):
            cfg2 = site.config(spire_socket=other_sock, cert_dir=str(site.root / "other"))
            other = await acquire(OTHER, served.endpoint, cfg2, None, None)
        assert other is not None and other.mode == "spiffe"
        async with channel_of(served, other) as stub:
            with pytest.raises(GRPCError) as e:
                await stub.register_node(register(NODE))
            assert e.value.status == Status.UNAUTHENTICATED
            assert NODE in (e.value.message or "") and OTHER in (e.value.message or "")
            await stub.register_node(register(OTHER))  # as itself it is fine
        assert await served.agent_identity(NODE) == recorded  # node-001 not rebound

        # an agent whose SPIRE serves another node's SVID stops at once, saying so
        async with FakeSpireAgent(other_sock, [spiffe.issue_agent(OTHER)]):
            with pytest.raises(IdentityError) as wrong:
                await acquire(
                    NODE, served.endpoint, site.config(spire_socket=other_sock), None, None
                )
        assert OTHER in wrong.value.message and NODE in wrong.value.message
        assert "spiffe://" in wrong.value.hint


# --------------------------------------------------------------------------- 2. no socket


async def test_a_missing_spiffe_socket_falls_through(
    site: SitePki, caplog: pytest.LogCaptureFixture
) -> None:
    assert not os.path.exists(site.absent_socket)
    cpath, kpath = site.files(*site.issue(pki.Kind.AGENT, NODE), stem="agent")
    with caplog.at_level(logging.WARNING, logger=TLS_LOG), refusing_port() as nowhere:
        ident = await acquire(NODE, nowhere, site.config(cert=cpath, key=kpath), None, None)
        assert ident is not None and ident.mode == "site-ca"
        # and with no tls.ca either: plaintext, no error
        assert (
            await acquire(NODE, nowhere, TlsConfig(spire_socket=site.absent_socket), None, None)
            is None
        )
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# --------------------------------------------------------------------------- 3. stored


async def test_a_stored_certificate_is_used_without_calling_the_api_until_it_expires(
    site: SitePki,
) -> None:
    async with serve(site) as served:
        first = await exchanged(served, site)
        boot = site.config(cert=first.tls.cert, key=first.tls.key)
        internal_ca = served.internal_ca()
        stored = (site.cert_dir / "node.crt").read_bytes()
        assert stored == first.cert

        # the endpoint refuses connections: the stored certificate is enough (bootstrap
        # files and a token configured all the same; tls.site says otherwise)
        with refusing_port() as nowhere:
            async with asyncio.timeout(5):
                cfg = boot.model_copy(update={"site": "elsewhere"})
                again = await acquire(NODE, nowhere, cfg, AGENT_TOKEN, token_metadata())
        assert again is not None and again.mode == "quorum-ca"
        assert again.cert == stored and again.key == (site.cert_dir / "node.key").read_bytes()
        assert again.tls.site == SITE  # the site the stored certificate names
        assert internal_ca[0] in again.trust
        async with channel_of(served, again) as stub:
            await stub.register_node(register(NODE))
        assert await served.agent_identity(NODE) == identity_string(stored)

        # an expired stored certificate (of the same internal CA) is ignored: bootstrap
        now = time.time()
        old_cert, old_key = pki.issue(
            *internal_ca, kind=pki.Kind.AGENT, name=NODE, site=SITE, now=now - 7200, lifetime=60
        )
        assert pki.validity(old_cert)[1] < now
        (site.cert_dir / "node.crt").write_bytes(old_cert)
        (site.cert_dir / "node.key").write_bytes(old_key)
        renewed = await acquire(NODE, served.endpoint, boot, None, None)
        assert renewed is not None and renewed.mode == "quorum-ca"
        assert renewed.cert is not None and renewed.cert not in (old_cert, stored)
        assert (site.cert_dir / "node.crt").read_bytes() == renewed.cert
        assert pki.validity(renewed.cert)[1] > time.time()
        async with channel_of(served, renewed) as stub:
            await stub.register_node(register(NODE))
        assert await served.agent_identity(NODE) == identity_string(renewed.cert)


async def test_a_stored_certificate_of_another_node_or_a_broken_pair_is_ignored(
    site: SitePki,
) -> None:
    async with serve(site) as served:
        first = await exchanged(served, site)
        boot = site.config(cert=first.tls.cert, key=first.tls.key)
        internal_ca = served.internal_ca()
        now = time.time()
        # another node's certificate left in the directory
        other_cert, other_key = pki.issue(
            *internal_ca, kind=pki.Kind.AGENT, name="node-009", site=SITE, now=now, lifetime=600
        )
        (site.cert_dir / "node.crt").write_bytes(other_cert)
        (site.cert_dir / "node.key").write_bytes(other_key)
        got = await acquire(NODE, served.endpoint, boot, None, None)
        assert got is not None and got.mode == "quorum-ca"
        assert pki.cert_identity(got.cert).node_id == NODE
        # a certificate with a key that is not its own
        (site.cert_dir / "node.key").write_bytes(other_key)
        got = await acquire(NODE, served.endpoint, boot, None, None)
        assert got is not None and pki.cert_identity(got.cert).node_id == NODE
        async with channel_of(served, got) as stub:
            await stub.register_node(register(NODE))


# --------------------------------------------------------------------------- 4. bootstrap


async def test_a_bootstrap_certificate_is_exchanged_and_stored(site: SitePki) -> None:
    async with serve(site) as served:
        ca = await served.init_ca()
        boot_cert, boot_key = await served.admin_issue(pki.Kind.BOOTSTRAP, NODE)
        named_boot = pki.cert_identity(boot_cert)
        assert named_boot is not None and named_boot.kind is pki.Kind.BOOTSTRAP
        cpath, kpath = site.files(boot_cert, boot_key)
        # tls.site says otherwise: the bootstrap certificate's site wins
        cfg = site.config(cert=cpath, key=kpath, site="elsewhere")
        ident = await acquire(NODE, served.endpoint, cfg, None, None)
        assert ident is not None and ident.mode == "quorum-ca"
        assert ident.tls.site == SITE
        assert ident.cert is not None and ident.cert != boot_cert

        d = site.cert_dir
        assert {p.name for p in d.iterdir()} == {"node.crt", "node.key", "ca.pem"}
        assert mode_of(d) == 0o700
        assert mode_of(d / "node.key") == 0o600
        assert (d / "node.crt").read_bytes() == ident.cert
        assert (d / "node.key").read_bytes() == ident.key
        assert ca["cert_pem"].encode() in (d / "ca.pem").read_bytes()
        named = pki.cert_identity(ident.cert)
        assert named is not None
        assert (named.kind, named.name, named.site) == (pki.Kind.AGENT, NODE, SITE)
        assert named.mode == "quorum-ca"

        # it is the node's certificate for the API
        async with channel_of(served, ident) as stub:
            await stub.register_node(register(NODE))
            await stub.heartbeat(v1.HeartbeatRequest(node_id=NODE, sequence=1))
        recorded = await served.agent_identity(NODE)
        assert recorded.startswith("quorum-ca"), recorded
        assert recorded == ident.describe()


# --------------------------------------------------------------------------- 5. wrong node


async def test_a_bootstrap_certificate_of_another_node_is_refused(site: SitePki) -> None:
    cpath, kpath = site.files(*site.issue(pki.Kind.BOOTSTRAP, OTHER))
    with refusing_port() as nowhere, pytest.raises(IdentityError) as e:
        await acquire(NODE, nowhere, site.config(cert=cpath, key=kpath), AGENT_TOKEN, None)
    assert NODE in e.value.message and OTHER in e.value.message
    assert cpath in e.value.message
    assert "lattice admin ca issue --kind bootstrap" in e.value.hint
    assert not site.cert_dir.exists()


# --------------------------------------------------------------------------- 6. site CA


async def test_a_site_ca_agent_certificate_is_used_as_it_is(site: SitePki) -> None:
    cert, key = site.issue(pki.Kind.AGENT, NODE)
    cpath, kpath = site.files(cert, key, stem="agent")
    with refusing_port() as nowhere:
        async with asyncio.timeout(5):
            ident = await acquire(NODE, nowhere, site.config(cert=cpath, key=kpath), None, None)
    assert ident is not None and ident.mode == "site-ca"
    assert ident.cert == cert and ident.key == key
    assert not ident.renewable
    assert not site.cert_dir.exists()  # no exchange, nothing stored
    async with serve(site) as served, channel_of(served, ident) as stub:
        await stub.register_node(register(NODE))
        recorded = await served.agent_identity(NODE)
        assert recorded.startswith("site-ca") and recorded == ident.describe()


# --------------------------------------------------------------------------- 7. no CA yet


async def test_no_internal_ca_yet_falls_back_to_the_token_or_says_how_to_make_one(
    site: SitePki, caplog: pytest.LogCaptureFixture
) -> None:
    # a bootstrap certificate from the site's PKI: the handshake passes, the CA is missing
    cpath, kpath = site.files(*site.issue(pki.Kind.BOOTSTRAP, NODE))
    cfg = site.config(cert=cpath, key=kpath)
    async with serve(site) as served:
        with caplog.at_level(logging.WARNING, logger=TLS_LOG):
            ident = await acquire(NODE, served.endpoint, cfg, AGENT_TOKEN, token_metadata())
        assert ident is not None and ident.mode == "token"
        assert ident.cert is None and ident.server is None and ident.describe() == "token"
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("not exchanged" in w and "token" in w for w in warnings), warnings

        with pytest.raises(IdentityError) as e:
            await acquire(NODE, served.endpoint, cfg, None, None)
        assert "cannot be exchanged" in e.value.message
        assert "internal CA" in e.value.message
        assert "lattice admin ca init" in e.value.hint
    assert not site.cert_dir.exists()


# --------------------------------------------------------------------------- 8. nothing


async def test_tls_ca_without_any_identity_is_an_error_and_no_ca_is_plaintext(
    site: SitePki,
) -> None:
    with refusing_port() as nowhere:
        with pytest.raises(IdentityError) as e:
            await acquire(NODE, nowhere, site.config(), None, None)
        assert "no identity" in e.value.message
        assert "LATTICE_AGENT_TOKEN" in e.value.hint and "bootstrap" in e.value.hint
        # no tls.ca and no socket: plaintext (None), with or without a token
        plain = TlsConfig(spire_socket=site.absent_socket, cert_dir=str(site.cert_dir))
        assert await acquire(NODE, nowhere, plain, None, None) is None
        assert await acquire(NODE, nowhere, plain, AGENT_TOKEN, token_metadata()) is None


# --------------------------------------------------------------------------- 9. renew


async def test_renew_replaces_the_certificate_for_new_connections_only(site: SitePki) -> None:
    async with serve(site) as served:
        ident = await exchanged(served, site)
        assert ident.cert is not None
        old_cert, old_serial = ident.cert, pki.serial_of(ident.cert)
        endpoints = Endpoints(served.endpoint, ssl=ident.client)
        counts = {"a": 0, "b": 0}
        ident.on_renewed += [
            endpoints.renewed,
            lambda: counts.__setitem__("a", counts["a"] + 1),
            lambda: counts.__setitem__("b", counts["b"] + 1),
        ]
        try:
            before = v1.NodeServiceStub(endpoints.channel(), timeout=5)
            await before.register_node(register(NODE))
            assert await served.agent_identity(NODE) == identity_string(old_cert)

            await ident.renew(endpoints, None)

            assert counts == {"a": 1, "b": 1}
            assert ident.cert is not None and ident.cert != old_cert
            new_serial = pki.serial_of(ident.cert)
            assert new_serial != old_serial
            assert (site.cert_dir / "node.crt").read_bytes() == ident.cert
            assert (site.cert_dir / "node.key").read_bytes() == ident.key
            assert mode_of(site.cert_dir / "node.key") == 0o600
            assert ident.describe() == identity_string(ident.cert)

            # the connection opened before still works, and still presents the old one
            await before.heartbeat(v1.HeartbeatRequest(node_id=NODE, sequence=1))
            assert await served.agent_identity(NODE) == identity_string(old_cert)
            # the next call through the same Endpoints opens a new connection: new serial
            after = v1.NodeServiceStub(endpoints.channel(), timeout=5)
            await after.heartbeat(v1.HeartbeatRequest(node_id=NODE, sequence=2))
            recorded = await served.agent_identity(NODE)
            assert f"serial {new_serial[:16]}" in recorded
            assert recorded == identity_string(ident.cert)
            # and so does any new connection made with the client context
            await before.heartbeat(v1.HeartbeatRequest(node_id=NODE, sequence=3))
            async with channel_of(served, ident) as fresh:
                await fresh.register_node(register(NODE))
            assert await served.agent_identity(NODE) == recorded
        finally:
            endpoints.close()


# --------------------------------------------------------------------------- 10. loop


async def test_renew_loop_renews_a_short_lived_certificate_repeatedly(
    site: SitePki, caplog: pytest.LogCaptureFixture
) -> None:
    async with serve(site, agent_lifetime=3.0) as served:
        ident = await exchanged(served, site)
        start, end = pki.validity(ident.cert or b"")
        assert end - start < 5
        endpoints = Endpoints(served.endpoint, ssl=ident.client)
        renewals: list[float] = []
        serials: list[str] = []
        ident.on_renewed += [
            endpoints.renewed,
            lambda: renewals.append(time.monotonic()),
            lambda: serials.append(pki.serial_of(ident.cert or b"")),
        ]
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger=TLS_LOG):
            task = asyncio.create_task(ident.renew_loop(endpoints, None))
            try:
                await asyncio.sleep(6.0)
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                endpoints.close()
        assert len(renewals) >= 2, renewals
        assert renewals[0] - t0 >= 0.99  # RENEW_MIN_INTERVAL
        gaps = [b - a for a, b in itertools.pairwise(renewals)]
        assert all(g >= 0.99 for g in gaps), gaps
        assert len(set(serials)) == len(serials)  # a new certificate each time
        assert not [r for r in caplog.records if "renewal failed" in r.getMessage()]
        # the last one is the one on disk and the one a new connection presents
        assert (site.cert_dir / "node.crt").read_bytes() == ident.cert
        async with channel_of(served, ident) as stub:
            await stub.register_node(register(NODE))
        assert await served.agent_identity(NODE) == identity_string(ident.cert or b"")


# --------------------------------------------------------------------------- 11. describe


async def test_describe_names_mode_serial_and_expiry(site: SitePki) -> None:
    cert, key = site.issue(pki.Kind.AGENT, NODE, lifetime=1234)
    cpath, kpath = site.files(cert, key, stem="agent")
    with refusing_port() as nowhere:
        ident = await acquire(NODE, nowhere, site.config(cert=cpath, key=kpath), None, None)
        token = await acquire(NODE, nowhere, site.config(), AGENT_TOKEN, token_metadata())
    assert ident is not None and token is not None
    serial = pki.serial_of(cert)
    not_after = pki.validity(cert)[1]
    expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(not_after))
    text = ident.describe()
    assert text.startswith("site-ca ")
    assert f"serial {serial[:16]}" in text
    assert f"expires {expires}" in text
    assert text == f"site-ca (serial {serial[:16]}, expires {expires})"
    assert ident.not_after == not_after
    assert token.describe() == "token"
