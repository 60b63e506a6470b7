"""Certificates between components (spec: Security Architecture, internal service
authentication and certificate rotation): the pure part.

Every Lattice certificate names one component: the common name is
``{name}.{site}.lattice.internal`` (``node-042.alps.lattice.internal`` for the agent of
node-042) and the organisational unit says what it is (:class:`Kind`). A node agent's
SPIFFE X.509-SVID names it by a URI SAN ``spiffe://{trust domain}/lattice/agent/{node}``
instead. :func:`peer_identity` reads either from what ``ssl`` reports about a verified
peer, so the API and the agents decide who called from one function.

Certificates are short-lived and renewed at two thirds of their lifetime
(:func:`renew_at`); TLS contexts are built here and reloaded in place
(:func:`load_pair`), so connections opened after a renewal present the new certificate
while open ones (an agent's desired-state stream) carry on.

Keys are EC P-256. Nothing here reads the clock: callers pass ``now``.
"""

from __future__ import annotations

import datetime as dt
import enum
import ipaddress
import os
import ssl
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "BOOTSTRAP_MAX_LIFETIME",
    "CertError",
    "CertIdentity",
    "Kind",
    "ca_name",
    "cert_identity",
    "client_context",
    "common_name",
    "create_ca",
    "generate_key",
    "issue",
    "load_pair",
    "make_csr",
    "peer_identity",
    "renew_at",
    "server_context",
    "sign_csr",
]

DOMAIN = "lattice.internal"
BOOTSTRAP_MAX_LIFETIME = 3600.0  # spec: bootstrap certificates live an hour at most
SPIFFE_PATH = "/lattice/"


class Kind(enum.StrEnum):
    """What a certificate identifies (its OU)."""

    AGENT = "agent"  # a node agent; name = node id
    BOOTSTRAP = "bootstrap"  # first contact of a node agent; may only ask for its certificate
    API = "api"  # a lattice-server member (server and client)
    SCHEDULER = "scheduler"
    CHECKPOINT = "checkpoint"
    ACCOUNTING = "accounting"


class CertError(ValueError):
    """A certificate, key or request that cannot be used, with the reason."""


@dataclass(frozen=True, slots=True)
class CertIdentity:
    """Who a verified peer certificate names. ``source``: ``cert`` (a Lattice
    certificate) or ``spiffe`` (an X.509-SVID)."""

    kind: Kind
    name: str
    site: str
    serial: str
    not_after: float
    source: str = "cert"
    issuer: str = ""  # the issuing CA's common name

    @property
    def mode(self) -> str:
        """Which step of the identity cascade it comes from: spiffe, quorum-ca (the
        cluster's internal CA), bootstrap, or site-ca (a certificate provisioned from
        the site's PKI)."""
        if self.source == "spiffe":
            return "spiffe"
        if self.kind is Kind.BOOTSTRAP:
            return "bootstrap"
        return "quorum-ca" if self.issuer == ca_name(self.site) else "site-ca"

    @property
    def node_id(self) -> str:
        """The node an agent or bootstrap certificate is for ("" for services)."""
        return self.name if self.kind in (Kind.AGENT, Kind.BOOTSTRAP) else ""


def ca_name(site: str) -> str:
    """The common name of the internal CA of ``site`` (:func:`create_ca`)."""
    return f"Lattice CA {site}.{DOMAIN}"


#: X.509 limits a common name to 64 characters
MAX_COMMON_NAME = 64


def common_name(name: str, site: str) -> str:
    if not name or "." in name or not site:
        raise CertError(f"cannot name a certificate for {name!r} at site {site!r}")
    cn = f"{name}.{site}.{DOMAIN}"
    if len(cn) > MAX_COMMON_NAME:
        raise CertError(
            f"{cn!r} is {len(cn)} characters; a certificate name has at most {MAX_COMMON_NAME}"
        )
    return cn


def generate_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def load_cert(pem: bytes) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError as e:
        raise CertError(f"not a PEM certificate: {e}") from None


def _load_key(pem: bytes) -> Any:
    try:
        return serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as e:
        raise CertError(f"not an unencrypted PEM private key: {e}") from None


def _time(epoch: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(epoch, dt.UTC)


def create_ca(
    site: str,
    *,
    now: float,
    lifetime: float = 10 * 365 * 86400.0,
    name: str = "",
) -> tuple[bytes, bytes]:
    """A self-signed CA for ``site``: (certificate PEM, key PEM). Its common name is
    ``name``, by default :func:`ca_name` (the cluster's internal CA; a site PKI's root
    has its own name)."""
    key = generate_key()
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Lattice"),
            x509.NameAttribute(NameOID.COMMON_NAME, name or ca_name(site)),
        ]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_time(now - 60))
        .not_valid_after(_time(now + lifetime))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
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
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert_pem(cert), key_pem(key)


