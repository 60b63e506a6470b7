"""The node agent's identity (spec: agent authentication, the identity cascade).

At start the agent takes the first identity it can get, in this order:

1. **spiffe**: an X.509-SVID from the SPIFFE Workload API socket (``tls.spire_socket``),
   when the socket exists;
2. **quorum-ca**: a certificate of the cluster's internal CA kept in ``tls.cert_dir``
   from an earlier run, while it is valid;
3. **bootstrap files** (``tls.cert``/``tls.key``, LATTICE_BOOTSTRAP_*): a bootstrap
   certificate is exchanged at once for a quorum-CA certificate
   (NodeService.SignNodeCertificate with a request made here: the key never leaves the
   node); an agent certificate from the site's PKI is used as it is (**site-ca**);
4. **token**: ``LATTICE_AGENT_TOKEN`` as a bearer token (dev, tests, break-glass);
   with ``tls.ca`` the connection is still TLS, without a client certificate.

With a certificate the agent's own gRPC server is mutual TLS too: the API members and
the other agents present theirs. Certificates from the quorum CA or SPIFFE are renewed
at two thirds of their lifetime (:meth:`AgentTls.renew_loop`): the same TLS contexts are
loaded with the new pair, new connections present it, open streams carry on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import time
from collections.abc import Callable
from pathlib import Path

from grpclib.client import Channel
from grpclib.exceptions import GRPCError
from lattice_common import pki
from lattice_common.config import TlsConfig
from lattice_common.errors import FailedPrecondition, LatticeError, Unimplemented
from lattice_common.proto.lattice import v1
from lattice_common.rpc import TRANSPORT_ERRORS, Endpoints, decode_grpc_error

from lattice_agent.spiffe import SpiffeError, fetch_x509_svid

log = logging.getLogger("lattice.agent.tls")

#: the longest wait between two attempts to renew a certificate that failed
RENEW_RETRY_MAX = 300.0
#: the shortest time between two renewals (a certificate whose renewal point has passed
#: on arrival, e.g. a clock far behind the CA's, must not be renewed in a loop)
RENEW_MIN_INTERVAL = 1.0


class IdentityError(LatticeError):
    """No identity the configuration asks for could be obtained."""

    code = "unauthenticated"
    http_status = 401
    grpc_status = 16


class AgentTls:
    """The contexts of one agent: ``client`` (to lattice-server), ``peer`` (to other
    agents), ``server`` (its NodeAgentService); ``mode`` names the cascade's step."""

    def __init__(
        self,
        mode: str,
        *,
        trust: list[bytes],
        cert: bytes | None = None,
        key: bytes | None = None,
        node_id: str = "",
        tls: TlsConfig | None = None,
    ) -> None:
        self.mode = mode
        self.node_id = node_id
        self.tls = tls or TlsConfig()
        self.trust = list(trust)
        self.cert = cert
        self.key = key
        self.client = pki.client_context(trust, cert, key)
        self.peer: ssl.SSLContext | None = None
        self.server: ssl.SSLContext | None = None
        if cert and key:
            self.peer = pki.client_context(trust, cert, key, check_hostname=False)
            self.server = pki.server_context(cert, key, trust, client_certs="required")
        #: called after a renewal (the agent opens new connections)
        self.on_renewed: list[Callable[[], None]] = []

    @property
    def renewable(self) -> bool:
        return self.mode in ("quorum-ca", "spiffe") and self.cert is not None

    @property
    def not_after(self) -> float:
        return pki.validity(self.cert)[1] if self.cert else 0.0

    def describe(self) -> str:
        if not self.cert:
            return self.mode
        expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.not_after))
        return f"{self.mode} (serial {pki.serial_of(self.cert)[:16]}, expires {expires})"

    def trust_more(self, pems: list[bytes]) -> None:
        new = [p for p in pems if p and p not in self.trust]
        for pem in new:
            for ctx in (self.client, self.peer, self.server):
                if ctx is not None:
                    ctx.load_verify_locations(cadata=pem.decode())
        self.trust.extend(new)

    def load(self, cert: bytes, key: bytes) -> None:
        """Present this pair from the next handshake on."""
        for ctx in (self.client, self.peer, self.server):
            if ctx is not None:
                pki.load_pair(ctx, cert, key)
        self.cert, self.key = cert, key
        for cb in self.on_renewed:
            cb()

    # --- renewal ----------------------------------------------------------------------

    async def renew_loop(self, endpoints: Endpoints, metadata: dict[str, str] | None) -> None:
        """Renew at two thirds of the lifetime, retrying with backoff until it works
        (and warning as the expiry nears); runs until cancelled."""
        delay = 5.0
        while self.renewable:
            wait = pki.renew_at(self.cert) - time.time()  # type: ignore[arg-type]
            await asyncio.sleep(max(wait, RENEW_MIN_INTERVAL))
            try:
                await self.renew(endpoints, metadata)
                delay = 5.0
            except (LatticeError, SpiffeError, *TRANSPORT_ERRORS) as e:
                left = self.not_after - time.time()
                log.warning(
                    "certificate renewal failed (%s); it expires in %.0f s; retrying in %.0f s",
                    getattr(e, "message", e),
                    left,
                    delay,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, RENEW_RETRY_MAX)

    async def renew(self, endpoints: Endpoints, metadata: dict[str, str] | None) -> None:
        if self.mode == "spiffe":
            svid = await fetch_x509_svid(self.tls.spire_socket)
            self.trust_more([svid.bundle_pem])
            self.load(svid.cert_chain_pem, svid.key_pem)
        else:
            cert, key, ca = await request_certificate(
                endpoints.channel(), self.node_id, self.tls.site, metadata
            )
            self.trust_more([ca])
            store(Path(self.tls.cert_dir), cert, key, ca)
            self.load(cert, key)
        log.info("certificate renewed: %s", self.describe())


