"""A fake SPIRE agent that serves the real SPIFFE Workload API on a unix socket, for tests.

Why this module exists: the node agent's identity cascade starts with the SPIFFE Workload
API (:mod:`lattice_agent.spiffe`) and no SPIRE runs here. :class:`FakeSpireAgent` is a
real grpclib server on a unix socket implementing ``/SpiffeWorkloadAPI/FetchX509SVID`` as
SPIRE does:

- a call without the metadata ``workload.spiffe.io: true`` is refused with
  ``InvalidArgument`` ("security header missing from request");
- with no SVID to serve the call fails with ``PermissionDenied`` ("no identity issued");
- otherwise the stream carries one ``X509SVIDResponse`` with every SVID (plus the
  federated bundles and CRLs it was given) and stays open: :meth:`FakeSpireAgent.rotate`
  replaces the SVIDs and pushes a new response on every open stream.

Failures are injected with :meth:`FakeSpireAgent.refuse` (any gRPC status) and
``behaviour`` (``"empty_response"``: a response without SVIDs; ``"end_stream"``: the stream
ends with OK and no response; both break the standard, which is the point). ``calls``
records the ``workload.spiffe.io`` values of every call, refused ones included.

:class:`SpiffeCA` mints SVIDs with ``cryptography`` (EC P-256): a self-signed CA (the
trust bundle, URI SAN ``spiffe://<trust domain>``) and leaves with exactly one URI SAN,
e.g. ``spiffe://<trust domain>/lattice/agent/<node_id>`` for node agents::

    ca = SpiffeCA("lattice.test")
    async with FakeSpireAgent(sock, [ca.issue_agent("n1")]) as spire:
        svid = await fetch_x509_svid(sock)
        spire.rotate(ca.issue_agent("n1", ttl=7200))
"""

from __future__ import annotations

import asyncio
import datetime
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import grpclib.const
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.server import Server, Stream
from lattice_agent.spiffe import (
    FETCH_X509_SVID,
    SECURITY_HEADER,
    X509SVID,
    X509SVIDRequest,
    X509SVIDResponse,
    agent_spiffe_id,
)

__all__ = ["FakeSpireAgent", "FakeSvid", "SpiffeCA", "mint_agent_svid"]

Behaviour = Literal["serve", "empty_response", "end_stream"]


@dataclass(frozen=True)
class FakeSvid:
    """What the Workload API serves for one identity, all DER (as on the wire)."""

    spiffe_id: str
    chain_der: bytes  # certificates concatenated, leaf first
    key_der: bytes  # PKCS#8, unencrypted
    bundle_der: bytes  # CA certificates of the trust domain, concatenated
    hint: str = ""

    def to_message(self) -> X509SVID:
        return X509SVID(
            spiffe_id=self.spiffe_id,
            x509_svid=self.chain_der,
            x509_svid_key=self.key_der,
            bundle=self.bundle_der,
            hint=self.hint,
        )


# --- minting --------------------------------------------------------------------------


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0)


def _name(cn: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Lattice test SPIRE"),
            x509.NameAttribute(NameOID.COMMON_NAME, cn),
        ]
    )


def _ca_cert(
    subject: str,
    uri: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    ttl: float,
) -> x509.Certificate:
    now = _now()
    issuer_name = _name(subject) if issuer is None else issuer[0].subject
    signing_key = key if issuer is None else issuer[1]
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(seconds=60))
        .not_valid_after(now + datetime.timedelta(seconds=ttl))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri)]), False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
    )
    return builder.sign(signing_key, hashes.SHA256())