def make_csr(key: ec.EllipticCurvePrivateKey, kind: Kind, name: str, site: str) -> bytes:
    """A certificate request (PEM) for ``name`` as ``kind``."""
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(_subject(kind, name, site))
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM)


def _subject(kind: Kind, name: str, site: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Lattice"),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, kind.value),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name(name, site)),
        ]
    )


def _san(cn: str, hosts: Iterable[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = [x509.DNSName(cn)]
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def sign_csr(
    ca_cert_pem: bytes,
    ca_key_pem: bytes,
    csr_pem: bytes,
    *,
    kind: Kind,
    name: str,
    site: str,
    now: float,
    lifetime: float,
    hosts: Iterable[str] = (),
) -> bytes:
    """Sign ``csr_pem`` as ``kind``/``name``: the request's subject must be exactly the
    one :func:`make_csr` writes for them (a node asking for another node's name is
    refused here, whatever the caller checked). Returns the certificate PEM."""
    if kind is Kind.BOOTSTRAP and lifetime > BOOTSTRAP_MAX_LIFETIME:
        raise CertError(f"a bootstrap certificate lives at most {BOOTSTRAP_MAX_LIFETIME:.0f} s")
    if lifetime <= 0:
        raise CertError("the certificate lifetime must be positive")
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError as e:
        raise CertError(f"not a PEM certificate request: {e}") from None
    if not csr.is_signature_valid:
        raise CertError("the certificate request's signature does not verify")
    want = _subject(kind, name, site)
    if csr.subject != want:
        raise CertError(
            f"the request names {csr.subject.rfc4514_string()!r}; "
            f"expected {want.rfc4514_string()!r}"
        )
    ca_cert = load_cert(ca_cert_pem)
    ca_key = _load_key(ca_key_pem)
    not_after = min(now + lifetime, ca_cert.not_valid_after_utc.timestamp())
    # backdated a little for clocks that lag the CA's, never so much that the renewal
    # point (2/3 of not_before..not_after) falls before the certificate was issued
    skew = min(60.0, lifetime * 0.05)
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH]
    cert = (
        x509.CertificateBuilder()
        .subject_name(want)
        .issuer_name(ca_cert.subject)
        .public_key(csr.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_time(now - skew))
        .not_valid_after(_time(not_after))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(_san(common_name(name, site), hosts), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert_pem(cert)


def issue(
    ca_cert_pem: bytes,
    ca_key_pem: bytes,
    *,
    kind: Kind,
    name: str,
    site: str,
    now: float,
    lifetime: float,
    hosts: Iterable[str] = (),
) -> tuple[bytes, bytes]:
    """A new key and its certificate: (certificate PEM, key PEM)."""
    key = generate_key()
    csr = make_csr(key, kind, name, site)
    cert = sign_csr(
        ca_cert_pem,
        ca_key_pem,
        csr,
        kind=kind,
        name=name,
        site=site,
        now=now,
        lifetime=lifetime,
        hosts=hosts,
    )
    return cert, key_pem(key)


def validity(pem: bytes) -> tuple[float, float]:
    """(not_before, not_after) of a PEM certificate, epoch seconds."""
    cert = load_cert(pem)
    return cert.not_valid_before_utc.timestamp(), cert.not_valid_after_utc.timestamp()


def serial_of(pem: bytes) -> str:
    return f"{load_cert(pem).serial_number:X}"


def renew_at(pem: bytes) -> float:
    """When to renew: two thirds into the certificate's lifetime (spec: CertRotator)."""
    start, end = validity(pem)
    return start + (end - start) * 2 / 3


# ---------------------------------------------------------------------------------------
# who is on the other end
# ---------------------------------------------------------------------------------------


def _rdn(subject: Iterable[Any], field: str) -> str:
    for rdn in subject or ():
        for key, value in rdn:
            if key == field:
                return str(value)
    return ""


def peer_identity(peercert: Mapping[str, Any] | None) -> CertIdentity | None:
    """The component a verified peer certificate names (``ssl.getpeercert()`` form),
    or None when there is none or it names nothing Lattice knows."""
    if not peercert:
        return None
    not_after = ssl.cert_time_to_seconds(peercert["notAfter"]) if "notAfter" in peercert else 0.0
    raw = str(peercert.get("serialNumber", ""))
    serial = f"{int(raw, 16):X}" if raw else ""  # OpenSSL pads to whole bytes; serial_of does not
    issuer = _rdn(peercert.get("issuer", ()), "commonName")
    for typ, value in peercert.get("subjectAltName", ()):
        if typ == "URI" and str(value).startswith("spiffe://"):
            rest = str(value)[len("spiffe://") :]
            domain, _, path = rest.partition("/")
            parts = ("/" + path).removeprefix(SPIFFE_PATH).split("/")
            if len(parts) == 2 and parts[0] == Kind.AGENT and parts[1]:
                site = domain.removesuffix("." + DOMAIN)
                return CertIdentity(Kind.AGENT, parts[1], site, serial, not_after, "spiffe", issuer)
    subject = peercert.get("subject", ())
    cn = _rdn(subject, "commonName")
    ou = _rdn(subject, "organizationalUnitName")
    try:
        kind = Kind(ou)
    except ValueError:
        return None
    name, _, rest = cn.partition(".")
    site = rest.removesuffix("." + DOMAIN)
    if not name or not site or site == rest:
        return None
    return CertIdentity(kind, name, site, serial, not_after, "cert", issuer)


def cert_identity(pem: bytes) -> CertIdentity | None:
    """What a PEM certificate names (the first certificate of a chain), as
    :func:`peer_identity` reads it from a handshake."""
    cert = load_cert(pem)

    def rdns(name: x509.Name) -> tuple[tuple[tuple[str, str], ...], ...]:
        short = {
            NameOID.COMMON_NAME: "commonName",
            NameOID.ORGANIZATIONAL_UNIT_NAME: "organizationalUnitName",
        }
        return tuple(((short[a.oid], str(a.value)),) for a in name if a.oid in short)

    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = tuple(("URI", u) for u in san.get_values_for_type(x509.UniformResourceIdentifier))
    except x509.ExtensionNotFound:
        uris = ()
    return peer_identity(
        {
            "subject": rdns(cert.subject),
            "issuer": rdns(cert.issuer),
            "subjectAltName": uris,
            "serialNumber": f"{cert.serial_number:X}",
            "notAfter": cert.not_valid_after_utc.strftime("%b %d %H:%M:%S %Y GMT"),
        }
    )


# ---------------------------------------------------------------------------------------
# TLS contexts
# ---------------------------------------------------------------------------------------


def load_pair(ctx: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    """Load a certificate chain and key given as PEM bytes into ``ctx`` (replacing what
    it had: handshakes from now on present them). ``ssl`` only reads files, so they pass
    through a private temporary directory that is removed at once."""
    with tempfile.TemporaryDirectory(prefix="lattice-tls-") as d:
        os.chmod(d, 0o700)
        cpath, kpath = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
        fd = os.open(kpath, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
        with open(cpath, "wb") as f:
            f.write(cert)
        try:
            ctx.load_cert_chain(cpath, kpath)
        except ssl.SSLError as e:
            raise CertError(f"certificate and key do not load: {e}") from None


def _trust(ctx: ssl.SSLContext, bundles: Iterable[bytes]) -> None:
    loaded = False
    for pem in bundles:
        if pem:
            ctx.load_verify_locations(cadata=pem.decode())
            loaded = True
    if not loaded:
        raise CertError("no CA certificate to trust")


def server_context(
    cert: bytes,
    key: bytes,
    trust: Iterable[bytes] = (),
    *,
    client_certs: str = "required",
    alpn: str | None = "h2",
) -> ssl.SSLContext:
    """A server context. ``client_certs``: ``required`` (mTLS: a peer without a
    certificate from a trusted CA fails the handshake), ``optional`` (one is checked
    when presented) or ``none``. ``alpn``: ``h2`` for gRPC, None for HTTP/1.1."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    load_pair(ctx, cert, key)
    if client_certs != "none":
        _trust(ctx, trust)
        ctx.verify_mode = ssl.CERT_REQUIRED if client_certs == "required" else ssl.CERT_OPTIONAL
    if alpn:
        ctx.set_alpn_protocols([alpn])
    return ctx


def client_context(
    trust: Iterable[bytes],
    cert: bytes | None = None,
    key: bytes | None = None,
    *,
    check_hostname: bool = True,
    alpn: str | None = "h2",
) -> ssl.SSLContext:
    """A client context trusting ``trust`` (PEM bundles) and, with ``cert``/``key``,
    presenting them."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _trust(ctx, trust)
    ctx.check_hostname = check_hostname
    if cert and key:
        load_pair(ctx, cert, key)
    if alpn:
        ctx.set_alpn_protocols([alpn])
    return ctx