# ---------------------------------------------------------------------------------------
# the cascade
# ---------------------------------------------------------------------------------------


async def request_certificate(
    channel: Channel, node_id: str, site: str, metadata: dict[str, str] | None
) -> tuple[bytes, bytes, bytes]:
    """(certificate, key, CA bundle) for this node from the quorum CA: the key is made
    here and only the request travels."""
    key = pki.generate_key()
    csr = pki.make_csr(key, pki.Kind.AGENT, node_id, site)
    stub = v1.NodeServiceStub(channel, metadata=metadata)
    try:
        resp = await stub.sign_node_certificate(
            v1.SignNodeCertificateRequest(node_id=node_id, csr_pem=csr.decode()), timeout=10
        )
    except GRPCError as e:
        raise decode_grpc_error(e) from None
    return resp.cert_pem.encode(), pki.key_pem(key), resp.ca_pem.encode()


def store(cert_dir: Path, cert: bytes, key: bytes, ca: bytes) -> None:
    """Keep the quorum-CA certificate for the next start (key mode 0600, replaced
    atomically)."""
    cert_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    for name, data, mode in (
        ("node.key", key, 0o600),
        ("node.crt", cert, 0o644),
        ("ca.pem", ca, 0o644),
    ):
        tmp = cert_dir / f".{name}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, cert_dir / name)


def _stored(cert_dir: Path, node_id: str, now: float) -> tuple[bytes, bytes, bytes] | None:
    """The certificate an earlier run kept, if it is valid now, names this node as an
    agent and matches its key; anything else is ignored (with a warning when present)."""
    try:
        cert = (cert_dir / "node.crt").read_bytes()
        key = (cert_dir / "node.key").read_bytes()
        ca = (cert_dir / "ca.pem").read_bytes()
    except OSError:
        return None
    try:
        start, end = pki.validity(cert)
        named = pki.cert_identity(cert)
        pki.load_pair(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), cert, key)
    except pki.CertError as e:
        log.warning("ignoring the certificate kept in %s: %s", cert_dir, e)
        return None
    if named is None or named.kind is not pki.Kind.AGENT or named.node_id != node_id:
        log.warning("ignoring the certificate kept in %s: it is not node %s's", cert_dir, node_id)
        return None
    return (cert, key, ca) if start <= now < end else None