class SpiffeCA:
    """The X.509 authority of one trust domain; :attr:`bundle_der` is its trust bundle."""

    def __init__(self, trust_domain: str = "lattice.test", *, ttl: float = 86400.0) -> None:
        self.trust_domain = trust_domain
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.cert = _ca_cert(
            f"{trust_domain} root", f"spiffe://{trust_domain}", self.key, None, ttl
        )

    @property
    def bundle_der(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.DER)

    @property
    def bundle_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(
        self, spiffe_id: str, *, ttl: float = 3600.0, intermediate: bool = False, hint: str = ""
    ) -> FakeSvid:
        """A leaf X.509-SVID for ``spiffe_id`` valid ``ttl`` seconds from now (backdated a
        minute); ``intermediate=True`` signs it through a fresh intermediate CA, which then
        follows the leaf in the chain."""
        if not spiffe_id.startswith(f"spiffe://{self.trust_domain}/"):
            raise ValueError(f"{spiffe_id!r} is not in trust domain {self.trust_domain}")
        issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] = (self.cert, self.key)
        chain_tail = b""
        if intermediate:
            ikey = ec.generate_private_key(ec.SECP256R1())
            icert = _ca_cert(
                f"{self.trust_domain} intermediate",
                f"spiffe://{self.trust_domain}",
                ikey,
                issuer,
                ttl + 3600,
            )
            issuer = (icert, ikey)
            chain_tail = icert.public_bytes(serialization.Encoding.DER)
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        leaf = (
            x509.CertificateBuilder()
            .subject_name(_name(spiffe_id.rsplit("/", 1)[-1]))
            .issuer_name(issuer[0].subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(seconds=60))
            .not_valid_after(now + datetime.timedelta(seconds=ttl))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=True,
                    data_encipherment=False,
                    key_agreement=True,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(
                x509.SubjectAlternativeName([x509.UniformResourceIdentifier(spiffe_id)]),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer[0].public_key()),  # type: ignore[arg-type]
                critical=False,
            )
            .sign(issuer[1], hashes.SHA256())
        )
        key_der = key.private_bytes(
            serialization.Encoding.DER,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        return FakeSvid(
            spiffe_id=spiffe_id,
            chain_der=leaf.public_bytes(serialization.Encoding.DER) + chain_tail,
            key_der=key_der,
            bundle_der=self.bundle_der,
            hint=hint,
        )

    def issue_agent(self, node_id: str, **kwargs: object) -> FakeSvid:
        """The SVID of node agent ``node_id``: ``spiffe://<td>/lattice/agent/<node_id>``."""
        return self.issue(agent_spiffe_id(self.trust_domain, node_id), **kwargs)  # type: ignore[arg-type]


def mint_agent_svid(
    node_id: str, trust_domain: str = "lattice.test", *, ttl: float = 3600.0
) -> tuple[SpiffeCA, FakeSvid]:
    """A fresh CA for ``trust_domain`` and a node agent SVID it signed."""
    ca = SpiffeCA(trust_domain)
    return ca, ca.issue_agent(node_id, ttl=ttl)


# --- the server -----------------------------------------------------------------------


class _WorkloadAPI:
    def __init__(self, fake: FakeSpireAgent) -> None:
        self.fake = fake

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            FETCH_X509_SVID: grpclib.const.Handler(
                self.fake._fetch_x509_svid,
                grpclib.const.Cardinality.UNARY_STREAM,
                X509SVIDRequest,
                X509SVIDResponse,
            )
        }


class FakeSpireAgent:
    """The SPIFFE Workload API (``FetchX509SVID``) on the unix socket ``socket_path``."""

    def __init__(
        self,
        socket_path: str,
        svids: Sequence[FakeSvid] = (),
        *,
        federated_bundles: Mapping[str, bytes] | None = None,
        crl: Sequence[bytes] = (),
    ) -> None:
        self.socket_path = socket_path
        self.svids: tuple[FakeSvid, ...] = tuple(svids)
        self.federated_bundles = dict(federated_bundles or {})
        self.crl = list(crl)
        self.behaviour: Behaviour = "serve"
        #: the ``workload.spiffe.io`` values of every call, in order (``()`` = header absent)
        self.calls: list[tuple[str, ...]] = []
        self._refusal: tuple[Status, str] | None = None
        self._streams: set[asyncio.Queue[X509SVIDResponse | None]] = set()
        self._server: Server | None = None

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> FakeSpireAgent:
        self._server = Server([_WorkloadAPI(self)])
        await self._server.start(path=self.socket_path)
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass

    async def __aenter__(self) -> FakeSpireAgent:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- control -----------------------------------------------------------------------

    def rotate(self, *svids: FakeSvid) -> None:
        """Serve ``svids`` from now on and push them on every open stream; with none,
        open streams end with ``PermissionDenied`` as SPIRE's do."""
        self.svids = tuple(svids)
        for queue in self._streams:
            queue.put_nowait(self._response())

    def refuse(self, status: Status | None, message: str = "") -> None:
        """Fail the next calls with ``status`` (``None``: serve again)."""
        self._refusal = None if status is None else (status, message)

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    async def wait_for_streams(self, n: int = 1, timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            while len(self._streams) < n:
                await asyncio.sleep(0.01)

    # -- the RPC -----------------------------------------------------------------------

    def _response(self) -> X509SVIDResponse | None:
        if not self.svids:
            return None
        return X509SVIDResponse(
            svids=[s.to_message() for s in self.svids],
            crl=list(self.crl),
            federated_bundles=dict(self.federated_bundles),
        )

    async def _fetch_x509_svid(self, stream: Stream[X509SVIDRequest, X509SVIDResponse]) -> None:
        values = tuple(stream.metadata.getall(SECURITY_HEADER[0], [])) if stream.metadata else ()
        self.calls.append(values)
        if values != (SECURITY_HEADER[1],):
            raise GRPCError(Status.INVALID_ARGUMENT, "security header missing from request")
        await stream.recv_message()
        if self._refusal is not None:
            raise GRPCError(*self._refusal)
        if self.behaviour == "end_stream":
            return
        queue: asyncio.Queue[X509SVIDResponse | None] = asyncio.Queue()
        queue.put_nowait(
            X509SVIDResponse() if self.behaviour == "empty_response" else self._response()
        )
        self._streams.add(queue)
        try:
            while True:
                response = await queue.get()
                if response is None:
                    raise GRPCError(Status.PERMISSION_DENIED, "no identity issued")
                await stream.send_message(response)
        finally:
            self._streams.discard(queue)