async def acquire(
    node_id: str,
    endpoint: str,
    tls: TlsConfig,
    token: str | None,
    metadata: dict[str, str] | None,
) -> AgentTls | None:
    """The first identity of the cascade; None when the configuration asks for no TLS
    (no ``tls.ca``, no SPIFFE socket): plaintext, with the token if there is one."""
    site_ca = [Path(tls.ca).read_bytes()] if tls.ca else []
    # 1. SPIFFE
    if os.path.exists(tls.spire_socket):
        try:
            svid = await fetch_x509_svid(tls.spire_socket)
        except SpiffeError as e:
            log.warning("SPIFFE Workload API at %s: %s", tls.spire_socket, e.message)
        else:
            named = pki.cert_identity(svid.cert_chain_pem)
            if named is None or named.kind is not pki.Kind.AGENT or named.node_id != node_id:
                raise IdentityError(
                    f"the SPIFFE Workload API gave {svid.spiffe_id}, not node {node_id}'s identity",
                    hint="Register this node's agent in SPIRE as "
                    f"spiffe://<site>.lattice.internal/lattice/agent/{node_id}.",
                )
            ident = AgentTls(
                "spiffe",
                trust=[*site_ca, svid.bundle_pem],
                cert=svid.cert_chain_pem,
                key=svid.key_pem,
                node_id=node_id,
                tls=tls,
            )
            log.info("identity: %s", ident.describe())
            return ident
    if not site_ca:
        return None
    # 2. a quorum-CA certificate from an earlier run
    kept = _stored(Path(tls.cert_dir), node_id, time.time())
    if kept is not None:
        cert, key, ca = kept
        named = pki.cert_identity(cert)
        if named is not None:
            tls = tls.model_copy(update={"site": named.site})
        ident = AgentTls(
            "quorum-ca", trust=[*site_ca, ca], cert=cert, key=key, node_id=node_id, tls=tls
        )
        log.info("identity: %s", ident.describe())
        return ident
    # 3. bootstrap files (they name the site)
    if tls.cert:
        cert, key = Path(tls.cert).read_bytes(), Path(tls.key).read_bytes()
        named = pki.cert_identity(cert)
        if named is None or named.node_id != node_id:
            raise IdentityError(
                f"the bootstrap certificate {tls.cert} is not for node {node_id}"
                + (f" (it names {named.kind.value} {named.name})" if named else ""),
                hint="Issue one with `lattice admin ca issue --kind bootstrap --name NODE`.",
            )
        tls = tls.model_copy(update={"site": named.site})
        if named.kind is pki.Kind.AGENT:
            ident = AgentTls("site-ca", trust=site_ca, cert=cert, key=key, node_id=node_id, tls=tls)
            log.info("identity: %s", ident.describe())
            return ident
        boot = AgentTls("bootstrap", trust=site_ca, cert=cert, key=key, node_id=node_id, tls=tls)
        try:
            got = await _exchange(boot, endpoint, node_id, tls.site)
        except (FailedPrecondition, Unimplemented) as e:
            if not token:
                raise IdentityError(
                    f"the bootstrap certificate cannot be exchanged: {e.message}",
                    hint=e.hint or "Run `lattice admin ca init` on the cluster.",
                ) from None
            log.warning(
                "bootstrap certificate not exchanged (%s); using the token (lattice-server "
                "must then accept connections without a client certificate)",
                e.message,
            )
        else:
            cert, key, ca = got
            store(Path(tls.cert_dir), cert, key, ca)
            ident = AgentTls(
                "quorum-ca", trust=[*site_ca, ca], cert=cert, key=key, node_id=node_id, tls=tls
            )
            log.info("identity: %s (from the bootstrap certificate)", ident.describe())
            return ident
    # 4. the token, over TLS without a client certificate
    if token:
        log.info("identity: token (TLS without a client certificate)")
        return AgentTls("token", trust=site_ca, node_id=node_id, tls=tls)
    raise IdentityError(
        "tls.ca is set but the agent has no identity: no SPIFFE socket, no stored "
        "certificate, no bootstrap certificate, no token",
        hint="Give a bootstrap certificate (--bootstrap-cert/--bootstrap-key, from "
        "`lattice admin ca issue --kind bootstrap --name NODE`) or LATTICE_AGENT_TOKEN.",
    )


async def _exchange(
    boot: AgentTls, endpoint: str, node_id: str, site: str
) -> tuple[bytes, bytes, bytes]:
    endpoints = Endpoints(endpoint, ssl=boot.client)
    delay = 1.0
    try:
        for attempt in range(6):
            try:
                return await request_certificate(endpoints.channel(), node_id, site, None)
            except (*TRANSPORT_ERRORS, ssl.SSLError) as e:
                if attempt == 5:
                    raise IdentityError(
                        f"cannot reach lattice-server to exchange the bootstrap certificate: {e}",
                        hint="Check --quorum-endpoint and that the bootstrap certificate has "
                        "not expired (1 h).",
                    ) from None
                endpoints.rotate()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
    finally:
        with contextlib.suppress(Exception):
            endpoints.close()
    raise AssertionError("unreachable")  # pragma: no cover


__all__ = ["AgentTls", "IdentityError", "acquire", "request_certificate", "store"]
